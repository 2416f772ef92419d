"""The asyncio driver's socket: the connection's state, the event loop's reader and
writer callbacks on a non-blocking socket, the send queue and its bound, and the local
deadlines of calls, under :class:`~msgq_trio.client.aio.AioBus` (its lifecycle and
public methods). The reader hands each receive's frames to the session's one dispatch
(``AsyncDriver._receive_events``). No trio (``tests/test_layering.py``).
"""

from __future__ import annotations

import array
import asyncio
import logging
import socket as pysocket
from collections import deque
from collections.abc import Coroutine, Sequence
from typing import Any

from ..errors import ConnectionLost
from ..protocol.errors import ProtocolError
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE, FdBuffer, close_fds
from ..transport.fdpass import (  # no trio
    RECEIVE_INTO_SIZE,
    RECEIVE_SIZE,
    ancillary_size,
    take_fds,
)
from .async_bus import AsyncBus
from .lifecycle import CONNECT_TIMEOUT
from .message import Buffer
from .reconnect import Reconnect
from .session import (
    PendingCall,
    Session,
)

__all__ = ["OUT_HIGH_WATER", "AioStreams"]

log = logging.getLogger("msgq_trio.client.aio")

#: ``send``, ``notify`` and the calls wait once this many bytes are queued for the
#: socket: the trio client's bound (its ``OUT_HIGH_WATER``), for the same reason (bounded
#: memory while a fast publisher still fills the socket's buffer in few writes).
OUT_HIGH_WATER = 1024 * 1024
#: Most buffers one ``sendmsg`` gathers (Linux's UIO_MAXIOV is 1024).
_MAX_IOV = 512
#: After a write fails, how long the connection waits for the reader to see the broker's
#: final ERROR or EOF (its reason is the better one) before it fails with the write error.
_WRITE_ERROR_GRACE = 1.0
#: A call's local deadline timer may fire up to the loop's clock resolution early; it
#: looks again this much later (the session decides with the clock, not the timer).
_RECHECK = 0.01

_RECV_FLAGS = pysocket.MSG_CMSG_CLOEXEC | pysocket.MSG_DONTWAIT
_SEND_FLAGS = pysocket.MSG_DONTWAIT | pysocket.MSG_NOSIGNAL


def _wake(call: PendingCall) -> None:
    """The session's wake-up for a finished call: resolve the future its caller awaits
    (unless that caller was cancelled and the future with it)."""
    fut = call.waiter
    if fut is not None and not fut.done():
        fut.set_result(None)


