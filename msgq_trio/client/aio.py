"""The asyncio client: ``connect()`` yields an :class:`AioBus` with the trio ``Bus``'s API.

The asyncio driver of the client :class:`~msgq_trio.client.session.Session`: it owns a
non-blocking socket, the event loop's reader and writer callbacks, handler tasks and
backpressure; what frames mean and what to answer is the session's. It imports no trio
(``tests/test_layering.py``): a program under ``asyncio.run`` needs no trio run context.

How it runs on the loop (no task of its own for I/O):

* reading: ``loop.add_reader`` calls :meth:`AioBus._on_readable`, which receives once
  (``recvmsg_into``, descriptors included), feeds the session's codec and acts on every
  event at once: messages go to the inbox for iteration and :meth:`AioBus.receive`,
  plain-function handlers are answered right there, ``async def`` handlers and
  notification callbacks get an asyncio task each. Over ``IN_HIGH_WATER`` bytes of
  messages nobody took, the reader is removed until the application takes some: the
  broker then pauses the senders (backpressure, never loss).
* writing: frames are queued and written at once while the socket takes them; what it
  does not take waits for ``loop.add_writer``. ``send`` and friends wait while more than
  :data:`OUT_HIGH_WATER` bytes are queued, so a fast producer's memory stays bounded.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket as pysocket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from ..errors import ConnectError, ConnectionLost, UsageError
from ..protocol.codes import FrameType
from ..protocol.errors import ProtocolError
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE, FdBuffer, Frame, close_fds, ready
from ..transport.fdpass import (  # no trio
    RECEIVE_INTO_SIZE,
    RECEIVE_SIZE,
    SEND_BUFFER,
    ancillary_size,
    take_fds,
    unconsumed_bytes,
)
from ..transport.tls import client_context_from_env  # ssl only: no trio
from .address import client_name, connect_target, hello_extra, parse_address
from .async_bus import AsyncBus
from .lifecycle import State
from .message import Buffer, Message, new_message
from .reconnect import Reconnect, reconnect_policy
from .session import (
    CLOSE_WAIT,
    PendingCall,
    Session,
)

if TYPE_CHECKING:  # imported lazily at run time: client/aio_pipe.py imports this module
    from .aio_pipe import AioPipe

__all__ = ["OUT_HIGH_WATER", "AioBus", "connect"]

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

_MESSAGE = int(FrameType.MESSAGE)
_RECV_FLAGS = pysocket.MSG_CMSG_CLOEXEC | pysocket.MSG_DONTWAIT
_SEND_FLAGS = pysocket.MSG_DONTWAIT | pysocket.MSG_NOSIGNAL


def _wake(call: PendingCall) -> None:
    """The session's wake-up for a finished call: resolve the future its caller awaits
    (unless that caller was cancelled and the future with it)."""
    fut = call.waiter
    if fut is not None and not fut.done():
        fut.set_result(None)


class AioBus(AsyncBus):
    """A connection to the broker for asyncio programs. Create it with :func:`connect`.

    The methods are those of the trio :class:`~msgq_trio.Bus` of the same name, with the
    same arguments, results and exceptions, except that :meth:`receive` raises the
    builtin ``TimeoutError``. Use it from the event loop it was created on (one loop, one
    thread). The API's shape and docstrings are :class:`~msgq_trio.client.async_bus.AsyncBus`'s,
    shared with the trio ``Bus``; this class does the I/O and the waiting.

    Resource handling: leaving :func:`connect`'s block writes what is queued, says
    GOODBYE, waits for the broker's (``CLOSE_WAIT`` s, longer while the broker still
    takes our bytes: see :func:`msgq_trio.client.session.close_patience`), closes the
    socket and the descriptors of messages never received, and cancels handler and
    callback tasks. Pending calls then fail with :class:`~msgq_trio.errors.ConnectionLost`.
    """

    def __init__(
        self,
        name: str,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        target: str = "",
        reconnect: Reconnect | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._s = Session(name, max_frame_size, wake=_wake, reconnect=reconnect, target=target)
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
        self._in: deque[Message | Frame] = deque()  # see AsyncBus._in
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

    async def _run(
        self,
        ssl_context: ssl.SSLContext | None,
        server_hostname: str | None,
        send_buffer: int,
        token: str | None,
        timeout: float,
        started: asyncio.Future[None],
    ) -> None:
        """The bus's connections, one after another (as the trio ``Bus._run``): connect,
        handshake, read and write until the connection ends; with ``reconnect``, wait as
        the backoff says and connect again until one succeeds (the groups are joined
        again) or the policy gives up. ``started`` is resolved once the first
        connection is up.

        Raises:
            ConnectError, UsageError: the first connection failed (see :func:`connect`).
        """
        life = self._s.life
        while True:
            life.dialing(self._loop.time())
            try:
                # A reconnect attempt is bounded as a whole (a broker that accepts but
                # never answers, or a SYN nobody answers, must not hold it); the first
                # connection waits ``timeout`` for WELCOME.
                async with (
                    asyncio.timeout_at(life.attempt_deadline) as attempt,
                    _open_transport(self._target, ssl_context, server_hostname) as (sock, remote),
                ):
                    if not remote and send_buffer:  # TCP keeps the kernel's autotuning
                        with contextlib.suppress(OSError):
                            sock.setsockopt(pysocket.SOL_SOCKET, pysocket.SO_SNDBUF, send_buffer)
                    self._attach(sock)
                    try:
                        await asyncio.wait_for(self._handshake(hello_extra(remote, token)), timeout)
                    except TimeoutError:
                        if attempt.expired():
                            raise
                        raise ConnectError(
                            f"no WELCOME from the broker within {timeout} s"
                        ) from None
                    attempt.reschedule(None)
                    restoring = self._welcomed(remote)
                    self._start()
                    hb = self._s.heartbeat_settings() if remote else None
                    beat = self._loop.create_task(self._heartbeat(*hb)) if hb else None
                    if restoring:
                        self._spawn(self._restore())
                    else:
                        started.set_result(None)
                    try:
                        await self._down.wait()
                    finally:
                        if beat is not None:
                            beat.cancel()
                            await asyncio.gather(beat, return_exceptions=True)
                        self._stop_io()
            except (ConnectError, UsageError, TimeoutError) as exc:
                if life.state is State.CONNECTING:
                    life.attempt_failed(exc, self._loop.time())
                    raise
                self._attempt_failed(life.timed_out() if isinstance(exc, TimeoutError) else exc)
            delay = life.wait(self._loop.time())
            if delay is None:
                return  # the end is final (reconnect off, given up, or the bus closed)
            await asyncio.sleep(delay)

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

    def _state_changed(self) -> None:
        self._wake_all(self._state_waiters)
        self._wake_all(self._in_waiters)

    async def wait_connected(self, timeout: float | None = None) -> None:
        """Wait until the bus is connected: at once while it is; after a loss with
        ``reconnect``, until the new connection is up and the groups are joined again.

        Raises:
            TimeoutError: not connected within ``timeout`` s.
            ConnectionLost: the loss is final (reconnect off or given up).
            UsageError: the bus is closed.
        """
        async with asyncio.timeout(timeout):
            while not self.connected:
                if self._closed:
                    raise UsageError("the bus is closed")
                if self._final():
                    assert self._s.lost is not None
                    raise self._s.lost
                fut: asyncio.Future[None] = self._loop.create_future()
                self._state_waiters.append(fut)
                try:
                    await fut
                finally:
                    if fut in self._state_waiters:
                        self._state_waiters.remove(fut)

    # -- lifecycle ---------------------------------------------------------------------
    async def _handshake(self, hello_fields: dict[str, object]) -> None:
        """Send HELLO and take WELCOME; frames right behind it stay in the codec for the
        reader.

        Raises:
            ConnectError: the broker refused (``code``), closed, broke the protocol, or
                the socket failed.
        """
        loop = self._loop
        try:
            await loop.sock_sendall(self._sock, b"".join(self._s.hello(hello_fields)))
            while not self._take_welcome(await loop.sock_recv(self._sock, RECEIVE_SIZE)):
                pass
        except OSError as exc:
            raise ConnectError(f"connection to the broker failed: {exc}") from exc
        # A message may carry the broker's max_fds_per_message: a smaller buffer would
        # truncate them (MSG_CTRUNC ends the connection).
        self._ancsize = ancillary_size(self._s.max_fds)

    def _start(self) -> None:
        """Start reading: first the frames that came behind WELCOME, then the socket."""
        self._process()
        if self._s.lost is None:
            self._resume_reading()

    async def _close(self) -> None:
        """Write what is queued, say GOODBYE, wait for the broker's, close the socket,
        cancel handler tasks (see the class docstring)."""
        if self._closed:
            return
        self._closing()
        await self._say_goodbye()
        self._shutdown(ConnectionLost("the bus was closed"))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _now(self) -> float:
        return self._loop.time()

    def _unsent(self) -> int:
        return self._out_bytes + unconsumed_bytes(self._fd)

    async def _wait_goodbye(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._broker_goodbye.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def _task(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        if self._closed:
            raise UsageError("the bus is closed")
        self._spawn(fn(*args))

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

    # -- writing -----------------------------------------------------------------------
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

    async def flush(self) -> None:
        """Wait until everything queued so far has been written to the socket.

        Raises:
            ConnectionLost: the connection ended first.
        """
        while self._out_bytes and self._s.lost is None and not self._write_failed:
            fut: asyncio.Future[None] = self._loop.create_future()
            self._drain_waiters.append(fut)
            if not self._writer_armed:  # woken at every drain below the bound
                self._write()
            await fut
        if self._write_failed and self._s.lost is None:
            await self._down.wait()
        self._check_open()

    # -- reading -----------------------------------------------------------------------
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
        count = self._in_count
        try:
            if not self._receive_events(conn.events(), conn.message_burst) and conn.error_pending:
                conn.events()  # raises the protocol error that followed valid frames
        except ProtocolError as exc:
            self._protocol_error(exc)
        if self._in_count != count:
            self._wake_all(self._in_waiters)
        if self._reading and self._in_full():
            # Nobody takes the messages: read no more until they do (the broker then
            # pauses our senders), never drop.
            self._loop.remove_reader(self._fd)
            self._reading = False

    # -- what plugin clients build on (see AsyncBus) ------------------------------------
    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def checkpoint(self) -> None:
        await asyncio.sleep(0)

    def new_event(self) -> asyncio.Event:
        return asyncio.Event()

    async def shielded(
        self, fn: Callable[[], Coroutine[Any, Any, None]], timeout: float | None = None
    ) -> None:
        async def bounded() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fn(), timeout)

        # A task of this bus: a cancelled caller leaves it running to its end (or the
        # bus's close), as trio's shielded scope would.
        task = self._loop.create_task(bounded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(task)

    # -- pipes (plugins/pipe, docs/PIPES.md) ---------------------------------------------
    def pipe(self, name: str) -> AioPipe:
        """The named pipe ``name`` of the pipe plugin (docs/PIPES.md): ``await
        open_reader()`` / ``await open_writer()`` on the returned
        :class:`~msgq_trio.client.aio_pipe.AioPipe` give its asyncio ends (the trio
        client's pipe API, on the same pipe logic)."""
        from .aio_pipe import AioPipe

        return AioPipe(self, name)

    # -- sending -----------------------------------------------------------------------
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

        Returns once the frame is queued; waits only while more than
        :data:`OUT_HIGH_WATER` bytes are queued. ``attachments`` are binary blobs;
        ``fds`` are passed with SCM_RIGHTS (Unix sockets): each recipient gets its own
        duplicate, and the caller still owns (and closes) the ones it passed.
        ``on_behalf_of``: as the trio ``Bus.send``'s (a binder forwarding stored
        traffic: receivers see that sender, ``via`` this client).

        Raises:
            UsageError: the bus is closed, ``body`` cannot be encoded as CBOR, or the
                descriptors cannot be sent (too many, or over TCP).
            ConnectionLost: the broker went away.
        """
        self._check_open()
        if type(body) is bytes and not (header or attachments or fds or on_behalf_of):
            frame = self._s.encode_bytes_message(target, body)
        else:
            frame = self._s.encode_message(
                target,
                body,
                header=header,
                attachments=attachments,
                fds=fds,
                on_behalf_of=on_behalf_of,
            )
        out = self._out
        if isinstance(frame, bytes):
            out.append(frame)
            self._out_bytes += len(frame)
        else:
            for piece in frame:
                out.append(piece)
                self._out_bytes += len(piece)
        if not self._write_soon and not self._writer_armed:
            # One write for all the messages this loop pass queues (a program sending
            # in a loop) instead of a sendmsg per message; calls and answers still
            # write at once (they carry what went before them too).
            self._write_soon = True
            self._loop.call_soon(self._write_later)
        if self._out_bytes > OUT_HIGH_WATER:
            await self._wait_out()

    # -- RPC ---------------------------------------------------------------------------
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

    # -- receiving ---------------------------------------------------------------------
    def __anext__(self) -> Awaitable[Message]:
        q = self._in
        if q:
            # A message is waiting: _next_message's end, with no coroutine at all
            # (``ready``: an awaitable done; AsyncBus._take inline).
            item = q.popleft()
            self._in_popped += 1
            if type(item) is Frame:
                msg = new_message(item, self._s.sources)
            else:
                assert isinstance(item, Message)
                msg = item
            if not self._reading and not self._in_full():
                self._resume_reading()
            return ready(msg)
        return self._anext_waiting()

    async def _anext_waiting(self) -> Message:
        waited = await self._next_message()
        if waited is None:
            raise self._end_of_iteration()
        return waited

    async def receive(self, timeout: float | None = None) -> Message:
        """The next message or notification.

        Raises:
            TimeoutError: nothing arrived within ``timeout`` seconds.
            ConnectionLost: the connection ended.
        """
        if timeout is None:
            msg = await self._next_message()
        else:
            async with asyncio.timeout(timeout):
                msg = await self._next_message()
        if msg is None:
            raise self._s.lost or ConnectionLost("the bus was closed")
        return msg

    async def _next_message(self) -> Message | None:
        """The next received message, waiting for one; None once the connection ended
        and every message before the end was taken."""
        q = self._in
        while not q:
            if self._closed or self._final():
                return None
            fut: asyncio.Future[None] = self._loop.create_future()
            self._in_waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._in_waiters:  # cancelled (a receive timeout)
                    self._in_waiters.remove(fut)
        msg = self._take(q.popleft())
        if not self._reading and not self._in_full():
            self._resume_reading()
        return msg


async def _open_tcp(host: str, port: int, target: str) -> pysocket.socket:
    """A connected non-blocking TCP socket to ``host:port`` (each address in turn).

    Raises:
        ConnectError: no address could be reached.
    """
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=pysocket.SOCK_STREAM)
    except OSError as exc:
        raise ConnectError(f"cannot connect to the broker at {target}: {exc}") from exc
    last: OSError | None = None
    for family, kind, proto, _name, addr in infos:
        sock = pysocket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, addr)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        except BaseException:
            sock.close()
            raise
        sock.setsockopt(pysocket.IPPROTO_TCP, pysocket.TCP_NODELAY, 1)
        return sock
    raise ConnectError(f"cannot connect to the broker at {target}: {last}")


async def _pump_in(reader: asyncio.StreamReader, sock: pysocket.socket) -> None:
    """TLS bridge, network to the bus's socket pair: copy until EOF, then pass it on."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError, ConnectionError):
        while data := await reader.read(RECEIVE_SIZE):
            await loop.sock_sendall(sock, data)
        sock.shutdown(pysocket.SHUT_WR)


