"""The client's value types, shared by every driver: a received :class:`Message`, a
:class:`Result` of a call, a group :class:`Member`, a handler's :class:`Reply`.

No I/O and no event loop: the sans-I/O session (``session.py``) builds these from
frames, and the trio and blocking drivers hand them to the application as they are.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..errors import MalformedMessage, MsgqError, UsageError
from ..protocol.codes import Flag, FrameType
from ..protocol.errors import RemoteProtocolError
from ..protocol.framing import Frame, body_getter, close_fds, slot_maker

Buffer = bytes | bytearray | memoryview

#: Parsed source sections by their bytes (see :func:`split_source`), per connection.
Sources = dict[bytes, tuple[str, str, str, str | None]]
#: Entries a connection's source cache holds before it stops adding (the senders a
#: client hears from; a bound, like every cache here).
SOURCE_CACHE_MAX = 65536

_FLAG_TRACED = int(Flag.TRACED)
_KIND: dict[int, str] = {
    FrameType.MESSAGE: "message",
    FrameType.NOTIFY: "notification",
    FrameType.REQUEST: "request",
    FrameType.REPLY: "answer",
}


def split_source(source: bytes, cache: Sources) -> tuple[str, str, str, str | None]:
    """(sender lname, sender name, lname answers go to, relaying binder's name or None).

    A plain stamp is ``lname NUL name``: the sender, who also gets the answers. A
    relayed stamp (a binder such as the queue plugin forwarding stored traffic,
    docs/PROTOCOL.md "Source") is ``binder_lname NUL binder_name NUL origin_lname NUL
    origin_name``: the sender is the origin, answers go to the binder."""
    hit = cache.get(source)
    if hit is None:
        lname, _, name = source.partition(b"\0")
        hop = lname.decode()
        if b"\0" in name:
            via, _, origin = name.partition(b"\0")
            olname, _, oname = origin.partition(b"\0")
            hit = (olname.decode(), oname.decode(), hop, via.decode())
        else:
            hit = (hop, name.decode(), hop, None)
        if len(cache) < SOURCE_CACHE_MAX:
            cache[source] = hit
    return hit


class Message:
    """A message, notification or request received from the bus.

    ``sender`` / ``sender_name`` were stamped by the broker (a client cannot forge them).
    ``body`` and ``header`` are decoded on first access; ``attachments`` are binary blobs
    (memoryviews into the received frame, no copies).
    """

    __slots__ = ("_body", "_decoded", "_fds_taken", "_frame", "_header", "_sources")

    def __init__(self, frame: Frame, sources: Sources) -> None:
        self._frame = frame
        self._fds_taken = False
        self._sources = sources
        self._decoded = False
        self._body: object = None
        self._header: dict[str, object] | None = None

    @property
    def sender(self) -> str:
        """The sender's lname (``l.N``), as stamped by the broker."""
        return split_source(self._frame.source, self._sources)[0]

    @property
    def sender_name(self) -> str:
        """The sender's client name, as stamped by the broker."""
        return split_source(self._frame.source, self._sources)[1]

    @property
    def via(self) -> str | None:
        """The lname of the binder that relayed this message (a queue bound to the group
        stored it and forwarded it on behalf of ``sender``), or None if it came straight
        from ``sender``. Answers to a relayed request go to the binder."""
        hit = split_source(self._frame.source, self._sources)
        return hit[2] if hit[3] is not None else None

    @property
    def via_name(self) -> str | None:
        """The client name of the relaying binder (``msgq-queue-binder`` for the queue
        plugin), or None if the message came straight from ``sender``."""
        return split_source(self._frame.source, self._sources)[3]

    @property
    def _reply_to(self) -> str:
        """Where an answer goes: the sender, or the binder that relayed the request."""
        return split_source(self._frame.source, self._sources)[2]

    @property
    def kind(self) -> str:
        """``"message"``, ``"notification"``, ``"request"`` or ``"answer"``."""
        return _KIND[self._frame.type]

    @property
    def target(self) -> str:
        """The address the sender used (group, ``G[N]``, ``G[?]`` or an lname)."""
        return self._frame.target

    @property
    def request_id(self) -> int:
        return self._frame.request_id

    @property
    def header(self) -> dict[str, object]:
        """The decoded header map.

        Raises:
            MalformedMessage: the sender put a header that is not a well-formed CBOR map
                on the wire (its bug; nothing else is affected).
        """
        if self._header is None:
            try:
                self._header = self._frame.header()
            except RemoteProtocolError as exc:
                raise self._malformed("header", exc) from None
        return self._header

    def _malformed(self, section: str, exc: RemoteProtocolError) -> MalformedMessage:
        lname, name = split_source(self._frame.source, self._sources)[:2]
        return MalformedMessage(
            f"{self.kind} from {lname} ({name!r}) to {self.target!r} has a malformed "
            f"{section}: {exc}",
            f"{lname} {name}",
        )

    @property
    def event(self) -> str | None:
        """The event name of a notification (None for other kinds)."""
        ev = self.header.get("event")
        return ev if isinstance(ev, str) else None

    @property
    def traced(self) -> bool:
        """Whether the sender marked this frame as carrying a trace context (header
        ``traceparent``; docs/PROTOCOL.md, "Trace context")."""
        return bool(self._frame.flags & _FLAG_TRACED)

    @property
    def command(self) -> str | None:
        """The command name of a request (None for other kinds)."""
        cmd = self.header.get("cmd")
        return cmd if isinstance(cmd, str) else None

    @property
    def body(self) -> Any:
        """The decoded body (None if empty).

        Raises:
            MalformedMessage: the body is not one well-formed CBOR item; the broker does
                not decode bodies, so a sender's bug surfaces here, naming that sender.
        """
        if not self._decoded:
            try:
                self._body = self._frame.body()
            except RemoteProtocolError as exc:
                raise self._malformed("body", exc) from None
            self._decoded = True
        return self._body

    @property
    def attachments(self) -> list[memoryview]:
        return self._frame.blobs()

    @property
    def fds(self) -> tuple[int, ...]:
        """File descriptors that came with this message. The receiver owns them: keep
        them with :meth:`take_fds`, or let :meth:`close` / the ``with`` block close them."""
        return () if self._fds_taken else self._frame.fds

    def take_fds(self) -> list[int]:
        """Take ownership of the descriptors (the message will not close them)."""
        fds = list(self.fds)
        self._fds_taken = True
        return fds

    def close(self) -> None:
        """Close the descriptors not taken with :meth:`take_fds` (idempotent)."""
        if not self._fds_taken:
            self._fds_taken = True
            close_fds(self._frame.fds)

    def __enter__(self) -> Message:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def size(self) -> int:
        return len(self._frame.raw) + len(self._frame.large_body)

    def __repr__(self) -> str:
        return (
            f"<Message {self.kind} from {self.sender} ({self.sender_name}) "
            f"to {self.target!r} {self.size} bytes>"
        )


# With the compiled fast paths, Message.body's getter is in C (a received message's body
# is read once per message); the Python getter above is the reference and handles every
# error.
_body_py: Callable[[Message], Any] = Message.body.fget  # type: ignore[attr-defined]
setattr(  # noqa: B010
    Message,
    "body",
    property(body_getter(Message, "_frame", "_decoded", "_body", _body_py), doc=_body_py.__doc__),
)

#: ``Message(frame, sources)``, made in C with the compiled fast paths (a driver makes
#: one per received message; see :func:`~msgq_trio.protocol.framing.slot_maker`).
new_message = slot_maker(
    Message,
    ("_frame", "_sources"),
    {"_fds_taken": False, "_decoded": False, "_body": None, "_header": None},
)


@attrs.frozen
class Member:
    lname: str
    name: str
    pid: int = -1


@attrs.frozen
class Result:
    """One outcome of :meth:`Bus.call_many` / :meth:`Bus.call_all`: a value or an error."""

    target: str
    ok: bool
    value: Any = None
    error: MsgqError | None = None
    #: For call_all: the member (lname) that answered or failed.
    sender: str | None = None

    def unwrap(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class Reply:
    """Return this from a command handler to answer with descriptors or blobs.

    The descriptors are duplicated right here, so the handler keeps (and may close at
    once) its own; the duplicates are sent with the answer and then closed.

    Raises:
        UsageError: a descriptor is not open.
    """

    __slots__ = ("attachments", "fds", "result")

    def __init__(
        self, result: Any = None, *, fds: Sequence[int] = (), attachments: Sequence[Buffer] = ()
    ) -> None:
        self.result = result
        self.attachments = attachments
        self.fds = dup_all(fds)


def dup_all(fds: Sequence[int]) -> tuple[int, ...]:
    """Duplicates of ``fds`` (the caller keeps its own).

    Raises:
        UsageError: a descriptor is not open (the duplicates made so far are closed).
    """
    dups: list[int] = []
    try:
        for fd in fds:
            dups.append(os.dup(fd))
    except OSError as exc:
        close_fds(dups)
        raise UsageError(f"cannot send file descriptor {fd}: {exc}") from exc
    return tuple(dups)
