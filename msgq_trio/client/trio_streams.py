"""The trio driver's streams: the connection's state, its send queue and writer, its
reader, and a lone caller's polling for its answer, under the
:class:`~msgq_trio.client.bus.Bus` (its lifecycle and public methods). The writer joins
every queued frame into one ``send_all`` (one trio call per batch, not per frame); the
reader hands each receive's frames to the session's one dispatch
(``AsyncDriver._receive_events``).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Sequence

import trio

from ..errors import ConnectionLost
from ..protocol.errors import ProtocolError
from ..protocol.framing import FdBuffer
from ..transport.fdpass import RECEIVE_INTO_SIZE, RECEIVE_SIZE
from ..transport.sockets import (
    NO_JOIN,
    SocketReceiver,
    ancillary_size,
    close_fds,
    send_buffers,
)
from .async_bus import AsyncBus
from .lifecycle import CONNECT_TIMEOUT
from .message import Buffer
from .polling import BUSY_POLL, CallPoller, Poll
from .reconnect import Reconnect
from .session import (
    PendingCall,
    Session,
)

__all__ = ["OUT_HIGH_WATER", "TrioStreams"]


log = logging.getLogger("msgq_trio.client")

#: ``send`` waits for the writer once this many bytes are queued (bounds client memory
#: while letting a fast publisher batch hundreds of frames per send_all).
OUT_HIGH_WATER = 1024 * 1024


def _wake(call: PendingCall) -> None:
    """The session's wake-up for a finished call: set the trio.Event its waiter waits on."""
    call.waiter.set()


