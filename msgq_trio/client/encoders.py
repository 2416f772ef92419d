"""The session's encoders of what a client sends (one-way messages, notifications,
batches, relayed traffic, descriptors), without I/O: mixed into
:class:`~msgq_trio.client.session.Session`, whose identity and caches they read."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import (
    UsageError,
)
from ..protocol.codes import ErrorCode
from ..protocol.errors import LocalProtocolError
from ..protocol.framing import (
    FdBuffer,
    close_fds,
    decode_cbor,
    encode_bytes_message,
    encode_cbor,
    encode_frame,
    encode_simple,
    encode_small_bytes,
)
from ..protocol.names import valid_target_name
from .calls import request_header
from .message import (
    Buffer,
    dup_all,
)
from .tracing import CURRENT, FLAG_TRACED, OTEL_MODULE, active, outgoing
from .wire import MESSAGE as _MESSAGE
from .wire import NOTIFY as _NOTIFY
from .wire import REQUEST as _REQUEST

log = logging.getLogger("msgq_trio.client")

__all__ = ["Encoders"]

#: Encoded targets cached per connection (bounded, like every cache here).
TARGET_CACHE_MAX = 4096
_current_trace = CURRENT.get
_modules = sys.modules
_OTEL = OTEL_MODULE


class Encoders:
    """The encoders of :class:`~msgq_trio.client.session.Session` (see the module)."""

    stamp: bytes
    max_fds: int
    fd_passing: bool
    _targets: dict[str, bytes]
    _no_join: int | None
    _next_rid: int

    # -- encoders --------------------------------------------------------------------
    def target(self, target: str) -> bytes:
        """``target`` encoded (cached, bounded).

        Raises:
            LocalProtocolError: ``target`` is a subscription pattern (``Zone.*``): the
                broker would refuse it; checked once per target, before it is cached.
        """
        tb = self._targets.get(target)
        if tb is None:
            why = valid_target_name(target)
            if why:
                raise LocalProtocolError(why, ErrorCode.BAD_REQUEST)
            tb = target.encode()
            if len(self._targets) < TARGET_CACHE_MAX:
                self._targets[target] = tb
        return tb

    def relay_stamp(self, origin: tuple[str, str]) -> bytes:
        """The relayed stamp for traffic forwarded on behalf of ``origin`` (``(lname,
        name)``): this client's stamp, NUL, the origin's lname, NUL, its name.

        Raises:
            UsageError: a name contains NUL.
        """
        lname, name = origin
        if "\0" in lname or "\0" in name:
            raise UsageError(f"on_behalf_of {origin!r}: names cannot contain NUL")
        return self.stamp + f"\0{lname}\0{name}".encode()

    def encode_message(
        self,
        target: str,
        body: Any = None,
        *,
        header: dict[str, object] | None = None,
        attachments: Sequence[Buffer] = (),
        fds: Sequence[int] = (),
        on_behalf_of: tuple[str, str] | None = None,
    ) -> bytes | list[Buffer]:
        """A one-way MESSAGE (one ``bytes`` in the common case); duplicates of ``fds``
        go with it (see :meth:`attach_fds`).

        Raises:
            UsageError: ``body`` or ``header`` cannot be encoded, a section is too long,
                or a descriptor cannot be sent.
        """
        flags = 0
        if _current_trace() is not None or _OTEL in _modules:
            out = outgoing(f"send {target}", "producer")
            if out is not None:
                out.end()  # a one-way frame's span is over once it is sent
                header = {**header, **out.fields} if header else out.fields
                flags = FLAG_TRACED
        try:
            if attachments or fds or on_behalf_of or flags:
                self.target(target)  # refuses a pattern
                pieces = encode_frame(
                    _MESSAGE,
                    target=target,
                    flags=flags,
                    header=encode_cbor(header) if header else b"",
                    body=encode_cbor(body) if body is not None else b"",
                    blobs=attachments,
                    n_fds=len(fds),
                    source=self.relay_stamp(on_behalf_of) if on_behalf_of else self.stamp,
                )
                return self.attach_fds(pieces, fds) if fds else pieces
            if type(body) is bytes and not header:
                return self.encode_bytes_message(target, body)
            tb = self._targets.get(target) or self.target(target)
            return encode_simple(
                _MESSAGE,
                tb,
                encode_cbor(body) if body is not None else b"",
                encode_cbor(header) if header else b"",
                source=self.stamp,
            )
        except LocalProtocolError as exc:
            raise UsageError(f"cannot send to {target!r}: {exc}") from exc

    def encode_bytes_message(self, target: str, body: bytes) -> bytes | list[Buffer]:
        """:meth:`encode_message` for the commonest message, a ``bytes`` body and nothing
        else (no header, attachments, descriptors or relaying), called positionally: the
        drivers' ``send`` takes this way for such a message, saving the general call's
        keyword arguments and checks on the path every small message takes.

        Raises:
            UsageError: ``target`` is malformed, or the frame would be too large.
        """
        if (_current_trace() is not None or _OTEL in _modules) and active():
            return self.encode_message(target, body)  # it carries the trace context
        try:
            tb = self._targets.get(target) or self.target(target)
            no_join = self._no_join
            if no_join is not None and len(body) >= no_join:
                # A large binary body goes out as it is (bytes cannot change under us):
                # no CBOR copy, no join; the driver sends both pieces in one sendmsg.
                return encode_bytes_message(_MESSAGE, tb, body, self.stamp)  # type: ignore[return-value]
            return encode_small_bytes(_MESSAGE, tb, body, self.stamp)
        except LocalProtocolError as exc:
            raise UsageError(f"cannot send to {target!r}: {exc}") from exc

    def encode_messages(self, target: str, bodies: Iterable[Any]) -> list[Buffer]:
        """One-way MESSAGEs to ``target``, one per body, in order: the pieces of all the
        frames, consecutive small ones joined into one buffer (one append and one write
        for a batch instead of one per message). Every body is encoded before anything
        is returned, so a body that cannot be encoded sends none of them.

        Raises:
            UsageError: a body cannot be encoded (named by its index), or ``target`` is
                too long.
        """
        try:
            tb = self._targets.get(target) or self.target(target)
        except LocalProtocolError as exc:
            raise UsageError(f"cannot send to {target!r}: {exc}") from exc
        stamp = self.stamp
        no_join = self._no_join
        if (_current_trace() is not None or _OTEL in _modules) and active():
            no_join = 0  # every message through encode_message, which traces it
        out: list[Buffer] = []
        run: list[bytes] = []
        for i, body in enumerate(bodies):
            if type(body) is bytes and (no_join is None or len(body) < no_join):
                run.append(encode_small_bytes(_MESSAGE, tb, body, stamp))
                continue
            try:
                frame = self.encode_message(target, body)
            except UsageError as exc:
                raise UsageError(f"body {i} of the batch: {exc}") from exc
            if type(frame) is bytes:
                run.append(frame)
                continue
            if run:
                out.append(b"".join(run))
                run = []
            out.extend(frame)  # type: ignore[arg-type]  # a large body's two pieces
        if run:
            out.append(b"".join(run))
        return out

    def encode_notify(self, group: str, event: str, params: Any = None) -> list[Buffer]:
        """A NOTIFY of ``event`` to ``group``.

        Raises:
            UsageError: ``params`` cannot be encoded, or a section is too long.
        """
        head: dict[str, object] = {"event": event}
        flags = 0
        if _current_trace() is not None or _OTEL in _modules:
            out = outgoing(f"{event} {group}", "producer")
            if out is not None:
                out.end()
                head.update(out.fields)
                flags = FLAG_TRACED
        try:
            self.target(group)  # refuses a pattern
            return encode_frame(
                _NOTIFY,
                target=group,
                flags=flags,
                header=encode_cbor(head),
                body=encode_cbor(params) if params is not None else b"",
            )
        except LocalProtocolError as exc:
            raise UsageError(str(exc)) from exc

    @staticmethod
    def traced_request_header(head: bytes, fields: dict[str, object]) -> bytes:
        """A REQUEST header (``head``, from :func:`request_header`) with the trace
        ``fields`` added."""
        value = decode_cbor(head, "header")
        assert isinstance(value, dict)
        value.update(fields)
        return encode_cbor(value)

    def encode_ping(self) -> list[Buffer]:
        """A ``ping`` to the broker whose answer is ignored (never registered as a call):
        any traffic proves the broker alive (the TCP heartbeat)."""
        self._next_rid += 1
        return encode_frame(
            _REQUEST,
            target="msgq",
            request_id=self._next_rid,
            header=request_header("ping", None),
            source=self.stamp,
        )

    def attach_fds(
        self, pieces: Sequence[Buffer], fds: Sequence[int], *, owned: bool = False
    ) -> list[Buffer]:
        """Make the frame's first piece carry ``fds``: duplicates (the caller keeps its
        own), or the descriptors themselves when ``owned`` (then they are ours to close,
        also on error).

        Raises:
            UsageError: more than the broker's ``max_fds_per_message``, a driver that
                cannot pass descriptors, or a bad fd.
        """
        limit = self.max_fds if self.fd_passing else 0
        if len(fds) > limit:
            if owned:
                close_fds(tuple(fds))
            raise UsageError(
                f"{len(fds)} file descriptors in one message; the broker allows "
                f"max_fds_per_message={limit}"
                if self.fd_passing
                else f"{len(fds)} file descriptors in one message; this connection "
                "cannot pass descriptors (a Unix socket with the trio client can)"
            )
        dups = tuple(fds) if owned else dup_all(fds)
        return [FdBuffer(bytes(pieces[0]), dups), *pieces[1:]]
