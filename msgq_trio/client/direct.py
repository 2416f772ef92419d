"""The direct client: blocking calls that do their own socket I/O in the calling thread.

No event loop and no background thread: ``call()`` writes the request and reads the
socket itself until the answer is there. For synchronous programs (command-line tools,
scripts, a component written without async) and for the lowest round-trip latency: in
the benchmark a requester and a responder on it spend ~50 us of CPU each per call against
~90 us on the trio client, and the round trip is a fifth shorter (BENCHMARKS.md, "The
round trip, measured hop by hop"). :func:`msgq_trio.sync.connect` is the full
synchronous API (queues, pipes, handlers in worker threads) over a background trio loop;
this one covers what a component needs on the hot path: calls, one-way messages,
subscriptions and serving commands. Unix sockets only.

Where frames go while a method waits (all in the calling thread):

* the answer to the call being made: returned by ``call``;
* a REQUEST: answered at once by its handler (:meth:`DirectBus.command`) inside whichever
  method is waiting (``call``, ``receive``, ``serve``, a blocked ``send``), so two
  direct clients calling each other never deadlock; a command without a handler is
  answered ``unknown-command``;
* a MESSAGE or NOTIFY: kept, in order, for :meth:`DirectBus.receive`, up to
  ``max_buffered`` bytes (past that, the methods that must read raise
  :class:`~msgq_trio.errors.LimitExceeded`; nothing is dropped);
* a late answer (to a call that gave up locally): discarded.
"""

from __future__ import annotations

import logging
import math
import os
import select
import socket as pysocket
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import default_socket_path
from ..errors import (
    CommandFailed,
    ConnectError,
    ConnectionLost,
    LimitExceeded,
    MalformedMessage,
    RequestTimeout,
    UsageError,
    rpc_error_from_wire,
)
from ..protocol.codes import ErrorCode, FrameType
from ..protocol.connection import EOF, Connection, Role
from ..protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE, Frame, encode_cbor, encode_simple
from ..transport.sockets import (
    ancillary_size,
    close_fds,
    set_send_buffer,
    unconsumed_bytes,
)
from ..transport.sockets import scratch_buffer as _scratch
from ..transport.sockets import take_fds as _take_fds
from .bus import (
    RECEIVE_SIZE,
    SEND_BUFFER,
    Member,
    Message,
    Sources,
    _split_source,
    close_patience,
    read_welcome,
    request_header,
)

log = logging.getLogger("msgq_trio.client.direct")

#: Bytes of received one-way messages kept for receive() before the reading methods
#: refuse to read more: the trio client's IN_HIGH_WATER (64 MiB), for the same reason
#: (a burst the broker already accepted must fit; memory stays bounded).
DEFAULT_MAX_BUFFERED = 64 * 1024 * 1024
#: How long close() waits for the broker's GOODBYE (the trio client's value).
CLOSE_WAIT = 2.0
#: Descriptors one receive can take until WELCOME gives the broker's
#: ``max_fds_per_message`` (its default, Linux's SCM_MAX_FD).
_MAX_FDS = 253

_MESSAGE, _REQUEST, _REPLY, _ERROR, _NOTIFY, _ROUTED, _GOODBYE = (
    int(FrameType.MESSAGE),
    int(FrameType.REQUEST),
    int(FrameType.REPLY),
    int(FrameType.ERROR),
    int(FrameType.NOTIFY),
    int(FrameType.ROUTED),
    int(FrameType.GOODBYE),
)
Handler = Callable[[Any], Any]


