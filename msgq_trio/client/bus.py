"""The trio client: ``connect()`` yields a :class:`Bus` for messages, RPC and notifications.

One connection = one nursery holding a reader task, a writer task and a task per incoming
request to an async handler (plain-function handlers are answered by the reader). The
writer joins every queued frame into one ``send_all`` (one trio call per batch, not per
frame); ``send`` only queues and waits when the queue is over its bound.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import sys
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import cbor2
import trio

from ..config import default_socket_path
from ..errors import (
    CommandFailed,
    ConnectError,
    ConnectionLost,
    MalformedMessage,
    MsgqError,
    RequestTimeout,
    UsageError,
    rpc_error_from_wire,
)
from ..protocol.codes import ErrorCode, Flag, FrameType
from ..protocol.connection import EOF, NEED_DATA, Connection, Role
from ..protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from ..protocol.framing import (
    DEFAULT_MAX_FRAME_SIZE,
    FdBuffer,
    Frame,
    encode_bytes_message,
    encode_cbor,
    encode_frame,
    encode_simple,
)
from ..transport.errors import translate_socket_errors
from ..transport.sockets import (
    NO_JOIN,
    SocketReceiver,
    ancillary_size,
    close_fds,
    send_buffers,
    set_send_buffer,
    unconsumed_bytes,
)

if TYPE_CHECKING:  # imported lazily at run time: client/queue.py and pipe.py import bus
    from .pipe import Pipe
    from .queue import Queue

log = logging.getLogger("msgq_trio.client")

Buffer = bytes | bytearray | memoryview
#: Encoded ``{"cmd": name}`` request headers by command name; stops growing at the cap.
_CMD_HEADERS: dict[str, bytes] = {}
_CMD_HEADERS_MAX = 256
_FLAG_ALL = int(Flag.ALL)
RECEIVE_SIZE = 256 * 1024
#: Closing waits this long for the broker's GOODBYE; longer while bytes we sent are still
#: unread by the broker (see close_patience: its reads of a sender it has paused for
#: backpressure resume as receivers drain; bytes it never read are lost with the socket).
CLOSE_WAIT = 2.0
#: ``send`` waits for the writer once this many bytes are queued (bounds client memory
#: while letting a fast publisher batch hundreds of frames per send_all).
OUT_HIGH_WATER = 1024 * 1024
#: The reader stops reading from the broker while this many bytes of received messages
#: wait for the application: backpressure travels to the broker (which pauses the
#: senders), never silent loss. Bound: 64 MiB, one default max frame.
IN_HIGH_WATER = 64 * 1024 * 1024
#: SO_SNDBUF asked for the client's socket: the bytes in flight towards the broker. Same
#: default and reason as the broker's ``Limits.socket_send_buffer`` (1 MiB; the kernel's
#: 208 KiB default costs a wakeup per 208 KiB of a large frame).
SEND_BUFFER = 1024 * 1024
_FAIRNESS = 256  # iteration yields to other tasks at least every this many messages
_MEMBERSHIP = "msgq.membership"
_SHUTDOWN = str(ErrorCode.BROKER_SHUTDOWN)

_MESSAGE, _REQUEST, _REPLY, _ERROR, _NOTIFY, _ROUTED, _GOODBYE = (
    FrameType.MESSAGE,
    FrameType.REQUEST,
    FrameType.REPLY,
    FrameType.ERROR,
    FrameType.NOTIFY,
    FrameType.ROUTED,
    FrameType.GOODBYE,
)
_KIND: dict[int, str] = {
    _MESSAGE: "message",
    _NOTIFY: "notification",
    _REQUEST: "request",
    _REPLY: "answer",
}


def read_welcome(frame: Frame, name: str) -> tuple[dict[str, object], str, bytes, int | None]:
    """The broker's answer to HELLO: (WELCOME's header, our lname, our stamp, the
    broker's ``max_fds_per_message`` or None).

    Raises:
        ConnectError: the broker refused the connection (an ERROR frame; ``code`` says
            why: ``version-mismatch``, ``limit-exceeded``, ``unauthenticated``...).
        RemoteProtocolError: the header is not well-formed CBOR.
    """
    header = frame.header()
    if frame.type == _ERROR:
        raise ConnectError(
            f"broker refused the connection: {header.get('message')}",
            code=str(header.get("code")),
        )
    lname = str(header["lname"])
    # The broker names an empty HELLO name "anonymous" (io/server.py).
    stamp = f"{lname}\0{name or 'anonymous'}".encode()
    limits = header.get("limits")
    max_fds = None
    if isinstance(limits, dict) and isinstance(limits.get("max_fds_per_message"), int):
        max_fds = limits["max_fds_per_message"]
    return header, lname, stamp, max_fds


def close_patience(header: dict[str, object]) -> float:
    """How long a closing client waits for the broker's GOODBYE while the broker takes
    none of its bytes: CLOSE_WAIT plus the broker's ``slow_consumer_timeout`` (WELCOME
    ``limits``), the longest the broker lets a receiver hold up a sender it paused;
    CLOSE_WAIT alone if the broker does not say."""
    limits = header.get("limits")
    t = limits.get("slow_consumer_timeout") if isinstance(limits, dict) else None
    if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t <= 3600:
        return CLOSE_WAIT + float(t)
    return CLOSE_WAIT


def request_header(command: str, timeout: float | None) -> bytes:
    """The CBOR header of a REQUEST for ``command`` (and the caller's ``timeout``).

    Raises:
        UsageError: ``command`` is not a str, or ``timeout`` is not positive.
        LocalProtocolError: ``timeout`` cannot be encoded.
    """
    if type(command) is not str:
        raise UsageError(f"command must be a str, not {type(command).__name__}")
    if timeout is None:
        # Encoded once per command name (a CBOR encode per call is ~1.5 us here).
        head = _CMD_HEADERS.get(command)
        if head is None:
            head = encode_cbor({"cmd": command})
            if len(_CMD_HEADERS) < _CMD_HEADERS_MAX:
                _CMD_HEADERS[command] = head
        return head
    if timeout <= 0:
        raise UsageError("timeout must be positive")
    return encode_cbor({"cmd": command, "timeout": float(timeout)})


#: Parsed source sections by their bytes (see :func:`_split_source`), per connection.
Sources = dict[bytes, tuple[str, str, str, str | None]]


def _split_source(source: bytes, cache: Sources) -> tuple[str, str, str, str | None]:
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
        if len(cache) < 65536:
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
        return _split_source(self._frame.source, self._sources)[0]

    @property
    def sender_name(self) -> str:
        """The sender's client name, as stamped by the broker."""
        return _split_source(self._frame.source, self._sources)[1]

    @property
    def via(self) -> str | None:
        """The lname of the binder that relayed this message (a queue bound to the group
        stored it and forwarded it on behalf of ``sender``), or None if it came straight
        from ``sender``. Answers to a relayed request go to the binder."""
        hit = _split_source(self._frame.source, self._sources)
        return hit[2] if hit[3] is not None else None

    @property
    def via_name(self) -> str | None:
        """The client name of the relaying binder (``msgq-queue-binder`` for the queue
        plugin), or None if the message came straight from ``sender``."""
        return _split_source(self._frame.source, self._sources)[3]

    @property
    def _reply_to(self) -> str:
        """Where an answer goes: the sender, or the binder that relayed the request."""
        return _split_source(self._frame.source, self._sources)[2]

    @property
    def kind(self) -> str:
        """``"message"``, ``"notification"`` or ``"request"``."""
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
        lname, name = _split_source(self._frame.source, self._sources)[:2]
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
        return len(self._frame.raw)

    def __repr__(self) -> str:
        return (
            f"<Message {self.kind} from {self.sender} ({self.sender_name}) "
            f"to {self.target!r} {self.size} bytes>"
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
        self.fds = _dup_all(fds)


def _dup_all(fds: Sequence[int]) -> tuple[int, ...]:
    dups: list[int] = []
    try:
        for fd in fds:
            dups.append(os.dup(fd))
    except OSError as exc:
        close_fds(dups)
        raise UsageError(f"cannot send file descriptor {fd}: {exc}") from exc
    return tuple(dups)


class _Call:
    __slots__ = ("answers", "done", "error", "expected", "frame", "multi", "result", "target")

    def __init__(self, target: str, multi: bool) -> None:
        self.target = target
        self.multi = multi
        self.done = trio.Event()
        self.result: Any = None
        self.error: MsgqError | None = None
        self.expected: list[tuple[str, str]] | None = None  # ROUTED (multi only)
        self.answers: dict[str, Result] = {}
        self.frame: Frame | None = None  # the REPLY of a single call (for request())

    def answer(self, frame: Frame, sender: str) -> None:
        try:
            self._answer(frame, sender)
        except RemoteProtocolError as exc:
            # The callee's bug (the broker does not decode bodies): this call fails with
            # it, the connection carries on.
            close_fds(frame.fds)
            err = MalformedMessage(
                f"answer from {sender} to a call to {self.target!r} is malformed: {exc}", sender
            )
            res = Result(self.target, False, None, err, sender)
            self._answer_result(frame._replace(fds=()), res, sender)

    def _answer(self, frame: Frame, sender: str) -> None:
        if frame.type == _REPLY and not self.multi:
            # The common case, without a Result: _answer_result's single-call branch.
            if self.done.is_set():  # already failed (timeout, connection lost)
                close_fds(frame.fds)
                return
            self.result = frame.body()
            self.frame = frame
            self.done.set()
            return
        if frame.type == _REPLY:
            res = Result(self.target, True, frame.body(), None, sender)
        else:
            close_fds(frame.fds)
            h = frame.header()
            res = Result(
                self.target,
                False,
                None,
                rpc_error_from_wire(
                    str(h.get("code", "")), str(h.get("message", "")), frame.body(), sender
                ),
                sender,
            )
        self._answer_result(frame, res, sender)

    def _answer_result(self, frame: Frame, res: Result, sender: str) -> None:
        if not self.multi:
            self.result, self.error = res.value, res.error
            if self.done.is_set():
                close_fds(frame.fds)
            else:
                self.frame = frame
            self.done.set()
            return
        close_fds(frame.fds)  # call_all answers carry no descriptors to the caller
        if self.expected is None:
            # ROUTED always precedes the members' answers on the same connection, so an
            # answer before it is the broker refusing the whole call (e.g. no-recipient).
            self.error = res.error
            self.done.set()
            return
        self.answers[sender] = res
        self._maybe_done()

    def routed(self, to: list[tuple[str, str]]) -> None:
        self.expected = to
        self._maybe_done()

    def _maybe_done(self) -> None:
        if self.expected is not None and len(self.answers) >= len(self.expected):
            self.done.set()

    def fail(self, error: MsgqError) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


Handler = Callable[..., Any]


def _socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType:
    """The socket under a client stream (a SocketStream, or TLS over one)."""
    if isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    assert isinstance(stream, trio.SocketStream)
    return stream.socket


class Bus:
    """A connection to the broker. Create it with :func:`connect`.

    Attributes:
        lname: this connection's unique address, assigned by the broker (``l.N``).
        name: the client name sent in HELLO.
    """

    def __init__(self, stream: trio.SocketStream, name: str, max_frame_size: int) -> None:
        self._stream = stream
        self.name = name
        self.lname = ""
        #: The source section the broker stamps on our frames (``lname NUL name``), written
        #: into them here so the broker only checks it and forwards the bytes as they are
        #: (docs/PROTOCOL.md, "Source"). Empty until WELCOME.
        self._stamp = b""
        self.broker_version = ""
        self._max_fds = 253  # replaced by the broker's limit from WELCOME
        self._out_fds = 0
        self._conn = Connection(Role.CLIENT, max_frame_size)
        self._out: deque[Buffer] = deque()
        self._out_bytes = 0
        self._out_wake = trio.lowlevel.ParkingLot()
        self._drained = trio.lowlevel.ParkingLot()
        self._in: deque[Message] = deque()
        self._in_bytes = 0
        self._in_wake = trio.lowlevel.ParkingLot()
        self._in_taken = trio.lowlevel.ParkingLot()
        self._calls: dict[int, _Call] = {}
        self._next_rid = 0
        self._handlers: dict[str, Handler] = {}
        #: Handlers called in the reader, in arrival order, without a task (add_inline_command).
        self._inline: dict[str, Callable[[Message], None]] = {}
        #: Handler for requests whose command has no handler (set_default_handler).
        self._default_handler: Handler | None = None
        self._notify_cbs: dict[str, list[Callable[[Message], Any]]] = {}
        self._notify_inline: dict[str, Callable[[Message], None]] = {}
        self._message_inline: Callable[[Message], None] | None = None
        self._sources: Sources = {}
        self._targets: dict[str, bytes] = {}
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._lost: ConnectionLost | None = None
        self._since_yield = 0
        self._broker_goodbye = trio.Event()
        self._close_patience = CLOSE_WAIT
        self._writing = False
        # True while the reader handles one receive's frames: answers that handlers give
        # meanwhile are queued and written together after the batch (one write for a
        # burst of requests instead of one per answer).
        self._deferring = False
        # Calls answered by the last receive. When several callers were woken at once,
        # their next requests go to the writer, which joins them into one write (one
        # broker wakeup) instead of one write per caller.
        self._answered = 0
        self._burst = False
        self._lost_event = trio.Event()
        self._fd = stream.socket.fileno()
        #: The WELCOME header (identity and heartbeat settings for a TCP connection).
        self._welcome: dict[str, object] = {}

    # -- lifecycle ---------------------------------------------------------------------
    async def _handshake(self, hello_extra: dict[str, object]) -> None:
        hello = self._conn.hello(self.name, {"pid": os.getpid(), **hello_extra})
        try:
            with translate_socket_errors():
                await self._stream.send_all(b"".join(hello))
            while True:
                with translate_socket_errors():
                    data = await self._stream.receive_some(RECEIVE_SIZE)
                self._conn.receive_data(data)
                ev = self._conn.next_event()
                if ev is EOF:
                    raise ConnectError("broker closed the connection during the handshake")
                if ev is NEED_DATA:
                    continue
                assert isinstance(ev, Frame)
                header, self.lname, self._stamp, max_fds = read_welcome(ev, self.name)
                self._close_patience = close_patience(header)
                self.broker_version = str(header.get("broker", ""))
                self._welcome = header
                if max_fds is not None:
                    self._max_fds = max_fds
                return  # frames that came right behind WELCOME stay buffered for the reader
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ConnectError(f"connection to the broker failed: {exc}") from exc
        except ProtocolError as exc:
            raise ConnectError(f"broker violated the protocol in the handshake: {exc}") from exc

    async def _close(self) -> None:
        """Flush queued frames, say GOODBYE, wait for the broker's, close.

        The wait ends after CLOSE_WAIT s, or while bytes we sent are still unread by the
        broker, after :func:`close_patience` s in which it took none of them (it may be
        pausing our reads for backpressure: what it has not read when the socket closes
        is lost; it logs and counts that).
        """
        if self._closed:
            return
        self._closed = True
        if self._lost is None:
            try:
                self._queue(self._conn.send(_GOODBYE))
            except LocalProtocolError:
                pass
            fd = _socket_of(self._stream).fileno()
            clock = trio.current_time
            left, since = self._out_bytes + unconsumed_bytes(fd), clock()
            while self._lost is None:
                with trio.move_on_after(CLOSE_WAIT):
                    await self._broker_goodbye.wait()
                    break
                before, left = left, self._out_bytes + unconsumed_bytes(fd)
                if not left:
                    break
                if left < before:
                    since = clock()  # the broker is still reading us
                elif clock() - since >= self._close_patience:
                    break
        await trio.aclose_forcefully(self._stream)
        self._fail_all(ConnectionLost("the bus was closed"))

    def _fail_all(self, exc: ConnectionLost) -> None:
        if self._lost is None:
            self._lost = exc
            self._lost_event.set()
        for call in self._calls.values():
            call.fail(ConnectionLost(str(exc), code=exc.code))
        self._in_wake.unpark_all()
        self._drained.unpark_all()
        self._in_taken.unpark_all()

    @property
    def limits(self) -> dict[str, object]:
        """The broker's limits from WELCOME (``max_frame_size``, ``request_timeout``,
        ``max_pending_requests``, ...; docs/PROTOCOL.md), empty before the handshake or
        from a broker that sent none."""
        limits = self._welcome.get("limits")
        return dict(limits) if isinstance(limits, dict) else {}

    @property
    def lost(self) -> ConnectionLost | None:
        """None while the connection is up; once it ended (the broker dropped us or shut
        down, the socket broke, or the bus was closed), the :class:`ConnectionLost` that
        calls raise, whose ``code`` says why. For a component that only sends and would
        not otherwise notice that the broker refused its last message."""
        return self._lost

    def _check_open(self) -> None:
        if self._lost is not None:
            raise self._lost
        if self._closed:
            raise UsageError("the bus is closed")

    # -- sending -----------------------------------------------------------------------
    def _queue(self, pieces: list[Buffer]) -> None:
        out = self._out
        for p in pieces:
            out.append(p)
            self._out_bytes += len(p)
        if self._out_wake:  # ParkingLot is truthy while the writer is parked
            self._out_wake.unpark_all()

    def _attach_fds(
        self, pieces: list[Buffer], fds: Sequence[int], *, owned: bool = False
    ) -> list[Buffer]:
        """Make the frame's first piece carry ``fds``: duplicates (the caller keeps its
        own), or the descriptors themselves when ``owned`` (then they are ours to close,
        also on error).

        Raises:
            UsageError: more than the broker's ``max_fds_per_message``, or a bad fd.
        """
        if len(fds) > self._max_fds:
            if owned:
                close_fds(tuple(fds))
            raise UsageError(
                f"{len(fds)} file descriptors in one message; the broker allows "
                f"max_fds_per_message={self._max_fds}"
            )
        dups = tuple(fds) if owned else _dup_all(fds)
        self._out_fds += len(dups)
        return [FdBuffer(bytes(pieces[0]), dups), *pieces[1:]]

    def _queue_urgent(self, pieces: list[Buffer]) -> None:
        """Queue a latency-sensitive frame (request, answer) and try to write it at once."""
        out = self._out
        for p in pieces:
            out.append(p)
            self._out_bytes += len(p)
        if self._deferring:
            return  # the reader writes the batch's answers when it is done with it
        if not self._burst:
            self._send_now()
        if out and self._out_wake:
            self._out_wake.unpark_all()

    def _send_now(self) -> None:
        """Latency path: if the writer is idle, write the (small) queue to the socket now,
        saving the writer task's wake-up. What the kernel does not take stays queued;
        errors are left for the writer, so they are reported in one place."""
        if (
            self._writing
            or not self._out
            or self._out_bytes > 65536
            or self._out_fds  # descriptors need sendmsg: the writer does that
            or self._lost is not None
        ):
            return
        out = self._out
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        try:
            sent = os.write(self._fd, data)
        except OSError:  # BlockingIOError included: the writer takes over
            sent = 0
        if sent < len(data):
            out.append(memoryview(data)[sent:])
        self._out_bytes -= sent
        if sent and self._drained:
            # flush() and send()'s high-water wait park on this, and the writer (which
            # wakes them otherwise) may find nothing left to write.
            self._drained.unpark_all()

    def _queue1(self, frame: bytes) -> None:
        self._out.append(frame)
        self._out_bytes += len(frame)
        if self._out_wake:
            self._out_wake.unpark_all()

    async def _wait_out(self) -> None:
        while self._out_bytes > OUT_HIGH_WATER and self._lost is None:
            await self._drained.park()
        if self._lost is not None:
            raise self._lost

    async def send(
        self,
        target: str,
        body: Any = None,
        attachments: Sequence[Buffer] = (),
        *,
        header: dict[str, object] | None = None,
        fds: Sequence[int] = (),
        on_behalf_of: tuple[str, str] | None = None,
    ) -> None:
        """Send a one-way message to ``target`` (lname, group, ``G[N]`` or ``G[?]``).

        A group gets it on every member except the sender. Returns once the frame is
        queued; waits only while more than ``OUT_HIGH_WATER`` bytes are queued.
        ``attachments`` are binary blobs (no copies, no escaping); ``fds`` are file
        descriptors passed with SCM_RIGHTS: each recipient gets its own duplicate, and the
        caller still owns (and closes) the ones it passed.

        ``on_behalf_of`` (``(lname, name)`` of the original sender) is for a client
        that holds the binding of ``target``'s group (the queue plugin) and forwards
        traffic it stored: receivers see that sender, with :attr:`Message.via` naming
        this client. The broker accepts it only from the binder, to the bound group or
        its members; from anyone else it is replaced by this client's own identity.

        Raises:
            UsageError: the bus is closed, ``body`` cannot be encoded as CBOR, or too many
                descriptors.
            ConnectionLost: the broker went away.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._lost is not None or self._closed:
            self._check_open()
        try:
            tb = self._targets.get(target)
            if tb is None:
                tb = self._encode_target(target)
            if attachments or fds or on_behalf_of:
                pieces = encode_frame(
                    _MESSAGE,
                    target=target,
                    header=cbor2.dumps(header) if header else b"",
                    body=cbor2.dumps(body) if body is not None else b"",
                    blobs=attachments,
                    n_fds=len(fds),
                    source=self._relay_stamp(on_behalf_of) if on_behalf_of else self._stamp,
                )
                self._queue(self._attach_fds(pieces, fds) if fds else pieces)
            elif type(body) is bytes and len(body) >= NO_JOIN and not header:
                # A large binary body goes out as it is (bytes cannot change under us):
                # no CBOR copy, no join; the writer sends both pieces in one sendmsg.
                self._queue(encode_bytes_message(_MESSAGE, tb, body, self._stamp))  # type: ignore[arg-type]
            else:
                self._queue1(
                    encode_simple(
                        _MESSAGE,
                        tb,
                        cbor2.dumps(body) if body is not None else b"",
                        cbor2.dumps(header) if header else b"",
                        source=self._stamp,
                    )
                )
        except (LocalProtocolError, cbor2.CBOREncodeError, TypeError) as exc:
            raise UsageError(f"cannot send to {target!r}: {exc}") from exc
        if self._out_bytes > OUT_HIGH_WATER:
            await self._wait_out()

    def _relay_stamp(self, origin: tuple[str, str]) -> bytes:
        """The relayed stamp for traffic forwarded on behalf of ``origin`` (see
        :meth:`send`): this client's stamp, NUL, the origin's lname, NUL, its name."""
        lname, name = origin
        if "\0" in lname or "\0" in name:
            raise UsageError(f"on_behalf_of {origin!r}: names cannot contain NUL")
        return self._stamp + f"\0{lname}\0{name}".encode()

    def _encode_target(self, target: str) -> bytes:
        tb = target.encode()
        if len(self._targets) < 4096:  # bounded cache of encoded targets
            self._targets[target] = tb
        return tb

    async def flush(self) -> None:
        """Wait until everything queued so far has been written to the socket."""
        while self._out_bytes and self._lost is None:
            await self._drained.park()
        self._check_open()

    async def notify(self, group: str, event: str, params: Any = None) -> None:
        """Publish notification ``event`` to ``group``; notifications are never answered."""
        self._check_open()
        try:
            self._queue(
                encode_frame(
                    _NOTIFY,
                    target=group,
                    header=encode_cbor({"event": event}),
                    body=encode_cbor(params) if params is not None else b"",
                )
            )
        except LocalProtocolError as exc:
            raise UsageError(str(exc)) from exc
        await self._wait_out()
        await trio.lowlevel.checkpoint()

    # -- RPC ---------------------------------------------------------------------------
    def _start_call(
        self,
        target: str,
        command: str,
        params: Any,
        timeout: float | None,
        attachments: Sequence[Buffer],
        multi: bool,
        fds: Sequence[int] = (),
        on_behalf_of: tuple[str, str] | None = None,
    ) -> tuple[int, _Call]:
        self._check_open()
        head = request_header(command, timeout)  # UsageError before anything is sent
        source = self._relay_stamp(on_behalf_of) if on_behalf_of else self._stamp
        self._next_rid += 1
        rid = self._next_rid
        try:
            pieces = encode_frame(
                _REQUEST,
                target=target,
                request_id=rid,
                flags=_FLAG_ALL if multi else 0,
                header=head,
                body=encode_cbor(params) if params is not None else b"",
                blobs=attachments,
                n_fds=len(fds),
                source=source,
            )
        except LocalProtocolError as exc:
            raise UsageError(f"cannot call {command!r} on {target!r}: {exc}") from exc
        if fds:
            pieces = self._attach_fds(pieces, fds)
        call = _Call(target, multi)
        self._calls[rid] = call
        self._queue_urgent(pieces)
        return rid, call

    async def _finish_call(self, rid: int, call: _Call, timeout: float | None) -> None:
        try:
            # The broker enforces the deadline and answers `timeout` itself; the local
            # limit (deadline + 1 s) only covers a broker that stopped answering at all.
            if timeout is None:
                await call.done.wait()  # the common path needs no cancel scope
                return
            with trio.move_on_after(timeout + 1.0):
                await call.done.wait()
            if not call.done.is_set():
                call.fail(
                    RequestTimeout(
                        f"no answer from {call.target!r} within {timeout} s "
                        "(and none from the broker)",
                        sender=None,
                    )
                )
        finally:
            self._calls.pop(rid, None)

    async def call(
        self,
        target: str,
        command: str,
        params: Any = None,
        *,
        timeout: float | None = None,
        attachments: Sequence[Buffer] = (),
        fds: Sequence[int] = (),
    ) -> Any:
        """Call ``command`` on exactly one recipient and return its result.

        ``target`` is an lname, ``G[N]``, ``G[?]`` or a group with exactly one member.
        No timeout is needed: the broker answers at once when nobody is there or the
        recipient goes away, and after its ``request_timeout`` when the recipient
        black-holes the request; ``timeout`` shortens that deadline for this call.

        Raises:
            NoRecipient, RecipientGone, RequestTimeout, ReceiverFull, MultipleRecipients,
            LimitExceeded: the broker's answers. RemoteError: the handler failed
            (``.code``, ``.message``, ``.data``). ConnectionLost: the broker went away.
        """
        # request()'s steps without its Message: the result is decoded once, by _Call.
        rid, call = self._start_call(target, command, params, timeout, attachments, False, fds)
        await self._wait_out()
        await self._finish_call(rid, call, timeout)
        if call.error is not None:
            raise call.error
        frame = call.frame
        if frame is not None and frame.fds:
            log.warning(
                "answer to %r from %s carried %d file descriptors; call() closes them "
                "(use request() to receive descriptors)",
                command,
                _split_source(frame.source, self._sources)[0],
                len(frame.fds),
            )
            close_fds(frame.fds)
        return call.result

    async def request(
        self,
        target: str,
        command: str,
        params: Any = None,
        *,
        timeout: float | None = None,
        attachments: Sequence[Buffer] = (),
        fds: Sequence[int] = (),
    ) -> Message:
        """Like :meth:`call`, but returns the whole answer: a :class:`Message` of kind
        ``"answer"`` with ``.body`` (the result), ``.attachments``, ``.fds`` and
        ``.sender``. The caller owns the answer's descriptors (``with answer: ...``).

        Raises:
            The same exceptions as :meth:`call`.
        """
        rid, call = self._start_call(target, command, params, timeout, attachments, False, fds)
        await self._wait_out()
        await self._finish_call(rid, call, timeout)
        if call.error is not None:
            raise call.error
        assert call.frame is not None
        answer = Message(call.frame, self._sources)
        answer._body, answer._decoded = call.result, True  # decoded once, by _Call
        return answer

    def start_call(
        self,
        target: str,
        command: str,
        params: Any = None,
        *,
        timeout: float | None = None,
        attachments: Sequence[Buffer] = (),
        on_behalf_of: tuple[str, str] | None = None,
    ) -> Callable[[], Awaitable[Any]]:
        """Send a request now, synchronously, and return ``wait()`` for its result.

        Requests started this way leave in the order of the ``start_call`` calls (tasks
        doing ``call`` may start in any order), and the caller needs no task until it
        wants the answer (the queue plugin's ordered deliveries). ``await wait()``
        returns the result or raises what :meth:`call` raises; it must be awaited once,
        or the call's slot stays until the answer arrives. Descriptors in the answer are
        closed. ``on_behalf_of``: as in :meth:`send` (the answer still comes here).

        Raises:
            UsageError, ConnectionLost: as :meth:`call`, before anything is sent.
        """
        rid, call = self._start_call(
            target, command, params, timeout, attachments, False, on_behalf_of=on_behalf_of
        )

        async def wait() -> Any:
            await self._finish_call(rid, call, timeout)
            if call.error is not None:
                raise call.error
            if call.frame is not None and call.frame.fds:
                close_fds(call.frame.fds)
            return call.result

        return wait

    async def call_all(
        self, group: str, command: str, params: Any = None, *, timeout: float | None = None
    ) -> list[Result]:
        """Call ``command`` on every member of ``group`` (except this client).

        Returns one :class:`Result` per member, in join order of the members the broker
        routed to; a member that fails or leaves yields an error Result.

        Raises:
            NoRecipient: the group is empty. ConnectionLost: the broker went away.
        """
        rid, call = self._start_call(group, command, params, timeout, (), True)
        await self._wait_out()
        await self._finish_call(rid, call, timeout)
        if call.error is not None and call.expected is None:
            raise call.error
        expected = call.expected or []
        out = []
        for lname, _name in expected:
            res = call.answers.get(lname)
            if res is None:
                err = call.error or RequestTimeout(f"{lname} did not answer", sender=lname)
                res = Result(group, False, None, err, lname)
            out.append(res)
        return out

    async def call_many(
        self,
        requests: Iterable[tuple[str, str] | tuple[str, str, Any]],
        *,
        timeout: float | None = None,
    ) -> list[Result]:
        """Issue many calls concurrently; returns each result or error, in request order."""
        reqs = [(r[0], r[1], r[2] if len(r) > 2 else None) for r in requests]
        started = [self._start_call(t, c, p, timeout, (), False) for t, c, p in reqs]
        await self._wait_out()
        results: list[Result] = []
        for (rid, call), (target, _c, _p) in zip(started, reqs, strict=True):
            await self._finish_call(rid, call, timeout)
            results.append(Result(target, call.error is None, call.result, call.error))
        return results

    def call_cb(
        self,
        target: str,
        command: str,
        params: Any,
        callback: Callable[[bool, Any], Any],
        *,
        timeout: float | None = None,
    ) -> None:
        """Start a call now; later run ``callback(ok, result_or_error)`` (seed 000's ``rpc``).

        The callback runs in the bus's nursery; exceptions it raises are logged.
        """
        rid, call = self._start_call(target, command, params, timeout, (), False)

        async def finish() -> None:
            await self._finish_call(rid, call, timeout)
            ok = call.error is None
            await self._run_callback(callback, ok, call.result if ok else call.error)

        self._spawn(finish)

    def call_many_cb(
        self,
        requests: Iterable[tuple[str, str] | tuple[str, str, Any]],
        callback: Callable[[list[Result]], Any],
        *,
        timeout: float | None = None,
    ) -> None:
        """Start many calls now; run ``callback(results)`` once all are done."""
        reqs = list(requests)

        async def finish() -> None:
            results = await self.call_many(reqs, timeout=timeout)
            await self._run_callback(callback, results)

        self._spawn(finish)

    async def _notify_callbacks(self, cbs: list[Callable[[Message], Any]], msg: Message) -> None:
        try:
            for cb in cbs:
                await self._run_callback(cb, msg)
        finally:
            msg.close()  # descriptors a callback did not take_fds() are closed here

    async def _run_callback(self, cb: Callable[..., Any], *args: Any) -> None:
        try:
            r = cb(*args)
            if inspect.isawaitable(r):
                await r
        except Exception:
            log.exception("callback %r raised", cb)

    def _spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        if self._nursery is None:
            raise UsageError("the bus is not running")
        self._nursery.start_soon(fn)

    # -- serving commands ----------------------------------------------------------------
    def command(self, name: str) -> Callable[[Handler], Handler]:
        """Decorator: register ``fn`` to answer requests for ``name``.

        ``fn(params)`` or ``fn(params, request)``, sync or async. A plain function is called
        by the reader as the request arrives, without a task (it must not block: it would
        block the whole event loop in a task too); an async one runs in its own task per
        request. The return value is the answer; ``CommandFailed(code, message, data)``
        answers with that error; ``TypeError``/``ValueError``/``KeyError`` from the handler
        answer ``bad-request``; any other exception ``internal-error`` naming its type.
        """

        def register(fn: Handler) -> Handler:
            self.add_command(name, fn)
            return fn

        return register

    def add_command(self, name: str, fn: Handler) -> None:
        nparams = len(inspect.signature(fn).parameters)
        if nparams not in (1, 2):
            raise UsageError("a command handler takes (params) or (params, request)")
        self._handlers[name] = fn if nparams == 2 else (lambda p, _r, fn=fn: fn(p))

    def add_inline_command(self, name: str, fn: Callable[[Message], None]) -> None:
        """Register ``fn(request)`` for command ``name``, called synchronously by the reader
        in the order requests arrive, without a task. ``fn`` must not block; it answers
        later (or at once) with :meth:`answer` or :meth:`answer_error`, exactly once.

        For plugins that must see requests in order (the queue's puts: deduplication by
        increasing sequence numbers) or cannot afford a task per request. An exception
        from ``fn`` answers ``internal-error`` and is logged.
        """
        self._inline[name] = fn

    def set_default_handler(self, fn: Handler | None) -> None:
        """Handle requests for commands that have no handler with ``fn(params, request)``
        instead of answering ``unknown-command`` (a bound queue takes any command)."""
        if fn is not None and len(inspect.signature(fn).parameters) != 2:
            raise UsageError("a default handler takes (params, request)")
        self._default_handler = fn

    def answer(
        self, request: Message, result: Any = None, *, attachments: Sequence[Buffer] = ()
    ) -> None:
        """Answer ``request`` (received by an inline handler) with ``result`` and
        optional binary ``attachments`` (the pipe plugin's read answers).

        Raises:
            UsageError: ``result`` cannot be encoded (nothing was sent).
        A request whose caller is gone is answered anyway; the broker discards it.
        """
        try:
            pieces = encode_frame(
                _REPLY,
                target=request._reply_to,
                request_id=request.request_id,
                body=encode_cbor(result) if result is not None else b"",
                blobs=attachments,
                source=self._stamp,
            )
        except LocalProtocolError as exc:
            raise UsageError(f"answer cannot be encoded: {exc}") from exc
        if self._lost is None and not self._closed:
            self._queue_urgent(pieces)

    def answer_error(self, request: Message, code: str, message: str, data: object = None) -> None:
        """Answer ``request`` (received by an inline handler) with an ERROR ``code``."""
        if self._lost is None and not self._closed:
            self._queue_urgent(self._error_frame(request, code, message, data))

    def _start_request(self, msg: Message, handler: Handler) -> None:
        """Run ``handler`` for a request, in the reader: a plain function is answered
        right here, without a task per request (a task costs more than a small handler);
        an ``async`` one returns an awaitable, which a task of its own awaits."""
        try:
            result = handler(msg.body, msg)
        except Exception as exc:
            self._finish_request(msg, None, exc)
            return
        except BaseException:
            msg.close()
            raise
        if inspect.isawaitable(result):
            self._spawn(functools.partial(self._await_request, msg, result))
        else:
            self._finish_request(msg, result, None)

    async def _await_request(self, msg: Message, result: Awaitable[Any]) -> None:
        try:
            value = await result
        except Exception as exc:
            self._finish_request(msg, None, exc)
            return
        except BaseException:
            msg.close()  # cancelled (the bus is closing): no answer
            raise
        self._finish_request(msg, value, None)

    def _finish_request(self, msg: Message, result: Any, error: Exception | None) -> None:
        """Send the answer for ``result`` (or the ERROR for the handler's ``error``)."""
        frame = msg._frame
        try:
            if error is not None:
                raise error
            if isinstance(result, Reply):
                try:
                    pieces = encode_frame(
                        _REPLY,
                        target=msg._reply_to,
                        request_id=frame.request_id,
                        body=encode_cbor(result.result) if result.result is not None else b"",
                        blobs=result.attachments,
                        n_fds=len(result.fds),
                        source=self._stamp,
                    )
                except BaseException:
                    close_fds(result.fds)
                    raise
                if result.fds:
                    pieces = self._attach_fds(pieces, result.fds, owned=True)
            else:
                pieces = encode_frame(
                    _REPLY,
                    target=msg._reply_to,
                    request_id=frame.request_id,
                    body=encode_cbor(result) if result is not None else b"",
                    source=self._stamp,
                )
        except CommandFailed as exc:
            pieces = self._error_frame(msg, exc.code, exc.message, exc.data)
        except (TypeError, ValueError, KeyError, RemoteProtocolError) as exc:
            pieces = self._error_frame(msg, ErrorCode.BAD_REQUEST, f"{type(exc).__name__}: {exc}")
        except (LocalProtocolError, UsageError) as exc:
            pieces = self._error_frame(
                msg, ErrorCode.INTERNAL_ERROR, f"handler result cannot be encoded: {exc}"
            )
        except Exception as exc:
            log.exception("handler for %r raised", msg.command)
            pieces = self._error_frame(
                msg,
                ErrorCode.INTERNAL_ERROR,
                f"{type(exc).__name__}: {exc}",
                {"type": type(exc).__name__},
            )
        finally:
            msg.close()  # descriptors the handler did not take_fds() are closed here
        if self._lost is None and not self._closed:
            self._queue_urgent(pieces)
        else:
            close_fds([fd for p in pieces if type(p) is FdBuffer for fd in p.fds])

    def _error_frame(
        self, msg: Message, code: str, message: str, data: object = None
    ) -> list[Buffer]:
        return encode_frame(
            _ERROR,
            target=msg._reply_to,
            request_id=msg.request_id,
            header=encode_cbor({"code": str(code), "message": message}),
            body=encode_cbor(data) if data is not None else b"",
            source=self._stamp,
        )

    # -- durable queues (plugins/queue, docs/QUEUE.md) ----------------------------------
    def queue(self, name: str, *, producer: str | None = None) -> Queue:
        """A handle on the durable queue ``name`` of the queue plugin (docs/QUEUE.md).

        ``producer`` names this producer for deduplication; give a stable name to resend
        after a crash without duplicates, default a fresh random one per handle.
        Returns a :class:`msgq_trio.client.queue.Queue`.
        """
        from .queue import Queue

        return Queue(self, name, producer=producer)

    # -- named pipes (plugins/pipe, docs/PIPES.md) ---------------------------------------
    def pipe(self, name: str) -> Pipe:
        """The named pipe ``name`` of the pipe plugin (docs/PIPES.md): ``await
        open_reader()`` / ``await open_writer()`` on the returned
        :class:`msgq_trio.client.pipe.Pipe` give trio byte streams."""
        from .pipe import Pipe

        return Pipe(self, name)

    # -- broker commands ---------------------------------------------------------------
    async def subscribe(self, group: str) -> bool:
        """Join ``group``; returns False if already a member. Confirmed by the broker."""
        return bool(await self.call("msgq", "subscribe", {"group": group}))

    async def unsubscribe(self, group: str) -> bool:
        return bool(await self.call("msgq", "unsubscribe", {"group": group}))

    async def members(self, group: str) -> list[Member]:
        """Members of ``group`` in join order (``G[0]`` first)."""
        rows = await self.call("msgq", "members", {"group": group})
        return [Member(r["lname"], r["name"], r.get("pid", -1)) for r in rows]

    async def version(self) -> dict[str, Any]:
        return dict(await self.call("msgq", "version"))

    def on_notification(self, group: str, callback: Callable[[Message], Any]) -> None:
        """Run ``callback(message)`` for every notification to ``group`` (instead of
        delivering it to iteration). Subscribe to the group separately."""
        self._notify_cbs.setdefault(group, []).append(callback)

    def on_notification_inline(self, group: str, callback: Callable[[Message], None]) -> None:
        """Call ``callback(message)`` for every notification to ``group`` synchronously in
        the reader, in arrival order with everything else the reader handles (requests
        to inline commands, see :meth:`add_inline_command`), instead of delivering it to
        iteration. For a service whose state depends on both: e.g. a request that
        arrives after a ``disconnected`` event must see the event's effect. ``callback``
        must not block; an exception it raises is logged. One callback per group."""
        self._notify_inline[group] = callback

    def on_message_inline(self, callback: Callable[[Message], None] | None) -> None:
        """Call ``callback(message)`` for every one-way MESSAGE synchronously in the
        reader, in arrival order with the requests it handles (a plain ``def`` handler
        runs there too), instead of delivering it to iteration; None restores iteration.
        For a service that must see one-way messages and requests in the order they were
        sent (the queue plugin's bound groups). ``callback`` must not block; an
        exception it raises is logged and the message's descriptors are closed."""
        self._message_inline = callback

    # -- receiving ---------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[Message]:
        """Iterate over received messages and notifications, in arrival order.

        The iteration ends (like trio's ``EndOfChannel``) only when it was ended cleanly:
        this bus was closed locally, or the broker shut down and said GOODBYE. Every other
        end raises, so a consumer never mistakes a loss for the end of the stream.

        Raises:
            ConnectionLost: the connection broke (broker crashed) or the broker dropped this
                client; ``code`` says why (``slow-consumer``, ``protocol-error``,
                ``dropped``...). Messages received before it are all yielded first.
        """
        return self

    async def __anext__(self) -> Message:
        q = self._in
        if q and self._since_yield < _FAIRNESS - 1:
            # A message is waiting and no fairness checkpoint is due: _next_message's
            # first branch, without a second coroutine per message.
            self._since_yield += 1
            msg = q.popleft()
            self._in_bytes -= len(msg._frame.raw)
            if self._in_taken:
                self._in_taken.unpark_all()
            return msg
        waited = await self._next_message()
        if waited is None:
            lost = self._lost
            if self._closed or lost is None or lost.code == _SHUTDOWN:
                raise StopAsyncIteration
            raise lost
        return waited

    async def receive(self, timeout: float | None = None) -> Message:
        """The next message or notification.

        Raises:
            trio.TooSlowError: nothing arrived within ``timeout``.
            ConnectionLost: the connection ended.
        """
        with trio.fail_after(math.inf if timeout is None else timeout):
            msg = await self._next_message()
        if msg is None:
            raise self._lost or ConnectionLost("the bus was closed")
        return msg

    async def _next_message(self) -> Message | None:
        q = self._in
        while not q:
            if self._lost is not None or self._closed:
                return None
            await self._in_wake.park()
        msg = q.popleft()
        self._in_bytes -= len(msg._frame.raw)
        if self._in_taken:  # only the reader parks here, and only over IN_HIGH_WATER
            self._in_taken.unpark_all()
        # A full checkpoint every _FAIRNESS messages keeps iteration cancellable and lets
        # other tasks run; one per message would cost more than the message itself.
        self._since_yield += 1
        if self._since_yield >= _FAIRNESS:
            self._since_yield = 0
            await trio.lowlevel.checkpoint()
        return msg

    # -- tasks -------------------------------------------------------------------------
    async def _writer(self) -> None:
        out, stream = self._out, self._stream
        try:
            while True:
                while not out:
                    await self._out_wake.park()
                self._burst = False
                bufs = list(out)
                out.clear()
                n = 0
                for b in bufs:
                    n += len(b)
                    if type(b) is FdBuffer:
                        self._out_fds -= len(b.fds)
                self._writing = True
                try:
                    await send_buffers(stream, bufs)
                finally:
                    self._writing = False
                self._out_bytes -= n
                if self._drained:
                    self._drained.unpark_all()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            # A broker that drops us sends an ERROR frame with the reason and closes; our
            # write may fail before the reader has seen that frame. Let the reader report
            # the reason first; fall back to the write error.
            with trio.move_on_after(1.0):
                await self._lost_event.wait()
            self._fail_all(ConnectionLost(f"connection to the broker lost: {exc}"))

    async def _reader(self) -> None:
        conn = self._conn
        rx = SocketReceiver(self._stream.socket, RECEIVE_SIZE, ancillary_size(self._max_fds))
        receive = rx.receive_into
        received = False  # first pass: frames buffered behind WELCOME
        try:
            while True:
                if received:
                    eof = not await receive(conn)
                else:
                    eof, received = False, True
                inq, sources, inline = self._in, self._sources, self._message_inline
                self._deferring = True
                self._answered = 0
                try:
                    for ev in conn.events():
                        if ev is EOF:
                            self._broker_goodbye.set()
                            self._fail_all(ConnectionLost("the broker closed the connection"))
                            return
                        assert isinstance(ev, Frame)
                        if ev.type == _MESSAGE:  # hot path: straight to the application
                            if inline is None:
                                inq.append(Message(ev, sources))
                                self._in_bytes += len(ev.raw)
                            else:
                                self._message_inline_call(inline, Message(ev, sources))
                        else:
                            self._dispatch(ev)
                finally:
                    self._deferring = False
                    if self._answered > 1:
                        self._burst = True
                    if self._out:
                        self._send_now()
                        if self._out and self._out_wake:
                            self._out_wake.unpark_all()
                if self._in and self._in_wake:
                    self._in_wake.unpark_all()
                if conn.error_pending:
                    conn.events()  # raises the protocol error that followed valid frames
                if eof:
                    self._broker_goodbye.set()
                    self._fail_all(ConnectionLost("the broker closed the connection"))
                    return
                if self._in_bytes > IN_HIGH_WATER:
                    while self._in_bytes > IN_HIGH_WATER and self._lost is None:
                        await self._in_taken.park()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._fail_all(ConnectionLost(f"connection to the broker lost: {exc}"))
        except ProtocolError as exc:
            log.error("broker violated the protocol: %s", exc)
            self._fail_all(ConnectionLost(f"broker violated the protocol: {exc}"))
        finally:
            rx.close()
            close_fds(conn.take_orphan_fds())

    def _message_inline_call(self, callback: Callable[[Message], None], msg: Message) -> None:
        try:
            callback(msg)
        except Exception:
            log.exception("inline message callback %r raised", callback)
            msg.close()

    def _dispatch(self, frame: Frame) -> None:
        t = frame.type
        if t == _MESSAGE or t == _NOTIFY:
            msg = Message(frame, self._sources)
            if t == _NOTIFY and self._notify_inline:
                icb = self._notify_inline.get(frame.target)
                if icb is not None:
                    try:
                        icb(msg)
                    except Exception:
                        log.exception("inline notification callback %r raised", icb)
                    finally:
                        msg.close()
                    return
            if t == _NOTIFY and self._notify_cbs:
                cbs = self._notify_cbs.get(frame.target)
                if cbs:
                    self._spawn(functools.partial(self._notify_callbacks, cbs, msg))
                    return
            self._in.append(msg)
            self._in_bytes += len(frame.raw)  # the reader wakes the consumer once per batch
        elif t == _REPLY or t == _ERROR:
            if not frame.request_id:
                h = frame.header()
                code = str(h.get("code", ""))
                log.error("broker reported: %s (%s)", h.get("message"), code)
                self._fail_all(
                    ConnectionLost(f"broker closed the connection: {h.get('message')}", code=code)
                )
                return
            call = self._calls.get(frame.request_id)
            if call is not None:
                call.answer(frame, _split_source(frame.source, self._sources)[0])
                self._answered += 1
            else:
                close_fds(frame.fds)  # a late answer to a call we gave up on
        elif t == _ROUTED:
            call = self._calls.get(frame.request_id)
            if call is not None:
                to = frame.header().get("to", [])
                assert isinstance(to, list)
                call.routed([(str(a), str(b)) for a, b in to])
        elif t == _REQUEST:
            msg = Message(frame, self._sources)
            if self._inline:
                inline = self._inline.get(msg.command or "")
                if inline is not None:
                    try:
                        inline(msg)
                    except Exception as exc:
                        log.exception("inline handler for %r raised", msg.command)
                        self.answer_error(
                            msg, ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}"
                        )
                    return
            handler = self._handlers.get(msg.command or "") or self._default_handler
            if handler is None:
                msg.close()
                self._queue(
                    self._error_frame(
                        msg,
                        ErrorCode.UNKNOWN_COMMAND,
                        f"{self.name} ({self.lname}) has no command {msg.command!r}",
                        sorted(self._handlers),
                    )
                )
            else:
                self._start_request(msg, handler)
        elif t == _GOODBYE:
            self._broker_goodbye.set()
            reason = frame.header().get("reason")
            if not self._closed:
                self._fail_all(
                    ConnectionLost(
                        f"the broker closed the connection ({reason})",
                        code=str(reason) if reason else None,
                    )
                )


def _parse_address(address: str) -> tuple[str, str, int]:
    """``tcp://HOST:PORT`` / ``tls://HOST:PORT`` -> (scheme, host, port).

    Raises:
        UsageError: not such a URL.
    """
    scheme, _, rest = address.partition("://")
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if scheme not in ("tcp", "tls") or not sep or not host or not port.isdigit():
        raise UsageError(f"bus address {address!r} must be tcp://HOST:PORT or tls://HOST:PORT")
    return scheme, host, int(port)


async def _pump(source: trio.abc.ReceiveStream, sink: trio.abc.HalfCloseableStream | Any) -> None:
    """Copy bytes until EOF, then pass the EOF on (TLS bridge, see _open_transport)."""
    try:
        while True:
            data = await source.receive_some(RECEIVE_SIZE)
            if not data:
                break
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    if isinstance(sink, trio.SocketStream):
        try:
            await sink.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    else:
        await trio.aclose_forcefully(sink)


@asynccontextmanager
async def _open_transport(
    target: str, ssl_context: Any, server_hostname: str | None
) -> AsyncIterator[tuple[trio.SocketStream, bool]]:
    """A socket stream to the broker and whether it is a TCP one.

    For ``tls://`` the TLS session runs in two copy tasks between the network and one end
    of a local socket pair, and the Bus gets the other end: the Bus's reader and writer
    work on a plain socket (recvmsg, direct writes) whatever the transport.

    Raises:
        ConnectError: cannot connect, or the TLS handshake failed.
    """
    if not target.startswith(("tcp://", "tls://")):
        path = target
        try:
            stream = await trio.open_unix_socket(path)
        except OSError as exc:
            raise ConnectError(
                f"cannot connect to the broker at {path}: {exc.strerror or exc}"
            ) from exc
        yield stream, False
        return
    scheme, host, port = _parse_address(target)
    try:
        tcp = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise ConnectError(
            f"cannot connect to the broker at {target}: {exc.strerror or exc}"
        ) from exc
    if scheme == "tcp":
        yield tcp, True
        return
    import ssl

    ctx = ssl_context if ssl_context is not None else ssl.create_default_context()
    tls = trio.SSLStream(tcp, ctx, server_hostname=server_hostname or host)
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(tls)
        raise ConnectError(
            f"TLS handshake with the broker at {target} failed: {exc.__cause__ or exc}"
        ) from exc
    except BaseException:
        await trio.aclose_forcefully(tls)
        raise
    import socket as pysocket

    a, b = trio.socket.socketpair(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    inner, outer = trio.SocketStream(a), trio.SocketStream(b)
    body_error: Exception | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump, tls, outer)
            nursery.start_soon(_pump, outer, tls)
            try:
                yield inner, True
            except Exception as exc:
                body_error = exc  # re-raised outside the nursery (no ExceptionGroup)
            nursery.cancel_scope.cancel()
    finally:
        await trio.aclose_forcefully(inner)
        await trio.aclose_forcefully(outer)
        await trio.aclose_forcefully(tls)
    if body_error is not None:
        raise body_error


def _heartbeat_settings(bus: Bus) -> tuple[float, int] | None:
    hb = bus._welcome.get("heartbeat")
    if not isinstance(hb, dict):
        return None
    interval, misses = hb.get("interval"), hb.get("misses")
    if not isinstance(interval, (int, float)) or not isinstance(misses, int) or interval <= 0:
        return None
    return float(interval), max(1, misses)


async def _heartbeat(bus: Bus, interval: float, misses: int) -> None:
    """Detect a silent broker over TCP (a dead host or path sends no FIN or RST).

    Every ``interval``: if nothing arrived since the last tick, ask the broker ``ping``
    (its answer, or any traffic, proves it alive); after ``misses`` silent intervals the
    connection is declared lost (ConnectionLost code ``heartbeat-timeout``) and closed,
    which fails every pending call exactly as a Unix disconnect does. Intervals in which
    our own reader is paused (the application is not consuming) do not count.
    """
    last, missed = -1, 0
    while True:
        await trio.sleep(interval)
        rx = bus._conn.received_bytes
        if rx != last or bus._in_bytes > IN_HIGH_WATER:
            last, missed = rx, 0
            continue
        missed += 1
        if missed >= misses:
            log.error(
                "the broker sent nothing for %d heartbeat intervals of %s s: connection lost",
                missed,
                interval,
            )
            bus._fail_all(
                ConnectionLost(
                    f"the broker sent nothing for {missed * interval:g} s (heartbeat)",
                    code=str(ErrorCode.HEARTBEAT_TIMEOUT),
                )
            )
            await trio.aclose_forcefully(bus._stream)
            return
        bus._next_rid += 1  # never registered as a call: the answer itself is ignored
        bus._queue_urgent(
            encode_frame(
                _REQUEST,
                target="msgq",
                request_id=bus._next_rid,
                header=encode_cbor({"cmd": "ping"}),
                source=bus._stamp,
            )
        )


def _answer_heartbeat(bus: Bus) -> Callable[[Message], None]:
    def answer(request: Message) -> None:
        bus.answer(request)

    return answer


@asynccontextmanager
async def connect(
    socket: str | os.PathLike[str] | None = None,
    name: str | None = None,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    send_buffer: int = SEND_BUFFER,
    token: str | None = None,
    ssl_context: Any = None,
    server_hostname: str | None = None,
) -> AsyncIterator[Bus]:
    """Connect to the broker; yields a :class:`Bus`.

    Args:
        socket: the broker's Unix socket path, or ``tcp://HOST:PORT`` / ``tls://HOST:PORT``
            for a broker on another host (docs/SECURITY.md); default ``$MSGQ_TRIO_SOCKET``
            (a path or such a URL) or the per-user path
            (:func:`msgq_trio.config.default_socket_path`).
        name: this client's name, shown to others as ``sender_name``.
        send_buffer: SO_SNDBUF for the socket (:data:`SEND_BUFFER`; 0 = kernel default).
        token: the credential for TCP (sent in HELLO); default ``$MSGQ_TRIO_TOKEN``. Not
            needed with a client certificate (in ``ssl_context``). Ignored for Unix sockets.
        ssl_context: for ``tls://``: an :class:`ssl.SSLContext` (CA to trust the broker,
            optionally a client certificate); default the system's trust store.
        server_hostname: the name the broker's certificate must carry (default the host).

    Resource handling: leaving the block flushes queued frames, says GOODBYE, waits for
    the broker's (CLOSE_WAIT s, longer while the broker still takes our bytes: it may be
    pausing our reads for backpressure; see ``close_patience``), closes the socket and
    cancels handler tasks; pending calls fail with ConnectionLost.

    Raises:
        ConnectError: no broker at the address, TLS failed, or it refused the handshake
            (``code`` ``version-mismatch``, ``limit-exceeded``, ``unauthenticated``...).
        UsageError: a malformed ``tcp://``/``tls://`` address.
    """
    if socket is not None:
        target = os.fspath(socket)
    else:
        env = os.environ.get("MSGQ_TRIO_SOCKET", "")
        target = env if env.startswith(("tcp://", "tls://")) else str(default_socket_path())
    body_error: Exception | None = None
    async with _open_transport(target, ssl_context, server_hostname) as (stream, remote):
        if not remote:  # TCP keeps the kernel's send buffer autotuning
            set_send_buffer(stream.socket, send_buffer)
        bus = Bus(stream, name or Path(sys.argv[0] or "client").name, max_frame_size)
        hello: dict[str, object] = {}
        if remote:
            tok = token if token is not None else os.environ.get("MSGQ_TRIO_TOKEN")
            if tok:
                hello["token"] = tok
        try:
            await bus._handshake(hello)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        if remote:
            bus._max_fds = 0  # no SCM_RIGHTS over TCP: descriptors are refused up front
            bus._inline["msgq.heartbeat"] = _answer_heartbeat(bus)
        async with trio.open_nursery() as nursery:
            bus._nursery = nursery
            nursery.start_soon(bus._reader)
            nursery.start_soon(bus._writer)
            hb = _heartbeat_settings(bus) if remote else None
            if hb is not None:
                nursery.start_soon(_heartbeat, bus, *hb)
            try:
                yield bus
            except Exception as exc:
                # Re-raised below, outside the nursery, so the caller can catch e.g.
                # NoRecipient itself instead of an ExceptionGroup wrapping it. Cancelled
                # is not caught here.
                body_error = exc
            finally:
                with trio.CancelScope(shield=True):
                    await bus._close()
                nursery.cancel_scope.cancel()
    if body_error is not None:
        raise body_error