class TrioStreams(AsyncBus):
    """The trio driver's I/O under :class:`~msgq_trio.client.bus.Bus` (not used on its
    own)."""

    def __init__(
        self,
        name: str,
        max_frame_size: int,
        target: str = "",
        reconnect: Reconnect | None = None,
        busy_poll: float = BUSY_POLL,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self._s = Session(
            name,
            max_frame_size,
            no_join=NO_JOIN,
            wake=_wake,
            reconnect=reconnect,
            target=target,
            connect_timeout=connect_timeout,
        )
        #: How long a lone caller polls for its answer (see _poll_answer). Never over TLS:
        #: the TLS session's copy tasks run in this program, and cannot while it polls.
        self._poller = CallPoller(0.0 if target.startswith("tls://") else busy_poll)
        self._out_fds = 0
        self._out: deque[Buffer] = deque()
        self._out_bytes = 0
        # Whether _out may hold anything but small buffers (under NO_JOIN bytes, no
        # descriptors): set by every queueing but send's small frame, cleared as the
        # writer takes the queue. Without it the writer joins the queue in one call
        # instead of looking at each buffer (a publisher queues thousands per write).
        self._out_mixed = False
        self._out_wake = trio.lowlevel.ParkingLot()
        # Whether the writer is parked on _out_wake (set as it parks, cleared by whoever
        # unparks it), as _reader_parked: asked once per message sent.
        self._writer_parked = False
        self._drained = trio.lowlevel.ParkingLot()
        self._in_wake = trio.lowlevel.ParkingLot()
        self._in_taken = trio.lowlevel.ParkingLot()
        # Whether the reader is parked on _in_taken (set as it parks, cleared by whoever
        # unparks it): a plain attribute, because the consumer asks once per message and
        # a ParkingLot's truth is a Python call.
        self._reader_parked = False
        self._reading = False  # the reader task runs (see _wait_goodbye)
        # The reader's receiver, and whether the reader is parked waiting for the socket
        # to become readable (then a caller may receive in its place: _poll_answer).
        self._rx: SocketReceiver | None = None
        self._reader_waiting = False
        self._init_api(target)
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._sends_unchecked = 0
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
        self._new_waiter = trio.Event
        #: Woken when the connection's state changes (lost, reconnected, given up).
        self._state_wake = trio.lowlevel.ParkingLot()
        self._up = False

    def _attach(self, stream: trio.SocketStream) -> None:
        """Take ``stream`` as the connection (the first, or a reconnect's: then the
        session starts over, and frames queued for the old one are dropped)."""
        self._fresh_session()
        self._stream = stream
        self._fd = stream.socket.fileno()
        self._conn = self._s.conn
        self._drop_out()
        self._writing = False
        self._deferring = False
        self._burst = False
        self._broker_goodbye = trio.Event()
        #: Set when this connection ends (the supervisor then closes it).
        self._down = trio.Event()
        self._up = True

    def _drop_out(self) -> None:
        """Forget the frames queued for a connection that is gone (and close the
        descriptors they would have carried)."""
        close_fds([fd for p in self._out if type(p) is FdBuffer for fd in p.fds])
        self._out.clear()
        self._out_bytes = 0
        self._out_fds = 0

    def _queue(self, pieces: list[Buffer]) -> None:
        out = self._out
        self._out_mixed = True
        for p in pieces:
            out.append(p)
            self._out_bytes += len(p)
        if self._writer_parked:
            self._writer_parked = False
            self._out_wake.unpark_all()

    def _count_fds(self, pieces: list[Buffer]) -> list[Buffer]:
        """Count the descriptors a frame carries (the session puts them on its first
        piece): while any are queued, only the writer writes (they need sendmsg)."""
        first = pieces[0]
        if type(first) is FdBuffer:
            self._out_fds += len(first.fds)
        return pieces

    def _queue_urgent(self, pieces: list[Buffer]) -> None:
        """Queue a latency-sensitive frame (request, answer) and try to write it at once."""
        out = self._out
        self._out_mixed = True
        for p in pieces:
            out.append(p)
            self._out_bytes += len(p)
        if self._deferring:
            return  # the reader writes the batch's answers when it is done with it
        if not self._burst:
            self._send_now()
        if out and self._writer_parked:
            self._writer_parked = False
            self._out_wake.unpark_all()

    def _queue_answer(self, pieces: list[Buffer]) -> None:
        """Queue an answer while the connection is up; otherwise drop it (nobody is there
        to take it) and close the descriptors it would have carried."""
        if self._s.lost is None and not self._closed:
            self._queue_urgent(self._count_fds(pieces))
        else:
            close_fds([fd for p in pieces if type(p) is FdBuffer for fd in p.fds])

    def _send_now(self) -> None:
        """Latency path: if the writer is idle, write the (small) queue to the socket now,
        saving the writer task's wake-up. What the kernel does not take stays queued;
        errors are left for the writer, so they are reported in one place."""
        if (
            self._writing
            or not self._out
            or self._out_bytes > 65536
            or self._out_fds  # descriptors need sendmsg: the writer does that
            or self._s.lost is not None
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
            self._out_mixed = True
        self._out_bytes -= sent
        if sent and self._drained:
            # flush() and send()'s high-water wait park on this, and the writer (which
            # wakes them otherwise) may find nothing left to write.
            self._drained.unpark_all()

    async def _wait_out(self) -> None:
        s = self._s
        while self._out_bytes > OUT_HIGH_WATER and s.lost is None:
            await self._drained.park()
        if s.lost is not None:
            raise s.lost

    def _queue_request(self, pieces: list[Buffer], fds: Sequence[int]) -> None:
        self._queue_urgent(self._count_fds(pieces) if fds else pieces)

    async def _finish_call(self, call: PendingCall) -> None:
        """Wait for ``call``'s outcome (or its local deadline), then forget its slot.

        With ``busy_poll`` on, a lone call first polls the socket for its answer for up to
        the poller's window (:meth:`_poll_answer`); either way this is a checkpoint."""
        try:
            poller = self._poller
            if not poller.limit:
                await self._wait_answer(call)
                return
            sent = time.perf_counter()
            how = self._poll_answer(call, poller.window) if poller.window else Poll.SLEPT
            answered = False
            try:
                if how is Poll.CAUGHT:
                    await trio.lowlevel.checkpoint()  # the schedule point the wait would be
                else:
                    await self._wait_answer(call)
                answered = True
            finally:
                if answered or how is Poll.MISSED:  # a miss counts, even if cancelled
                    poller.answered(time.perf_counter() - sent, how)
        finally:
            self._s.finish(call)

    async def _wait_answer(self, call: PendingCall) -> None:
        if call.deadline is None:
            await call.waiter.wait()  # the common path needs no cancel scope
            return
        with trio.move_on_at(call.deadline):
            await call.waiter.wait()
        call.expire(trio.current_time())

    def _poll_answer(self, call: PendingCall, window: float) -> Poll:
        """Receive in the reader's place, without sleeping, until ``call`` is done or
        ``window`` seconds have passed: CAUGHT if it is done, MISSED if not, SLEPT if
        polling was not possible.

        Only when nothing else could use this thread meanwhile: ``call`` is the only one
        pending, the reader is parked waiting for the socket (not handling frames, not
        paused by backpressure), no other task waits for the scheduler's next pass
        (trio's ``tasks_runnable``: tasks still to run in the current pass are not
        counted, and wait at most the window), and the window ends before any trio
        deadline (a timer, a cancel scope's) and the call's own. Whatever
        arrives is handled as the reader would (messages queued, requests started, other
        frames dispatched); once that makes a task runnable or fills the inbound queue
        past its high water, or the stream ends, or a large frame begins (received in
        place by the reader), the caller stops polling and waits as usual. Each empty
        pass yields the CPU (``sched_yield``) to a process that may be the one
        answering. A lost connection or a protocol violation fails the bus as in the
        reader.
        """
        rx = self._rx
        if rx is None or not self._reader_waiting or len(self._s.calls) != 1:
            return Poll.SLEPT
        stats = trio.lowlevel.current_statistics()
        if stats.tasks_runnable:
            return Poll.SLEPT
        window = min(window, stats.seconds_to_next_deadline)
        if call.deadline is not None:
            window = min(window, call.deadline - trio.current_time())
        conn, clock, yield_cpu = self._conn, time.perf_counter, os.sched_yield
        end = clock() + window
        try:
            while True:
                n = rx.receive_now(conn)
                if n is None:
                    if clock() >= end:
                        return Poll.MISSED
                    yield_cpu()
                    continue
                if not n or self._handle_received(False) or call.done:
                    break
                # Past the inbound high water the reader would stop reading (_in_full),
                # and a woken task must run: either way, stop receiving here.
                if self._in_full() or trio.lowlevel.current_statistics().tasks_runnable:
                    break
        except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as exc:
            self._reader_failed(exc)
        return Poll.CAUGHT if call.done else Poll.MISSED

    async def _wait_done(self, call: PendingCall) -> None:
        await call.waiter.wait()

    async def _writer(self) -> None:
        out, stream = self._out, self._stream
        try:
            while True:
                while not out:
                    self._writer_parked = True  # cleared by whoever unparks it
                    await self._out_wake.park()
                self._burst = False
                bufs = list(out)
                out.clear()
                if not self._out_mixed:
                    # Small frames only (a publisher's queue): one join, no pass over
                    # the buffers here or in send_buffers.
                    data = b"".join(bufs)
                    n = len(data)
                    bufs = [data]
                else:
                    self._out_mixed = False
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
                await self._down.wait()
            self._fail_all(ConnectionLost(f"connection to the broker lost: {exc}"))

    async def _reader(self) -> None:
        conn = self._conn
        rx = SocketReceiver(
            self._stream.socket,
            RECEIVE_SIZE,
            ancillary_size(self._s.max_fds),
            RECEIVE_INTO_SIZE,
        )
        receive = rx.receive_into
        received = False  # first pass: frames buffered behind WELCOME
        self._reading = True
        self._rx = rx
        try:
            while True:
                if received:
                    self._reader_waiting = rx.drained
                    try:
                        eof = not await receive(conn)
                    finally:
                        self._reader_waiting = False
                else:
                    eof, received = False, True
                if self._handle_received(eof):
                    return
                if self._in_full():
                    while self._in_full() and self._s.lost is None:
                        self._reader_parked = True  # reset by whoever unparks it
                        await self._in_taken.park()
        except (trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError) as exc:
            self._reader_failed(exc)
        finally:
            self._reading = False
            self._rx = None
            self._broker_goodbye.set()  # nothing more is read (see _wait_goodbye)
            rx.close()
            close_fds(conn.take_orphan_fds())

    def _handle_received(self, eof: bool) -> bool:
        """Handle what one receive brought (the reader's, or a polling caller's: see
        :meth:`_poll_answer`); ``eof``: the receive found the end. True when reading
        ends (EOF, the broker's GOODBYE); the bus has then failed its calls.

        Raises:
            ProtocolError: the broker violated the protocol (after the valid frames).
        """
        conn = self._conn
        self._deferring = True
        self._answered = 0
        try:
            evs = conn.events()
            if self._receive_events(evs, conn.message_burst):
                return True
        finally:
            self._deferring = False
            if self._answered > 1:
                self._burst = True
            if self._out:
                self._send_now()
                if self._out and self._writer_parked:
                    self._writer_parked = False
                    self._out_wake.unpark_all()
        if self._in and self._in_wake:
            self._in_wake.unpark_all()
        if conn.error_pending:
            conn.events()  # raises the protocol error that followed valid frames
        if eof:
            self._broker_goodbye.set()
            self._fail_all(ConnectionLost("the broker closed the connection"))
            return True
        return False

    def _reader_failed(self, exc: BaseException) -> None:
        """The reader's (or a polling caller's) receive or parse failed: the bus fails."""
        if isinstance(exc, ProtocolError):
            log.error("broker violated the protocol: %s", exc)
            self._fail_all(ConnectionLost(f"broker violated the protocol: {exc}"))
        else:
            self._fail_all(ConnectionLost(f"connection to the broker lost: {exc}"))