async def _pump_out(sock: pysocket.socket, writer: asyncio.StreamWriter) -> None:
    """TLS bridge, the bus's socket pair to the network: copy until EOF, then close."""
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError, ConnectionError):
        while data := await loop.sock_recv(sock, RECEIVE_SIZE):
            writer.write(data)
            await writer.drain()
    writer.close()


@asynccontextmanager
async def _open_transport(
    target: str, ssl_context: ssl.SSLContext | None, server_hostname: str | None
) -> AsyncIterator[tuple[pysocket.socket, bool]]:
    """A connected non-blocking socket to the broker and whether it is a TCP one.

    For ``tls://`` asyncio's TLS runs in two copy tasks between the network and one end
    of a local socket pair, and the bus gets the other end: the bus reads and writes a
    plain socket whatever the transport (as the trio client does).

    Raises:
        ConnectError: cannot connect, or the TLS handshake failed.
    """
    loop = asyncio.get_running_loop()
    if not target.startswith(("tcp://", "tls://")):
        sock = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, target)
        except OSError as exc:
            sock.close()
            raise ConnectError(
                f"cannot connect to the broker at {target}: {exc.strerror or exc}"
            ) from exc
        except BaseException:
            sock.close()
            raise
        try:
            yield sock, False
        finally:
            sock.close()
        return
    scheme, host, port = parse_address(target)
    if scheme == "tcp":
        sock = await _open_tcp(host, port, target)
        try:
            yield sock, True
        finally:
            sock.close()
        return
    # Built before connecting (a context that cannot be built leaks nothing), the same
    # way as the trio client's and the command line's.
    ctx = ssl_context if ssl_context is not None else client_context_from_env()
    try:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=ctx, server_hostname=server_hostname or host
        )
    except (OSError, ssl.SSLError) as exc:
        raise ConnectError(f"TLS connection to the broker at {target} failed: {exc}") from exc
    inner, outer = pysocket.socketpair(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    inner.setblocking(False)
    outer.setblocking(False)
    pumps = [
        loop.create_task(_pump_in(reader, outer)),
        loop.create_task(_pump_out(outer, writer)),
    ]
    try:
        yield inner, True
    finally:
        inner.close()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        outer.close()
        writer.close()
        # TLS says close_notify first; a broker that is gone must not hold us up.
        try:
            await asyncio.wait_for(writer.wait_closed(), CLOSE_WAIT)
        except (OSError, ConnectionError, ssl.SSLError, TimeoutError):
            writer.transport.abort()


@asynccontextmanager
async def connect(
    socket: str | os.PathLike[str] | None = None,
    name: str | None = None,
    *,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    send_buffer: int = SEND_BUFFER,
    token: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    timeout: float = 30.0,
    reconnect: bool | Reconnect = False,
) -> AsyncIterator[AioBus]:
    """Connect to the broker from asyncio; yields an :class:`AioBus`.

    Args:
        socket: the broker's Unix socket path, or ``tcp://HOST:PORT`` / ``tls://HOST:PORT``;
            default ``$MSGQ_TRIO_SOCKET`` (a path or such a URL) or the per-user path
            (:func:`msgq_trio.config.default_socket_path`).
        name: this client's name, shown to others as ``sender_name``.
        max_frame_size: the largest frame accepted from the broker.
        send_buffer: SO_SNDBUF for a Unix socket (``SEND_BUFFER``; 0 = kernel default).
        token: the credential for TCP (sent in HELLO); default ``$MSGQ_TRIO_TOKEN``.
        ssl_context: for ``tls://``: an :class:`ssl.SSLContext`; default one that
            trusts ``$MSGQ_TRIO_TLS_CA`` (else the system's trust store) and presents
            ``$MSGQ_TRIO_TLS_CERT``/``$MSGQ_TRIO_TLS_KEY`` if set, as the trio client's.
        server_hostname: the name the broker's certificate must carry (default the host).
        timeout: longest wait for the broker's WELCOME.
        reconnect: off by default; True or a :class:`~msgq_trio.client.reconnect.Reconnect`
            reconnects after a loss as the trio client's ``connect`` does (README
            "Reconnecting"). Only the first connection's failure is raised here.

    Resource handling: see :class:`AioBus`.

    Raises:
        ConnectError: no broker at the address, TLS failed, it refused the handshake
            (``code``), or it sent no WELCOME within ``timeout`` s.
        UsageError: a malformed ``tcp://``/``tls://`` address, or a TLS file from the
            environment that cannot be loaded (named).
    """
    bus = AioBus(
        client_name(name), max_frame_size, connect_target(socket), reconnect_policy(reconnect)
    )
    loop = asyncio.get_running_loop()
    started: asyncio.Future[None] = loop.create_future()
    runner = loop.create_task(
        bus._run(ssl_context, server_hostname, send_buffer, token, timeout, started)
    )
    try:
        await asyncio.wait([started, runner], return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            runner.result()  # the first connection's error
            raise ConnectError(f"no connection to the broker at {bus._target}")
    except BaseException:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        raise
    try:
        yield bus
    finally:
        await bus._close()
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
