"""The blocking driver's socket: the connection's state, its writes and reads in the
calling thread (the one place OSError is translated), and the dispatch of what was read
through the session (``Session.handle``), under :class:`~msgq_trio.client.direct.DirectBus`
(its reconnects and public methods).
"""

from __future__ import annotations

import inspect
import math
import select
import socket as pysocket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..errors import ConnectError, ConnectionLost, LimitExceeded, UsageError
from ..protocol.codes import ErrorCode, FrameType
from ..protocol.connection import EOF
from ..protocol.errors import ProtocolError
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE, Frame
from ..transport.fdpass import RECEIVE_INTO_SIZE, RECEIVE_SIZE, SEND_BUFFER
from ..transport.sockets import (
    ancillary_size,
    scratch_buffer,
    set_send_buffer,
    take_fds,
)
from .facade import SessionView
from .inbox import Inbox
from .lifecycle import CONNECT_TIMEOUT
from .message import Message
from .reconnect import Reconnect
from .session import (
    IN_HIGH_WATER,
    Closed,
    Request,
    Send,
    Session,
    goodbye_error,
)
from .tracing import dispatching_in_a_trace, handler_in_its_trace

__all__ = ["DEFAULT_MAX_BUFFERED", "BlockingSocket", "dial"]


#: Bytes of received one-way messages kept for receive() before the reading methods
#: refuse to read more: the clients' shared bound (a burst the broker already accepted
#: must fit; memory stays bounded).
DEFAULT_MAX_BUFFERED = IN_HIGH_WATER

_GOODBYE = FrameType.GOODBYE


_DONTWAIT = pysocket.MSG_DONTWAIT
#: MSG_NOSIGNAL: a broken connection is an EPIPE error here, never a SIGPIPE (Python
#: ignores SIGPIPE, but an embedding program may not).
_SEND_FLAGS = _DONTWAIT | pysocket.MSG_NOSIGNAL
_RECV_FLAGS = pysocket.MSG_CMSG_CLOEXEC | _DONTWAIT
_RECV_WAIT_FLAGS = pysocket.MSG_CMSG_CLOEXEC


