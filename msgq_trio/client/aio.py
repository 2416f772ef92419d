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

import asyncio
import contextlib
import os
import socket as pysocket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from ..errors import ConnectError, ConnectionLost, UsageError
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE, Frame, ready
from ..transport.fdpass import (  # no trio
    RECEIVE_SIZE,
    SEND_BUFFER,
    ancillary_size,
    unconsumed_bytes,
)
from .address import client_name, connect_target, hello_extra
from .asyncio_streams import OUT_HIGH_WATER, AioStreams
from .asyncio_transport import open_transport
from .lifecycle import CONNECT_TIMEOUT, connect_timeout
from .message import Buffer, Message, new_message
from .reconnect import Reconnect, reconnect_policy

if TYPE_CHECKING:  # imported lazily at run time: client/aio_pipe.py imports this module
    from .aio_pipe import AioPipe

__all__ = ["OUT_HIGH_WATER", "AioBus", "connect"]


class AioBus(AioStreams):
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

    async def _connection(self, deadline: float | None, started: Callable[[], None]) -> None:
        """One connection: dial, handshake by ``deadline``, serve (see
        :meth:`~msgq_trio.client.async_driver.AsyncDriver._connection`)."""
        life = self._s.life
        try:
            async with (
                asyncio.timeout_at(deadline) as attempt,
                open_transport(self._target, self._ssl_context, self._server_hostname) as (
                    sock,
                    remote,
                ),
            ):
                if not remote and self._send_buffer:  # TCP keeps the kernel's autotuning
                    with contextlib.suppress(OSError):
                        sock.setsockopt(pysocket.SOL_SOCKET, pysocket.SO_SNDBUF, self._send_buffer)
                self._attach(sock)
                await self._handshake(hello_extra(remote, self._token))
                attempt.reschedule(None)
                restoring = self._welcomed(remote)
                self._start()
                hb = self._s.heartbeat_settings() if remote else None
                beat = self._loop.create_task(self._heartbeat(*hb)) if hb else None
                if restoring:
                    self._spawn(self._restore())
                else:
                    started()
                try:
                    await self._down.wait()
                finally:
                    if beat is not None:
                        beat.cancel()
                        await asyncio.gather(beat, return_exceptions=True)
                    self._stop_io()
        except TimeoutError:
            if not attempt.expired():
                raise
            raise life.timed_out() from None

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
        unsent: OSError | None = None
        try:
            try:
                await loop.sock_sendall(self._sock, b"".join(self._s.hello(hello_fields)))
            except OSError as exc:
                # As in the trio driver: a broker that refused us may have closed before
                # our HELLO was all written; its ERROR still waits to be read.
                unsent = exc
            while not self._take_welcome(await loop.sock_recv(self._sock, RECEIVE_SIZE)):
                pass
        except OSError as exc:
            raise ConnectError(f"connection to the broker failed: {unsent or exc}") from exc
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

    # -- writing -----------------------------------------------------------------------

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

    # -- receiving ---------------------------------------------------------------------
    def __anext__(self) -> Awaitable[Message]:
        q = self._in
        if q:
            # A message is waiting: _next_message's end, with no coroutine at all
            # (``ready``: an awaitable done; AsyncBus._take inline).
            item = q.popleft()
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
    timeout: float = CONNECT_TIMEOUT,
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
        timeout: the longest the connection (dial, TLS) and the broker's WELCOME may
            take together (:data:`~msgq_trio.client.lifecycle.CONNECT_TIMEOUT`, 30 s).
        reconnect: off by default; True or a :class:`~msgq_trio.client.reconnect.Reconnect`
            reconnects after a loss as the trio client's ``connect`` does (README
            "Reconnecting"). Only the first connection's failure is raised here.

    Resource handling: see :class:`AioBus`.

    Raises:
        ConnectError: no broker at the address, TLS failed, it refused the handshake
            (``code``), or there was no WELCOME within ``timeout`` s.
        UsageError: a malformed ``tcp://``/``tls://`` address, a TLS file from the
            environment that cannot be loaded (named), or a bad ``timeout``.
    """
    bus = AioBus(
        client_name(name),
        max_frame_size,
        connect_target(socket),
        reconnect_policy(reconnect),
        connect_timeout(timeout),
    )
    loop = asyncio.get_running_loop()
    started: asyncio.Future[None] = loop.create_future()
    bus._dial_with(ssl_context, server_hostname, send_buffer, token)
    runner = loop.create_task(bus._supervise(lambda: started.set_result(None)))
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