class DirectBus:
    """A connection whose methods block the calling thread and do their own I/O.

    Create it with :func:`connect`. Not thread-safe: one thread uses it (other threads
    use their own connection). Command handlers run in that thread, inside whichever
    method is waiting for the socket; a handler may itself call :meth:`call`.

    Resource handling: :meth:`close` (or leaving the ``with`` block) says GOODBYE, waits
    for the broker's (``CLOSE_WAIT`` s, longer while the broker still takes our bytes;
    see :func:`msgq_trio.client.bus.close_patience`), and closes the socket and the
    descriptors of messages never received. After the connection is lost every method raises
    :class:`~msgq_trio.errors.ConnectionLost`.
    """

    def __init__(
        self,
        sock: pysocket.socket,
        name: str,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
    ) -> None:
        self.name = name
        self.lname = ""
        self.broker_version = ""
        self.max_buffered = max_buffered
        self._sock = sock
        self._fd = sock.fileno()
        self._conn = Connection(Role.CLIENT, max_frame_size)
        self._stamp = b""
        self._sources: Sources = {}
        self._targets: dict[str, bytes] = {}
        self._poll_in = select.poll()
        self._poll_in.register(self._fd, select.POLLIN)
        self._ancsize = ancillary_size(_MAX_FDS)
        #: Parsed frames not yet dispatched (a reading method dispatches them in order).
        self._frames: deque[Frame] = deque()
        self._frames_bytes = 0
        #: Received one-way messages for receive(), and their bytes.
        self._inbox: deque[Message] = deque()
        self._inbox_bytes = 0
        self._handlers: dict[str, Handler] = {}
        self._next_rid = 0
        #: request id -> the answer frame, for the calls in progress (nested ones too).
        self._answers: dict[int, Frame | None] = {}
        self._lost: ConnectionLost | None = None
        self._closed = False
        self._goodbye = False
        self._close_patience = CLOSE_WAIT
        self._goodbye_reason: str | None = None

    # -- connection ------------------------------------------------------------------
    def _handshake(self, timeout: float) -> None:
        """Send HELLO and read WELCOME; frames right behind it stay parsed for later.

        Raises:
            ConnectError: the broker refused (``code``), closed, or was silent for
                ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        try:
            self._write(b"".join(self._conn.hello(self.name, {"pid": os.getpid()})))
            while not self._frames:
                if self._lost is not None:
                    raise ConnectError(
                        f"broker closed the connection during the handshake: {self._lost}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ConnectError(f"no WELCOME from the broker within {timeout} s")
                self._read(left)
        except ConnectionLost as exc:
            raise ConnectError(f"connection to the broker failed: {exc}") from exc
        ev = self._frames.popleft()
        self._frames_bytes -= len(ev.raw)
        try:
            header, self.lname, self._stamp, max_fds = read_welcome(ev, self.name)
            self._close_patience = close_patience(header)
        except RemoteProtocolError as exc:
            raise ConnectError(f"broker violated the protocol in the handshake: {exc}") from exc
        self.broker_version = str(header.get("broker", ""))
        if max_fds is not None:
            # A message may carry that many; a smaller buffer would truncate them (and
            # the kernel's MSG_CTRUNC ends the connection).
            self._ancsize = ancillary_size(max_fds)

    def close(self) -> None:
        """Say GOODBYE, wait for the broker's, close the socket. Idempotent.

        The wait ends after ``CLOSE_WAIT`` s, or while bytes we sent are still unread by
        the broker, after ``close_patience`` s in which it took none of them (it may be
        pausing our reads for backpressure: bytes it never read are lost)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._lost is None:
                try:
                    self._write(b"".join(self._conn.send(FrameType.GOODBYE)))
                    now = time.monotonic()
                    deadline, since = now + CLOSE_WAIT, now
                    unread = unconsumed_bytes(self._sock.fileno())
                    while self._lost is None and not self._goodbye:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            # The broker may be pausing our reads (backpressure): wait on
                            # while it still takes our bytes (unread ones die with us).
                            before, unread = unread, unconsumed_bytes(self._sock.fileno())
                            now = time.monotonic()
                            if unread < before:
                                since = now
                            if not unread or now - since >= self._close_patience:
                                break
                            deadline = now + CLOSE_WAIT
                            continue
                        self._read(left)
                        # Frames after our GOODBYE are moot; only the broker's counts.
                        while self._frames:
                            frame = self._frames.popleft()
                            close_fds(frame.fds)
                            if frame.type == _GOODBYE:
                                self._goodbye = True
                except (ConnectionLost, LocalProtocolError):
                    pass
        finally:
            self._sock.close()
            for frame in self._frames:
                close_fds(frame.fds)
            self._frames.clear()
            self._frames_bytes = 0
            for msg in self._inbox:
                msg.close()
            self._inbox.clear()
            self._inbox_bytes = 0
            if self._lost is None:
                self._lost = ConnectionLost("the bus was closed")

    def __enter__(self) -> DirectBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- socket I/O (the one place OSError is translated) -----------------------------
    def _fail(self, message: str, code: str | None = None) -> ConnectionLost:
        if self._lost is None:
            self._lost = ConnectionLost(message, code=code)
        return self._lost

    def _check_open(self) -> None:
        if self._lost is not None:
            raise ConnectionLost(str(self._lost), code=self._lost.code)
        if self._closed:
            raise UsageError("the bus is closed")

    def _write(self, data: bytes) -> None:
        """Write all of ``data``. While the socket is full, keep reading (frames are
        buffered, not dispatched, so this never runs handlers), so a broker waiting to
        hand us frames can go on taking ours.

        Raises:
            ConnectionLost: the connection failed.
        """
        fd, sock = self._fd, self._sock
        view = memoryview(data)
        while True:
            try:
                n = sock.send(view, _SEND_FLAGS)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                raise self._fail(f"connection to the broker failed: {exc}") from exc
            if n == len(view):
                return
            view = view[n:]
            events = select.POLLOUT
            if self._inbox_bytes + self._frames_bytes <= self.max_buffered:
                events |= select.POLLIN
            try:
                ready = select.poll()
                ready.register(fd, events)
                got = ready.poll()
            except OSError as exc:
                raise self._fail(f"connection to the broker failed: {exc}") from exc
            if got and got[0][1] & select.POLLIN:
                self._read(0)
                if self._lost is not None:
                    # EOF while our write waits (a broker shutting down says GOODBYE,
                    # closes its side and reads no more): polling on would spin.
                    raise ConnectionLost(str(self._lost), code=self._lost.code)

    def _read(self, timeout: float | None) -> bool:
        """Receive once (waiting up to ``timeout`` s, None = forever, 0 = not at all) and
        parse what came into ``_frames``. False if nothing came in time. At EOF the
        connection is marked lost (``_lost``), after the frames that came before it.

        Raises:
            ConnectionLost: the connection failed or the broker broke the protocol (the
                socket is then unusable).
        """
        if self._lost is not None:
            return False
        sock = self._sock
        how = _RECV_FLAGS
        if timeout is None:
            # Wait in the receive itself (the socket is blocking; every other call passes
            # MSG_DONTWAIT). A sleeper in recvmsg is woken with the kernel's sync hint,
            # which the broker's write pays less for than a poll() sleeper's wake-up:
            # request/reply p50 125-129 instead of 139-153 us, broker CPU per call 128-134
            # instead of 146-156 us (BENCHMARKS.md, "The direct client waits in the
            # receive"). It is also woken, for nothing, when the broker reads what we
            # sent (send-buffer space on the same wait queue); that costs less than it
            # saves.
            how = _RECV_WAIT_FLAGS
        elif timeout > 0:
            try:
                if not self._poll_in.poll(max(1, math.ceil(timeout * 1000))):
                    return False
            except OSError as exc:
                raise self._fail(f"connection to the broker failed: {exc}") from exc
        view = _scratch(RECEIVE_SIZE)  # the thread's receive buffer, shared with trio's
        try:
            n, anc, flags, _addr = sock.recvmsg_into((view,), self._ancsize, how)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise self._fail(f"connection to the broker failed: {exc}") from exc
        try:
            fds = _take_fds(anc, flags) if anc else []
            conn = self._conn
            conn.receive_data(view[:n], fds)  # the parser copies it
            for ev in conn.events():
                if ev is EOF:
                    reason = self._goodbye_reason
                    self._fail(
                        f"the broker closed the connection ({reason})"
                        if reason
                        else "the broker closed the connection",
                        code=reason,
                    )
                    break
                assert isinstance(ev, Frame)
                if ev.type == _GOODBYE:
                    # Kept now: the EOF right behind it may end a write before the
                    # GOODBYE is dispatched, and the reason belongs in that error.
                    said = ev.header().get("reason")
                    self._goodbye_reason = str(said) if said else None
                self._frames.append(ev)
                self._frames_bytes += len(ev.raw)
        except ProtocolError as exc:
            raise self._fail(f"the broker violated the protocol: {exc}") from exc
        return True

    # -- dispatch ----------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Hand out every parsed frame (see the module docstring for where each goes)."""
        frames = self._frames
        while frames:
            frame = frames.popleft()
            self._frames_bytes -= len(frame.raw)
            t = frame.type
            if t == _REPLY or t == _ERROR:
                rid = frame.request_id
                if not rid:
                    h = frame.header()
                    log.error("broker reported: %s (%s)", h.get("message"), h.get("code"))
                    raise self._fail(
                        f"broker closed the connection: {h.get('message')}",
                        code=str(h.get("code", "")),
                    )
                if rid in self._answers and self._answers[rid] is None:
                    self._answers[rid] = frame
                else:
                    close_fds(frame.fds)  # a late answer to a call we gave up on
            elif t == _MESSAGE or t == _NOTIFY:
                self._inbox.append(Message(frame, self._sources))
                self._inbox_bytes += len(frame.raw)
            elif t == _REQUEST:
                self._serve_request(Message(frame, self._sources))
            elif t == _GOODBYE:
                self._goodbye = True
                reason = frame.header().get("reason")
                if not self._closed:
                    raise self._fail(
                        f"the broker closed the connection ({reason})",
                        code=str(reason) if reason else None,
                    )
            # ROUTED belongs to calls to every member, which this client does not make.

    def _pump(self, timeout: float | None) -> bool:
        """Dispatch what is parsed; if nothing was, read once (up to ``timeout``) and
        dispatch that. False if nothing came in time.

        Raises:
            LimitExceeded: ``max_buffered`` bytes of messages wait for receive().
            ConnectionLost: the connection ended.
        """
        if self._frames:
            self._dispatch()
            return True
        if self._lost is not None:
            self._check_open()
        if self._inbox_bytes > self.max_buffered:
            raise LimitExceeded(
                f"{len(self._inbox)} received messages ({self._inbox_bytes} bytes) wait for "
                f"receive(): over max_buffered={self.max_buffered}; take them with "
                "receive() first (nothing was dropped)",
                code=str(ErrorCode.LIMIT_EXCEEDED),
            )
        got = self._read(timeout)
        self._dispatch()
        return got

    def _serve_request(self, msg: Message) -> None:
        command = msg.command or ""
        handler = self._handlers.get(command)
        try:
            if handler is None:
                pieces = self._error_frame(
                    msg,
                    ErrorCode.UNKNOWN_COMMAND,
                    f"{self.name} ({self.lname}) has no command {command!r}",
                    sorted(self._handlers),
                )
            else:
                pieces = self._run_handler(msg, handler)
        finally:
            msg.close()
        self._write(pieces)

    def _run_handler(self, msg: Message, handler: Handler) -> bytes:
        try:
            result = handler(msg.body)
            return encode_simple(
                _REPLY,
                msg._frame.source.partition(b"\0")[0],  # the caller's lname, as sent
                encode_cbor(result) if result is not None else b"",
                request_id=msg.request_id,
                source=self._stamp,
            )
        except CommandFailed as exc:
            return self._error_frame(msg, str(exc.code), str(exc), exc.data)
        except MalformedMessage as exc:
            return self._error_frame(msg, ErrorCode.BAD_REQUEST, str(exc))
        except (TypeError, ValueError, KeyError, RemoteProtocolError) as exc:
            return self._error_frame(msg, ErrorCode.BAD_REQUEST, f"{type(exc).__name__}: {exc}")
        except LocalProtocolError as exc:
            return self._error_frame(
                msg, ErrorCode.INTERNAL_ERROR, f"handler result cannot be encoded: {exc}"
            )
        except ConnectionLost:
            raise  # this connection's own end, not the handler's answer
        except Exception as exc:
            log.exception("handler for %r raised", msg.command)
            return self._error_frame(
                msg,
                ErrorCode.INTERNAL_ERROR,
                f"{type(exc).__name__}: {exc}",
                {"type": type(exc).__name__},
            )

    def _error_frame(self, msg: Message, code: str, message: str, data: object = None) -> bytes:
        return encode_simple(
            _ERROR,
            msg._frame.source.partition(b"\0")[0],  # the caller's lname, as sent
            encode_cbor(data) if data is not None else b"",
            encode_cbor({"code": str(code), "message": message}),
            request_id=msg.request_id,
            source=self._stamp,
        )

    # -- the API ---------------------------------------------------------------------
    def _target(self, target: str) -> bytes:
        tb = self._targets.get(target)
        if tb is None:
            tb = target.encode()
            if len(self._targets) < 4096:  # bounded cache of encoded targets
                self._targets[target] = tb
        return tb

    def call(
        self, target: str, command: str, params: Any = None, *, timeout: float | None = None
    ) -> Any:
        """Call ``command`` on exactly one recipient and return its result.

        The same contract as :meth:`msgq_trio.Bus.call`: no timeout is needed (the broker
        answers ``no-recipient`` at once, ``recipient-gone`` when the callee leaves, and
        ``timeout`` after its deadline); ``timeout`` shortens that deadline, and the
        client gives up by itself one second after it if even the broker is silent.

        Raises:
            NoRecipient, RecipientGone, RequestTimeout, ReceiverFull, MultipleRecipients,
            LimitExceeded, RemoteError (and subclasses): the answer's error.
            MalformedMessage: the answer's body is not well-formed CBOR.
            LimitExceeded: ``max_buffered`` bytes of messages wait for receive().
            UsageError: a bad argument, or the bus is closed.
            ConnectionLost: the broker went away.
        """
        self._check_open()
        try:
            head = request_header(command, timeout)
            body = encode_cbor(params) if params is not None else b""
            self._next_rid += 1
            rid = self._next_rid
            frame = encode_simple(
                _REQUEST, self._target(target), body, head, request_id=rid, source=self._stamp
            )
        except LocalProtocolError as exc:
            raise UsageError(f"cannot call {command!r} on {target!r}: {exc}") from exc
        answers = self._answers
        answers[rid] = None
        try:
            self._write(frame)
            deadline = None if timeout is None else time.monotonic() + timeout + 1.0
            while answers[rid] is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RequestTimeout(
                        f"no answer from {target!r} within {timeout} s (and none from the broker)",
                        sender=None,
                    )
                self._pump(left)
            answer = answers[rid]
        finally:
            del answers[rid]
        assert answer is not None
        sender = _split_source(answer.source, self._sources)[0]
        if answer.fds:
            log.warning(
                "answer to %r from %s carried %d file descriptors; closed",
                command,
                sender,
                len(answer.fds),
            )
            close_fds(answer.fds)
        try:
            if answer.type == _REPLY:
                return answer.body()
            h = answer.header()
            raise rpc_error_from_wire(
                str(h.get("code", "")), str(h.get("message", "")), answer.body(), sender
            )
        except RemoteProtocolError as exc:
            raise MalformedMessage(
                f"answer from {sender} to a call to {target!r} is malformed: {exc}", sender
            ) from exc

    def send(self, target: str, body: Any = None) -> None:
        """Send a one-way message to ``target`` (lname, group, ``G[N]`` or ``G[?]``);
        returns once the kernel has taken it.

        Raises:
            UsageError: ``body`` cannot be encoded as CBOR, or the bus is closed.
            ConnectionLost: the broker went away.
        """
        self._check_open()
        try:
            frame = encode_simple(
                _MESSAGE,
                self._target(target),
                encode_cbor(body) if body is not None else b"",
                source=self._stamp,
            )
        except LocalProtocolError as exc:
            raise UsageError(f"cannot send to {target!r}: {exc}") from exc
        self._write(frame)

    def receive(self, timeout: float | None = None) -> Message:
        """The next one-way message or notification (a :class:`msgq_trio.Message`),
        answering requests while it waits. The caller owns the message's descriptors.

        Raises:
            TimeoutError: nothing arrived within ``timeout`` seconds.
            ConnectionLost: the connection ended (messages that came before are still
                returned first).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._inbox:
            if self._lost is not None and not self._frames:
                self._check_open()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no message within {timeout} s")
            self._pump(left)
        msg = self._inbox.popleft()
        self._inbox_bytes -= len(msg._frame.raw)
        return msg

    def serve(self, duration: float | None = None) -> None:
        """Answer requests (and keep messages for :meth:`receive`) for ``duration``
        seconds, or until the connection ends when None.

        Raises:
            ConnectionLost: the connection ended.
            LimitExceeded: ``max_buffered`` bytes of messages wait for receive().
        """
        deadline = None if duration is None else time.monotonic() + duration
        while True:
            self._check_open()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self._pump(left)

    def command(self, name: str) -> Callable[[Handler], Handler]:
        """Decorator: answer requests for ``name`` with ``fn(params)``'s return value.

        The handler runs in this thread inside whichever method is waiting. Raise
        :class:`msgq_trio.CommandFailed` to answer with a chosen error code; ``TypeError``,
        ``ValueError`` and ``KeyError`` answer ``bad-request``, other exceptions
        ``internal-error`` (logged with the traceback).
        """

        def register(fn: Handler) -> Handler:
            self._handlers[name] = fn
            return fn

        return register

    def subscribe(self, group: str) -> bool:
        """Join ``group``; False if already a member. Confirmed by the broker."""
        return bool(self.call("msgq", "subscribe", {"group": group}))

    def unsubscribe(self, group: str) -> bool:
        return bool(self.call("msgq", "unsubscribe", {"group": group}))

    def members(self, group: str) -> list[Member]:
        """Members of ``group`` in join order (``G[0]`` first)."""
        rows = self.call("msgq", "members", {"group": group})
        return [Member(r["lname"], r["name"], r.get("pid", -1)) for r in rows]


_DONTWAIT = pysocket.MSG_DONTWAIT
#: MSG_NOSIGNAL: a broken connection is an EPIPE error here, never a SIGPIPE (Python
#: ignores SIGPIPE, but an embedding program may not).
_SEND_FLAGS = _DONTWAIT | pysocket.MSG_NOSIGNAL
_RECV_FLAGS = pysocket.MSG_CMSG_CLOEXEC | _DONTWAIT
_RECV_WAIT_FLAGS = pysocket.MSG_CMSG_CLOEXEC


def connect(
    socket: str | os.PathLike[str] | None = None,
    name: str | None = None,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    max_buffered: int = DEFAULT_MAX_BUFFERED,
    send_buffer: int = SEND_BUFFER,
    timeout: float = 30.0,
) -> DirectBus:
    """Connect to the broker on a Unix socket; returns a :class:`DirectBus` (a context
    manager).

    Args:
        socket: the broker's socket path; default ``$MSGQ_TRIO_SOCKET`` or the per-user
            path (:func:`msgq_trio.config.default_socket_path`).
        name: this client's name, shown to others as ``sender_name``.
        max_buffered: bytes of received one-way messages kept for ``receive()``.
        send_buffer: SO_SNDBUF for the socket (0 = kernel default).
        timeout: longest wait for the broker's WELCOME.

    Raises:
        ConnectError: no broker there, it refused the handshake (``code``), or it did
            not answer within ``timeout``.
        UsageError: a ``tcp://`` or ``tls://`` address (use :func:`msgq_trio.connect`).
    """
    if socket is not None:
        target = os.fspath(socket)
    else:
        target = os.environ.get("MSGQ_TRIO_SOCKET", "") or str(default_socket_path())
    if target.startswith(("tcp://", "tls://")):
        raise UsageError("the direct client speaks to Unix sockets only; use msgq_trio.connect")
    sock = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(target)
        except OSError as exc:
            raise ConnectError(f"cannot connect to the broker at {target}: {exc}") from exc
        # Blocking, for _read's waits without a timeout; every other socket call passes
        # MSG_DONTWAIT (and waits, if at all, in poll()).
        sock.settimeout(None)
        set_send_buffer(sock, send_buffer)
        bus = DirectBus(
            sock,
            name or Path(sys.argv[0] or "client").name,
            max_frame_size=max_frame_size,
            max_buffered=max_buffered,
        )
        bus._handshake(timeout)
    except BaseException:
        sock.close()
        raise
    return bus