class BlockingSocket(SessionView):
    """The blocking driver's I/O under :class:`~msgq_trio.client.direct.DirectBus` (not
    used on its own)."""

    #: Make the reconnect attempts that are due (the DirectBus's).
    _reconnected: Callable[..., bool]

    def __init__(
        self,
        sock: pysocket.socket,
        name: str,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        target: str = "",
        reconnect: Reconnect | None = None,
        send_buffer: int = SEND_BUFFER,
        timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self._s = Session(
            name, max_frame_size, reconnect=reconnect, target=target, connect_timeout=timeout
        )
        self._s.fd_passing = False  # plain send(): no SCM_RIGHTS on this driver
        self._attach(sock)
        self._target = target
        self._send_buffer = send_buffer
        #: Parsed frames not yet dispatched (a reading method dispatches them in order).
        self._frames: deque[Frame] = deque()
        self._frames_bytes = 0
        #: Received one-way messages for receive(), bounded by ``max_buffered`` bytes
        #: (client/inbox.py; one message per batch, so the count is exact).
        self._inbox: Inbox[Message] = Inbox(max_buffered)
        self._closed = False

    @property
    def max_buffered(self) -> int:
        """Bytes of received one-way messages kept for ``receive()``."""
        return self._inbox.max_bytes

    def _attach(self, sock: pysocket.socket) -> None:
        """Take ``sock`` as the connection (the first, or a reconnect's)."""
        self._sock = sock
        self._fd = sock.fileno()
        self._conn = self._s.conn
        self._poll_in = select.poll()
        self._poll_in.register(self._fd, select.POLLIN)
        self._ancsize = ancillary_size(self._s.max_fds)
        self._goodbye = False
        self._goodbye_error: ConnectionLost | None = None

    def _handshake(self, deadline: float) -> None:
        """Send HELLO and read WELCOME by ``deadline`` (``time.monotonic()``); frames
        right behind it stay parsed for later.

        Raises:
            ConnectError: the broker refused (``code``), closed, or sent no WELCOME by
                ``deadline`` (the lifecycle's ``timed_out()``: connect's ``timeout``, or
                ``Reconnect.attempt_timeout``).
        """
        try:
            try:
                self._write(b"".join(self._s.hello()))
            except ConnectionLost:
                # As in the async drivers: a broker that refused us may have closed
                # before our HELLO was all written; its ERROR still waits to be read.
                self._read_left()
                if not self._frames:
                    raise
            while not self._frames:
                if self._s.lost is not None:
                    raise ConnectError(
                        f"broker closed the connection during the handshake: {self._s.lost}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._s.life.timed_out()
                self._read(left)
        except ConnectionLost as exc:
            raise ConnectError(f"connection to the broker failed: {exc}") from exc
        ev = self._frames.popleft()
        self._frames_bytes -= len(ev.raw) + len(ev.large_body)
        self._s.receive_welcome(ev)
        self._s.welcomed(remote=False)
        # A message may carry the broker's max_fds_per_message; a smaller buffer would
        # truncate them (and the kernel's MSG_CTRUNC ends the connection).
        self._ancsize = ancillary_size(self._s.max_fds)

    def _read_left(self) -> None:
        """Parse into ``_frames`` what is already received, without waiting; for after
        the connection failed, when ``_read`` reads no more. An error ends it quietly:
        the caller has the failure already."""
        try:
            while not self._frames:
                data = self._sock.recv(RECEIVE_SIZE, _DONTWAIT)
                if not data:
                    return
                self._conn.receive_data(data)
                for ev in self._conn.events():
                    if isinstance(ev, Frame):
                        self._frames.append(ev)
                        self._frames_bytes += len(ev.raw) + len(ev.large_body)
        except (OSError, ProtocolError):
            return

    def _fail(self, message: str, code: str | None = None) -> ConnectionLost:
        return self._s.fail(ConnectionLost(message, code=code))

    def _check_open(self) -> None:
        lost = self._s.lost
        if lost is not None:
            raise ConnectionLost(str(lost), code=lost.code)
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
            if self._inbox.held() + self._frames_bytes <= self.max_buffered:
                events |= select.POLLIN
            try:
                ready = select.poll()
                ready.register(fd, events)
                got = ready.poll()
            except OSError as exc:
                raise self._fail(f"connection to the broker failed: {exc}") from exc
            if got and got[0][1] & select.POLLIN:
                self._read(0)
                if self._s.lost is not None:
                    # EOF while our write waits (a broker shutting down says GOODBYE,
                    # closes its side and reads no more): polling on would spin.
                    self._check_open()

    def _read(self, timeout: float | None) -> bool:
        """Receive once (waiting up to ``timeout`` s, None = forever, 0 = not at all) and
        parse what came into ``_frames``. False if nothing came in time. At EOF the
        connection is marked lost (the session's ``lost``), after the frames that came before it.

        Raises:
            ConnectionLost: the connection failed or the broker broke the protocol (the
                socket is then unusable).
        """
        if self._s.lost is not None:
            return False
        sock = self._sock
        how = _RECV_FLAGS
        if timeout is None:
            # Wait in the receive itself (the socket is blocking; every other call passes
            # MSG_DONTWAIT). A sleeper in recvmsg is woken with the kernel's sync hint,
            # which the broker's write pays less for than a poll() sleeper's wake-up
            # (BENCHMARKS.md, "The direct client waits in the receive"). It is also
            # woken, for nothing, when the broker reads what we sent (send-buffer space
            # on the same wait queue); that costs less than it saves.
            how = _RECV_WAIT_FLAGS
        elif timeout > 0:
            try:
                if not self._poll_in.poll(max(1, math.ceil(timeout * 1000))):
                    return False
            except OSError as exc:
                raise self._fail(f"connection to the broker failed: {exc}") from exc
        conn = self._conn
        # The rest of a large frame in progress goes straight into its own buffer (the
        # body handed out, or a spare one: framing.SPARE_BODIES), as in the trio and
        # asyncio drivers: no copy of it through the scratch buffer, whose pages the
        # parser's own buffer would otherwise take in and give back around each body.
        target = conn.receive_buffer()
        view = scratch_buffer(RECEIVE_SIZE) if target is None else target[:RECEIVE_INTO_SIZE]
        try:
            n, anc, flags, _addr = sock.recvmsg_into((view,), self._ancsize, how)
        except BaseException as exc:
            # (KeyboardInterrupt in a blocking wait too: the view must be given back, or
            # the next receive_buffer() refuses)
            if target is not None:
                view.release()
                target.release()
                conn.return_buffer()
            if isinstance(exc, BlockingIOError):
                return False
            if isinstance(exc, OSError):
                raise self._fail(f"connection to the broker failed: {exc}") from exc
            raise
        try:
            fds = take_fds(anc, flags) if anc else []
            if target is None:
                conn.receive_data(view[:n], fds)  # the parser copies it
            else:
                view.release()
                target.release()
                conn.received_into(n, fds)
            for ev in conn.events():
                if ev is EOF:
                    self._s.fail(
                        self._goodbye_error or ConnectionLost("the broker closed the connection")
                    )
                    break
                assert isinstance(ev, Frame)
                if ev.type == _GOODBYE:
                    # Kept now: the EOF right behind it may end a write before the
                    # GOODBYE is dispatched, and its reason belongs in that error.
                    self._goodbye_error = goodbye_error(ev)
                self._frames.append(ev)
                self._frames_bytes += len(ev.raw) + len(ev.large_body)
        except ProtocolError as exc:
            raise self._fail(f"the broker violated the protocol: {exc}") from exc
        return True

    def _dispatch(self) -> None:
        """Hand every parsed frame to the session and act on its event (see the module
        docstring for where each goes).

        Raises:
            ConnectionLost: the broker ended the connection (GOODBYE, a final ERROR).
        """
        frames, handle = self._frames, self._s.handle
        while frames:
            frame = frames.popleft()
            self._frames_bytes -= len(frame.raw) + len(frame.large_body)
            try:
                event = handle(frame)
            except ProtocolError as exc:
                raise self._fail(f"the broker violated the protocol: {exc}") from exc
            if isinstance(event, Message):
                self._inbox.items.append(event)
                self._inbox.put(1, len(frame.raw) + len(frame.large_body))
            elif isinstance(event, Request):
                self._serve_request(event)
            elif isinstance(event, Send):
                self._write(b"".join(event.pieces))
            elif isinstance(event, Closed):
                if event.goodbye:
                    self._goodbye = True
                if event.error is not None:
                    raise event.error
            # A PendingCall: its caller's loop sees ``done``.

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
        if self._s.lost is not None:
            # Raises unless a reconnect is under way; its attempts are this wait's.
            deadline = None if timeout is None else time.monotonic() + timeout
            return self._reconnected(deadline, wait=True)
        if self._inbox.over():
            raise LimitExceeded(
                f"{len(self._inbox.items)} received messages ({self._inbox.held()} bytes) wait for "
                f"receive(): over max_buffered={self.max_buffered}; take them with "
                "receive() first (nothing was dropped)",
                code=str(ErrorCode.LIMIT_EXCEEDED),
            )
        got = self._read(timeout)
        self._dispatch()
        return got

    def _serve_request(self, request: Request) -> None:
        """Run the request's handler here and write the session's answer for it.

        Raises:
            ConnectionLost: the handler ended with this connection's loss (no answer).
        """
        msg, handler = request.message, request.handler
        assert handler is not None  # no inline handlers on this driver
        error: Exception | None = None
        result: Any = None
        if msg.traced or dispatching_in_a_trace():  # (client/tracing.py)
            handler = handler_in_its_trace(handler, msg)
        try:
            result = handler(msg.body, msg)
        except Exception as exc:
            error = exc
        except BaseException:
            msg.close()
            raise
        if inspect.iscoroutine(result):  # async handlers are refused at registration
            result.close()  # never awaited: no "coroutine was never awaited" warning
            result, error = (
                None,
                UsageError(
                    f"the handler for {msg.command!r} is async; the direct client runs plain "
                    "functions (use msgq_trio.connect for async handlers)"
                ),
            )
        pieces = self._s.answer_for(msg, result, error)
        if pieces is None:
            self._check_open()  # the handler met this connection's end: raise it here
            return
        self._write(b"".join(pieces))


def dial(target: str, send_buffer: int, timeout: float) -> pysocket.socket:
    """A connected Unix socket to the broker at ``target``.

    Raises:
        ConnectError: no broker there (or it did not accept within ``timeout`` s).
    """
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
    except BaseException:
        sock.close()
        raise
    return sock