class AioStreams(AsyncBus):
    """The asyncio driver's I/O under :class:`~msgq_trio.client.aio.AioBus` (not used on
    its own)."""

    def __init__(
        self,
        name: str,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        target: str = "",
        reconnect: Reconnect | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._s = Session(
            name,
            max_frame_size,
            wake=_wake,
            reconnect=reconnect,
            target=target,
            connect_timeout=connect_timeout,
        )
        self._rxbuf = memoryview(bytearray(RECEIVE_SIZE))
        self._ancsize = ancillary_size(self._s.max_fds)
        self._out: deque[Buffer] = deque()
        self._out_bytes = 0
        self._writer_armed = False
        self._write_failed = False
        #: Futures of coroutines waiting for the queue to shrink (send) or empty (flush).
        self._drain_waiters: list[asyncio.Future[None]] = []
        #: A write is scheduled for the end of this loop pass (see ``send``).
        self._write_soon = False
        self._in_waiters: list[asyncio.Future[None]] = []
        self._reading = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._init_api(target)
        self._closed = False
        self._lost_event = asyncio.Event()
        self._new_waiter = self._loop.create_future
        #: Futures of coroutines waiting for the connection's state to change.
        self._state_waiters: list[asyncio.Future[None]] = []
        self._up = False

    def _attach(self, sock: pysocket.socket) -> None:
        """Take ``sock`` as the connection (the first, or a reconnect's: then the
        session starts over, still down until WELCOME, and frames queued for the old
        connection are dropped)."""
        s = self._s
        self._fresh_session()
        self._sock = sock
        self._fd = sock.fileno()
        self._conn = s.conn
        self._ancsize = ancillary_size(s.max_fds)
        self._drop_out()
        self._writer_armed = False
        self._write_failed = False
        self._reading = False
        self._broker_goodbye = asyncio.Event()
        #: Set when this connection ends (the supervisor then closes it).
        self._down = asyncio.Event()
        self._up = True

    def _stop_io(self) -> None:
        """The connection is over: no more reader or writer callbacks on its socket
        (the transport closes it), nothing left queued for it."""
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False
        if self._writer_armed:
            self._loop.remove_writer(self._fd)
            self._writer_armed = False
        self._drop_out()
        close_fds(self._conn.take_orphan_fds())

    def _shutdown(self, exc: ConnectionLost) -> None:
        """Fail the connection with ``exc`` (unless it failed already) and release the
        socket and everything queued."""
        self._fail_all(exc)
        self._stop_io()
        self._drop_in()
        self._sock.close()

    def _fail_all(self, exc: ConnectionLost) -> None:
        """The connection ended (or the bus closed): the session fails every pending
        call; unless a reconnect follows, the bus is lost for good. Every waiter wakes to
        see it."""
        self._connection_failed(exc)
        self._wake_all(self._state_waiters)
        if self._reading:
            self._loop.remove_reader(self._fd)
            self._reading = False
        if self._writer_armed:  # a writable socket would call it for nothing, forever
            self._loop.remove_writer(self._fd)
            self._writer_armed = False
        self._wake_all(self._in_waiters)
        self._wake_all(self._drain_waiters)

    @staticmethod
    def _wake_all(waiters: list[asyncio.Future[None]]) -> None:
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        waiters.clear()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in a task of this bus (cancelled when it closes)."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _queue(self, pieces: Sequence[Buffer]) -> None:
        """Queue a frame's pieces and write what the socket takes now."""
        out = self._out
        for p in pieces:
            out.append(p)
            self._out_bytes += len(p)
        if not self._writer_armed:
            self._write()

    def _queue_answer(self, pieces: list[Buffer]) -> None:
        """Queue an answer while the connection is up; otherwise drop it (nobody is there
        to take it) and close the descriptors it would have carried."""
        if self._s.lost is None and not self._write_failed:
            self._queue(pieces)
        else:
            close_fds([fd for p in pieces if type(p) is FdBuffer for fd in p.fds])

    def _drop_out(self) -> None:
        for p in self._out:
            if type(p) is FdBuffer:
                close_fds(p.fds)
        self._out.clear()
        self._out_bytes = 0

    def _write(self) -> None:
        """Write queued buffers while the socket takes them (small ones gathered into one
        ``sendmsg``, a frame with descriptors in a ``sendmsg`` of its own); arm the
        loop's writer callback for the rest."""
        out, sock = self._out, self._sock
        if self._write_failed or self._s.lost is not None:
            self._drop_out()  # nobody reads them any more
            return
        try:
            while out:
                first = out[0]
                if type(first) is FdBuffer:
                    anc = [(pysocket.SOL_SOCKET, pysocket.SCM_RIGHTS, array.array("i", first.fds))]
                    n = sock.sendmsg([first], anc, _SEND_FLAGS)
                    # The kernel holds its own references once any byte went out.
                    close_fds(first.fds)
                    out.popleft()
                    if n < len(first):
                        out.appendleft(memoryview(first)[n:])
                    self._out_bytes -= n
                    continue
                bufs: list[Buffer] = []
                for b in out:
                    if type(b) is FdBuffer or len(bufs) >= _MAX_IOV:
                        break
                    bufs.append(b)
                n = sock.sendmsg(bufs, (), _SEND_FLAGS)
                self._out_bytes -= n
                while n:
                    head = out[0]
                    if n >= len(head):
                        n -= len(head)
                        out.popleft()
                    else:
                        out[0] = memoryview(head)[n:]
                        n = 0
        except BlockingIOError:
            if not self._writer_armed:
                self._loop.add_writer(self._fd, self._on_writable)
                self._writer_armed = True
        except OSError as exc:
            self._write_error(exc)
            return
        else:
            if self._writer_armed:
                self._loop.remove_writer(self._fd)
                self._writer_armed = False
        if self._drain_waiters and self._out_bytes <= OUT_HIGH_WATER:
            self._wake_all(self._drain_waiters)

    def _write_later(self) -> None:
        """The write that one-way sends left for the end of the loop pass."""
        self._write_soon = False
        if not self._writer_armed:
            self._write()

    def _on_writable(self) -> None:
        if self._s.lost is None:
            self._write()

    def _write_error(self, exc: OSError) -> None:
        """A write failed: nothing more is written. A broker that drops us sends an
        ERROR frame with the reason and closes; the reader reports that if it comes in
        time, else the connection fails with this error."""
        self._write_failed = True
        if self._writer_armed:
            self._loop.remove_writer(self._fd)
            self._writer_armed = False
        self._drop_out()
        lost = ConnectionLost(f"connection to the broker lost: {exc}")
        self._loop.call_later(_WRITE_ERROR_GRACE, self._fail_connection, self._down, lost)
        self._wake_all(self._drain_waiters)

    def _fail_connection(self, down: object, lost: ConnectionLost) -> None:
        """Fail the connection whose end is ``down`` (not a later one) with ``lost``."""
        if down is self._down:
            self._fail_all(lost)

    async def _wait_out(self) -> None:
        """Wait while more than OUT_HIGH_WATER bytes are queued.

        Raises:
            ConnectionLost: the connection ended meanwhile.
        """
        while self._out_bytes > OUT_HIGH_WATER and self._s.lost is None:
            fut: asyncio.Future[None] = self._loop.create_future()
            self._drain_waiters.append(fut)
            await fut
        if self._s.lost is not None:
            raise self._s.lost

    def _call_started(self) -> None:
        if not self._reading and not self._in_full():
            self._resume_reading()

    def _resume_reading(self) -> None:
        if not self._reading and self._s.lost is None:
            self._loop.add_reader(self._fd, self._on_readable)
            self._reading = True

    def _on_readable(self) -> None:
        """One receive: bytes and descriptors into the codec (a large frame's straight
        into its own buffer, as the trio driver's ``SocketReceiver.receive_into``), then
        every event acted on."""
        conn = self._conn
        target = conn.receive_buffer()
        try:
            if target is None:
                n, anc, flags, _addr = self._sock.recvmsg_into(
                    (self._rxbuf,), self._ancsize, _RECV_FLAGS
                )
            else:
                n, anc, flags, _addr = self._sock.recvmsg_into(
                    (target[:RECEIVE_INTO_SIZE],), self._ancsize, _RECV_FLAGS
                )
        except (BlockingIOError, InterruptedError):
            if target is not None:
                target.release()
                conn.return_buffer()
            return
        except OSError as exc:
            if target is not None:
                target.release()
                conn.return_buffer()
            self._fail_all(ConnectionLost(f"connection to the broker lost: {exc}"))
            return
        try:
            fds = take_fds(anc, flags) if anc else []
            # An empty read is EOF: the codec yields it after the frames before it.
            if target is None:
                conn.receive_data(self._rxbuf[:n], fds)
            else:
                target.release()
                conn.received_into(n, fds)
        except ProtocolError as exc:
            self._protocol_error(exc)
            return
        self._process()

    def _protocol_error(self, exc: ProtocolError) -> None:
        log.error("broker violated the protocol: %s", exc)
        self._fail_all(ConnectionLost(f"broker violated the protocol: {exc}"))
        close_fds(self._conn.take_orphan_fds())

    def _process(self) -> None:
        """Act on every frame the codec has: the session's event for each (its rule 3)."""
        conn = self._conn
        count = self._inbox.added
        try:
            if not self._receive_events(conn.events(), conn.message_burst) and conn.error_pending:
                conn.events()  # raises the protocol error that followed valid frames
        except ProtocolError as exc:
            self._protocol_error(exc)
        if self._inbox.added != count:
            self._wake_all(self._in_waiters)
        if self._reading and self._in_full():
            # Nobody takes the messages: read no more until they do (the broker then
            # pauses our senders), never drop.
            self._loop.remove_reader(self._fd)
            self._reading = False

    def _queue_request(self, pieces: list[Buffer], fds: Sequence[int]) -> None:
        self._queue(pieces)

    async def _wait_done(self, call: PendingCall) -> None:
        fut = call.waiter
        if not fut.done():
            # Shielded: a cancelled waiter must not cancel the future, which the
            # session sets when the answer comes (the call stays waitable).
            await asyncio.shield(fut)

    async def _finish_call(self, call: PendingCall) -> None:
        """Wait for ``call``'s outcome (or its local deadline), then forget its slot."""
        timer: asyncio.TimerHandle | None = None
        if call.deadline is not None:
            timer = self._loop.call_at(call.deadline, self._expire, call)
        try:
            await call.waiter
        finally:
            if timer is not None:
                timer.cancel()
            self._s.finish(call)

    def _expire(self, call: PendingCall) -> None:
        if not call.expire(self._loop.time()) and not call.done:
            self._loop.call_later(_RECHECK, self._expire, call)
