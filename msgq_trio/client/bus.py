"""The trio client: ``connect()`` yields a :class:`Bus` for messages, RPC and notifications.

One connection = one nursery holding a reader task, a writer task and a task per incoming
request to an async handler (plain-function handlers are answered by the reader). The
writer joins every queued frame into one ``send_all`` (one trio call per batch, not per
frame); ``send`` only queues and waits when the queue is over its bound.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from ..errors import ConnectError, ConnectionLost, UsageError
from ..protocol.codes import FrameType
from ..protocol.errors import ProtocolError
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE, FdBuffer, Frame, ready
from ..transport.errors import translate_socket_errors
from ..transport.fdpass import RECEIVE_INTO_SIZE, RECEIVE_SIZE, SEND_BUFFER
from ..transport.sockets import (
    NO_JOIN,
    SocketReceiver,
    ancillary_size,
    close_fds,
    send_buffers,
    set_send_buffer,
    unconsumed_bytes,
)
from ..transport.tls import client_context_from_env
from .address import client_name, connect_target, hello_extra, parse_address
from .async_bus import AsyncBus
from .lifecycle import State
from .message import Buffer, Member, Message, Reply, Result, new_message
from .polling import BUSY_POLL, CallPoller, Poll, check_busy_poll
from .reconnect import Reconnect, reconnect_policy
from .session import (
    CLOSE_WAIT,
    IN_HIGH_WATER,
    PendingCall,
    Session,
)

__all__ = [
    "CLOSE_WAIT",
    "IN_HIGH_WATER",
    "OUT_HIGH_WATER",
    "RECEIVE_SIZE",
    "SEND_BUFFER",
    "Bus",
    "Member",
    "Message",
    "Reconnect",
    "Reply",
    "Result",
    "connect",
]

if TYPE_CHECKING:  # imported lazily at run time: client/pipe.py imports bus
    from .pipe import Pipe

log = logging.getLogger("msgq_trio.client")

#: ``send`` waits for the writer once this many bytes are queued (bounds client memory
#: while letting a fast publisher batch hundreds of frames per send_all).
OUT_HIGH_WATER = 1024 * 1024
#: Iteration yields to other tasks at least once every this many messages (a power
#: of two: the count is ``AsyncBus._in_popped``'s low bits).
_FAIRNESS = 256
_MEMBERSHIP = "msgq.membership"
_MESSAGE = FrameType.MESSAGE


def _wake(call: PendingCall) -> None:
    """The session's wake-up for a finished call: set the trio.Event its waiter waits on."""
    call.waiter.set()


class Bus(AsyncBus):
    """A connection to the broker. Create it with :func:`connect`.

    The trio driver of the client :class:`~msgq_trio.client.session.Session`: the socket,
    the reader and writer tasks, handler tasks, backpressure and descriptor passing are
    here; what frames mean and what to answer is the session's, and the API's shape is
    :class:`~msgq_trio.client.async_bus.AsyncBus`'s.
    """

    def __init__(
        self,
        name: str,
        max_frame_size: int,
        target: str = "",
        reconnect: Reconnect | None = None,
        busy_poll: float = BUSY_POLL,
    ) -> None:
        self._s = Session(
            name, max_frame_size, no_join=NO_JOIN, wake=_wake, reconnect=reconnect, target=target
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
        self._in: deque[Message | Frame] = deque()  # see AsyncBus._in
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

    # -- lifecycle ---------------------------------------------------------------------
    async def _handshake(self, hello_fields: dict[str, object]) -> None:
        """Send HELLO and take WELCOME (see ``_take_welcome``).

        Raises:
            ConnectError: the broker refused (``code``), closed, broke the protocol, or
                the socket failed.
        """
        hello = self._s.hello(hello_fields)
        try:
            with translate_socket_errors():
                await self._stream.send_all(b"".join(hello))
                while not self._take_welcome(await self._stream.receive_some(RECEIVE_SIZE)):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ConnectError(f"connection to the broker failed: {exc}") from exc

    async def _close(self) -> None:
        """Flush queued frames, say GOODBYE, wait for the broker's (``_say_goodbye``),
        close."""
        if self._closed:
            return
        self._closing()
        await self._say_goodbye()
        await trio.aclose_forcefully(self._stream)
        self._fail_all(ConnectionLost("the bus was closed"))

    def _now(self) -> float:
        return trio.current_time()

    def _unsent(self) -> int:
        return self._out_bytes + unconsumed_bytes(self._fd)

    async def _wait_goodbye(self, timeout: float) -> bool:
        # The event is also set when the reader ends for any other reason: when the
        # block around the bus was cancelled, the reader and the writer were cancelled
        # with it, and nobody would read the broker's GOODBYE.
        with trio.move_on_after(timeout):
            await self._broker_goodbye.wait()
        if not self._reading:
            # The writer may be gone too: send what is queued (our GOODBYE included)
            # if the socket takes it now.
            self._send_now()
        return self._broker_goodbye.is_set()

    async def _checkpoint(self) -> None:
        await trio.lowlevel.checkpoint()

    def _task(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        if self._nursery is None:
            raise UsageError("the bus is not running")
        self._nursery.start_soon(fn, *args)

    def _fail_all(self, exc: ConnectionLost) -> None:
        """The connection ended (or the bus closed): the session fails the pending calls
        with ``exc``; unless a reconnect follows, the bus is lost for good. Every waiter
        wakes to see it."""
        self._connection_failed(exc)
        self._in_wake.unpark_all()
        self._drained.unpark_all()
        self._reader_parked = False
        self._in_taken.unpark_all()
        self._state_wake.unpark_all()

    def _state_changed(self) -> None:
        self._state_wake.unpark_all()
        self._in_wake.unpark_all()

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until the bus is connected: at once while it is; after a loss with
        ``reconnect``, until the new connection is up and the groups are joined again.

        Raises:
            trio.TooSlowError: not connected within ``timeout`` s.
            ConnectionLost: the loss is final (reconnect off or given up).
            UsageError: the bus is closed.
        """
        with trio.fail_after(math.inf if timeout is None else timeout):
            while not self.connected:
                if self._closed:
                    raise UsageError("the bus is closed")
                if self._final():
                    assert self._s.lost is not None
                    raise self._s.lost
                await self._state_wake.park()
        await trio.lowlevel.checkpoint()

    async def _run(
        self,
        ssl_context: Any,
        server_hostname: str | None,
        send_buffer: int,
        token: str | None,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The bus's connections, one after another: connect, handshake, run the
        reader, writer (and heartbeat) until the connection ends; then, with
        ``reconnect``, wait as the backoff says and connect again, until one succeeds
        (the groups are joined again, see ``_restore``) or the policy gives up (the loss
        is final). ``task_status.started()`` once the first connection is up.

        Raises:
            ConnectError, UsageError: the first connection failed (see :func:`connect`).
        """
        life = self._s.life
        while True:
            life.dialing(trio.current_time())
            try:
                with trio.CancelScope(deadline=life.attempt_deadline or math.inf) as attempt:
                    async with _open_transport(self._target, ssl_context, server_hostname) as (
                        stream,
                        remote,
                    ):
                        if not remote:  # TCP keeps the kernel's send buffer autotuning
                            set_send_buffer(stream.socket, send_buffer)
                        self._attach(stream)
                        try:
                            await self._handshake(hello_extra(remote, token))
                        except BaseException:
                            await trio.aclose_forcefully(stream)
                            raise
                        attempt.deadline = math.inf
                        restoring = self._welcomed(remote)
                        await self._serve_connection(stream, remote, task_status, restoring)
                if attempt.cancelled_caught:
                    self._attempt_failed(life.timed_out())
            except (ConnectError, UsageError) as exc:
                if life.state is State.CONNECTING:
                    life.attempt_failed(exc, trio.current_time())
                    raise
                self._attempt_failed(exc)
            delay = life.wait(trio.current_time())
            if delay is None:
                return  # the end is final (reconnect off, given up, or the bus closed)
            await trio.sleep(delay)

    async def _serve_connection(
        self,
        stream: trio.SocketStream,
        remote: bool,
        task_status: trio.TaskStatus[None],
        restoring: bool,
    ) -> None:
        """Run the connection's reader, writer (and heartbeat) until it ends, then close
        it. The first connection reports ``task_status.started()``; a reconnect's joins
        the groups again (``_restore``)."""
        async with trio.open_nursery() as tasks:
            tasks.start_soon(self._reader)
            tasks.start_soon(self._writer)
            hb = self._s.heartbeat_settings() if remote else None
            if hb is not None:
                tasks.start_soon(self._heartbeat, *hb)
            if restoring:
                tasks.start_soon(self._restore)
            else:
                task_status.started()
            await self._down.wait()
            tasks.cancel_scope.cancel()
        await trio.aclose_forcefully(stream)

    # -- sending -----------------------------------------------------------------------
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

    def send(
        self,
        target: str,
        body: Any = None,
        attachments: Sequence[Buffer] = (),
        *,
        header: dict[str, object] | None = None,
        fds: Sequence[int] = (),
        on_behalf_of: tuple[str, str] | None = None,
    ) -> Awaitable[None]:
        """Send a one-way message to ``target`` (lname, group, ``G[N]`` or ``G[?]``):
        ``await bus.send(...)``.

        A group gets it on every member except the sender. Returns once the frame is
        queued; waits only while more than ``OUT_HIGH_WATER`` bytes are queued.
        A cancellation point every ``_FAIRNESS`` (256) calls and whenever it waits, not
        at every call: a cancelled publisher loop stops within that many messages, and
        each message it queued is sent.
        A plain method that returns an awaitable, not a coroutine function, because a
        coroutine per message cost about a tenth of a publisher's CPU (BENCHMARKS.md,
        "The client's per-message path, again"): the frame is queued, or the error
        raised, when it is called; what it returns passes for a coroutine
        (``nursery.start_soon(bus.send, ...)`` works).
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
        n = self._sends_unchecked + 1
        if n >= _FAIRNESS:
            # A cancellation check every _FAIRNESS sends (and in every wait for the
            # writer): one per message costs a tenth of the send itself.
            self._sends_unchecked = 0
            return self._send_checked(target, body, attachments, header, fds, on_behalf_of)
        self._sends_unchecked = n
        s = self._s
        if s.lost is not None or self._closed:
            self._check_open()
        if type(body) is bytes and not (header or attachments or fds or on_behalf_of):
            frame = s.encode_bytes_message(target, body)
        else:
            frame = s.encode_message(
                target,
                body,
                header=header,
                attachments=attachments,
                fds=fds,
                on_behalf_of=on_behalf_of,
            )
        if type(frame) is bytes:
            # _queue for one bytes, inline: this runs once per message.
            self._out.append(frame)
            size = len(frame)
            self._out_bytes += size
            if size >= NO_JOIN:
                self._out_mixed = True
            if self._writer_parked:
                self._writer_parked = False
                self._out_wake.unpark_all()
        else:
            self._queue(self._count_fds(frame) if fds else frame)  # type: ignore[arg-type]
        if self._out_bytes > OUT_HIGH_WATER:
            return self._wait_out()
        return ready(None)

    async def _send_checked(
        self,
        target: str,
        body: Any,
        attachments: Sequence[Buffer],
        header: dict[str, object] | None,
        fds: Sequence[int],
        on_behalf_of: tuple[str, str] | None,
    ) -> None:
        """:meth:`send` after its cancellation check (nothing is queued if cancelled)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        await self.send(
            target, body, attachments, header=header, fds=fds, on_behalf_of=on_behalf_of
        )

    async def flush(self) -> None:
        """Wait until everything queued so far has been written to the socket."""
        while self._out_bytes and self._s.lost is None:
            await self._drained.park()
        self._check_open()

    # -- RPC ---------------------------------------------------------------------------
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

    # -- what plugin clients build on (see AsyncBus) ------------------------------------
    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)

    async def checkpoint(self) -> None:
        await trio.lowlevel.checkpoint()

    def new_event(self) -> trio.Event:
        return trio.Event()

    async def shielded(
        self, fn: Callable[[], Coroutine[Any, Any, None]], timeout: float | None = None
    ) -> None:
        with trio.move_on_after(math.inf if timeout is None else timeout) as cs:
            cs.shield = True
            await fn()
        await trio.lowlevel.checkpoint_if_cancelled()  # the caller's cancellation, now

    # -- named pipes (plugins/pipe, docs/PIPES.md) ---------------------------------------
    def pipe(self, name: str) -> Pipe:
        """The named pipe ``name`` of the pipe plugin (docs/PIPES.md): ``await
        open_reader()`` / ``await open_writer()`` on the returned
        :class:`msgq_trio.client.pipe.Pipe` give trio byte streams."""
        from .pipe import Pipe

        return Pipe(self, name)

    # -- receiving ---------------------------------------------------------------------
    def __anext__(self) -> Awaitable[Message]:
        q = self._in
        popped = self._in_popped + 1
        if q and popped & (_FAIRNESS - 1):
            # A message is waiting and no fairness checkpoint is due: _next_message's
            # first branch, with no coroutine at all (``ready``: an awaitable done).
            self._in_popped = popped
            item = q.popleft()
            # AsyncBus._take, inline: this runs once per message.
            if type(item) is Frame:
                msg = new_message(item, self._s.sources)
            else:
                assert isinstance(item, Message)
                msg = item
            if self._reader_parked:
                self._reader_parked = False
                self._in_taken.unpark_all()
            return ready(msg)
        return self._anext_waiting()

    async def _anext_waiting(self) -> Message:
        waited = await self._next_message()
        if waited is None:
            raise self._end_of_iteration()
        return waited

    def _call_started(self) -> None:
        if self._reader_parked:  # the reader waits for the application (see _in_full)
            self._reader_parked = False
            self._in_taken.unpark_all()

    async def receive(self, timeout: float | None = None) -> Message:
        """The next message or notification.

        Raises:
            trio.TooSlowError: nothing arrived within ``timeout``.
            ConnectionLost: the connection ended.
        """
        with trio.fail_after(math.inf if timeout is None else timeout):
            msg = await self._next_message()
        if msg is None:
            raise self._s.lost or ConnectionLost("the bus was closed")
        return msg

    async def _next_message(self) -> Message | None:
        q = self._in
        while not q:
            if self._closed or self._final():
                return None
            await self._in_wake.park()
        msg = self._take(q.popleft())
        if self._reader_parked:  # only when _in_full()
            self._reader_parked = False
            self._in_taken.unpark_all()
        # A full checkpoint every _FAIRNESS messages keeps iteration cancellable and lets
        # other tasks run; one per message would cost more than the message itself.
        if not self._in_popped & (_FAIRNESS - 1):
            await trio.lowlevel.checkpoint()
        return msg

    # -- tasks -------------------------------------------------------------------------
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
        UsageError: a malformed address, or a TLS file of the environment unusable.
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
    scheme, host, port = parse_address(target)
    ctx = None
    if scheme == "tls":  # before connecting: a context that cannot be built leaks nothing
        ctx = ssl_context if ssl_context is not None else client_context_from_env()
    try:
        tcp = await trio.open_tcp_stream(host, port)
    except OSError as exc:
        raise ConnectError(
            f"cannot connect to the broker at {target}: {exc.strerror or exc}"
        ) from exc
    if ctx is None:
        yield tcp, True
        return
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
        # Shielded: closing the bus cancels the task that runs the connection, and an
        # await under that cancel would skip the closes after it.
        with trio.CancelScope(shield=True):
            await trio.aclose_forcefully(inner)
            await trio.aclose_forcefully(outer)
            await trio.aclose_forcefully(tls)
    if body_error is not None:
        raise body_error


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
    reconnect: bool | Reconnect = False,
    busy_poll: float = BUSY_POLL,
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
            optionally a client certificate); default one trusting ``$MSGQ_TRIO_TLS_CA``
            (else the system's trust store) with ``$MSGQ_TRIO_TLS_CERT``/``_KEY`` as
            client certificate if set, as the command line does.
        server_hostname: the name the broker's certificate must carry (default the host).
        reconnect: off by default (a lost connection ends the bus). True (the defaults
            of :class:`~msgq_trio.client.reconnect.Reconnect`) or a ``Reconnect``: after
            a loss, reconnect to the same address with the same name, token and TLS
            context, with backoff, join the groups again and run the
            :meth:`~Bus.on_reconnected` callbacks (README "Reconnecting"). Only the first
            connection's failure is raised here.
        busy_poll: the longest a call polls the socket for its answer before it sleeps
            (seconds; :data:`~msgq_trio.client.polling.BUSY_POLL`, 200 us; 0 = never),
            adaptive: only while this client's calls are answered within it, only for a
            lone call while no other task of the program is runnable, never on one CPU
            or over TLS (:class:`~msgq_trio.client.polling.CallPoller`; README "Busy
            polling").

    Resource handling: leaving the block flushes queued frames, says GOODBYE, waits for
    the broker's (CLOSE_WAIT s, longer while the broker still takes our bytes: it may be
    pausing our reads for backpressure; see ``close_patience``), closes the socket and
    cancels handler tasks (and a reconnect under way); pending calls fail with
    ConnectionLost; descriptors that came with messages nobody took are closed.

    Raises:
        ConnectError: no broker at the address, TLS failed, or it refused the handshake
            (``code`` ``version-mismatch``, ``limit-exceeded``, ``unauthenticated``...).
        UsageError: a malformed ``tcp://``/``tls://`` address, a TLS file named by the
            environment that cannot be loaded, or a bad ``reconnect``.
    """
    try:
        poll = check_busy_poll(busy_poll)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    bus = Bus(
        client_name(name),
        max_frame_size,
        connect_target(socket),
        reconnect_policy(reconnect),
        busy_poll=poll,
    )
    body_error: Exception | None = None
    async with trio.open_nursery() as nursery:
        bus._nursery = nursery
        try:
            await nursery.start(bus._run, ssl_context, server_hostname, send_buffer, token)
        except Exception as exc:
            # The first connection failed: raised as it is (no ExceptionGroup).
            body_error = exc
            nursery.cancel_scope.cancel()
        else:
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
    # Messages nobody took: the descriptors that came with them are ours to close.
    bus._drop_in()
    if body_error is not None:
        raise body_error
