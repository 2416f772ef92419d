"""The trio client: ``connect()`` yields a :class:`Bus` for messages, RPC and notifications.

One connection = one nursery holding a reader task, a writer task and a task per incoming
request to an async handler (plain-function handlers are answered by the reader). The
writer joins every queued frame into one ``send_all`` (one trio call per batch, not per
frame); ``send`` only queues and waits when the queue is over its bound.
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from ..errors import ConnectError, ConnectionLost, UsageError
from ..protocol.framing import DEFAULT_MAX_FRAME_SIZE, Frame, ready
from ..transport.errors import translate_socket_errors
from ..transport.fdpass import RECEIVE_SIZE, SEND_BUFFER
from ..transport.sockets import (
    NO_JOIN,
    set_send_buffer,
    unconsumed_bytes,
)
from .address import client_name, connect_target, hello_extra
from .lifecycle import CONNECT_TIMEOUT, connect_timeout
from .message import Buffer, Member, Message, Reply, Result, new_message
from .polling import BUSY_POLL, check_busy_poll
from .reconnect import Reconnect, reconnect_policy
from .session import (
    CLOSE_WAIT,
    IN_HIGH_WATER,
)
from .trio_streams import OUT_HIGH_WATER, TrioStreams
from .trio_transport import open_transport

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


#: Iteration yields to other tasks at least once every this many messages (a power
#: of two: the count is ``Bus._in_popped``'s low bits).
_FAIRNESS = 256


class Bus(TrioStreams):
    """A connection to the broker. Create it with :func:`connect`.

    The trio driver of the client :class:`~msgq_trio.client.session.Session`: its
    connections one after another as the session's lifecycle says, handler tasks and
    waiting are here, the socket's reader and writer, backpressure and descriptor
    passing in :class:`~msgq_trio.client.trio_streams.TrioStreams`; what frames mean and
    what to answer is the session's, and the API's shape is
    :class:`~msgq_trio.client.async_bus.AsyncBus`'s.
    """

    #: Messages iteration and receive have taken, for the fairness checkpoint.
    _in_popped: int = 0

    # -- lifecycle ---------------------------------------------------------------------
    async def _handshake(self, hello_fields: dict[str, object]) -> None:
        """Send HELLO and take WELCOME (see ``_take_welcome``).

        Raises:
            ConnectError: the broker refused (``code``), closed, broke the protocol, or
                the socket failed.
        """
        hello = self._s.hello(hello_fields)
        unsent: trio.BrokenResourceError | None = None
        try:
            with translate_socket_errors():
                try:
                    await self._stream.send_all(b"".join(hello))
                except trio.BrokenResourceError as exc:
                    # The broker may have refused us and closed before our HELLO was all
                    # written (its lingering close is bounded): its ERROR still waits in
                    # our receive buffer, and it says why better than EPIPE does.
                    unsent = exc
                while not self._take_welcome(await self._stream.receive_some(RECEIVE_SIZE)):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ConnectError(f"connection to the broker failed: {unsent or exc}") from exc

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

    async def _run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The bus's connections (:meth:`~msgq_trio.client.async_driver.AsyncDriver.
        _supervise`), ``task_status.started()`` once the first is up."""
        await self._supervise(task_status.started)

    async def _connection(self, deadline: float | None, started: Callable[[], None]) -> None:
        """One connection: dial, handshake by ``deadline``, serve (see
        :meth:`~msgq_trio.client.async_driver.AsyncDriver._connection`)."""
        life = self._s.life
        with trio.CancelScope(deadline=math.inf if deadline is None else deadline) as attempt:
            async with open_transport(self._target, self._ssl_context, self._server_hostname) as (
                stream,
                remote,
            ):
                if not remote:  # TCP keeps the kernel's send buffer autotuning
                    set_send_buffer(stream.socket, self._send_buffer)
                self._attach(stream)
                try:
                    await self._handshake(hello_extra(remote, self._token))
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
                attempt.deadline = math.inf
                restoring = self._welcomed(remote)
                await self._serve_connection(stream, remote, started, restoring)
        if attempt.cancelled_caught:
            raise life.timed_out()

    async def _serve_connection(
        self,
        stream: trio.SocketStream,
        remote: bool,
        started: Callable[[], None],
        restoring: bool,
    ) -> None:
        """Run the connection's reader, writer (and heartbeat) until it ends, then close
        it. The first connection reports ``started()``; a reconnect's joins
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
                started()
            await self._down.wait()
            tasks.cancel_scope.cancel()
        await trio.aclose_forcefully(stream)

    # -- sending -----------------------------------------------------------------------

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
        self._in_popped += 1
        if self._reader_parked:  # only when _in_full()
            self._reader_parked = False
            self._in_taken.unpark_all()
        # A full checkpoint every _FAIRNESS messages keeps iteration cancellable and lets
        # other tasks run; one per message would cost more than the message itself.
        if not self._in_popped & (_FAIRNESS - 1):
            await trio.lowlevel.checkpoint()
        return msg


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
    timeout: float = CONNECT_TIMEOUT,
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
        timeout: the longest the connection (dial, TLS) and the broker's WELCOME may
            take together (:data:`~msgq_trio.client.lifecycle.CONNECT_TIMEOUT`, 30 s); a
            reconnect attempt is bounded by ``Reconnect.attempt_timeout`` instead.

    Resource handling: leaving the block flushes queued frames, says GOODBYE, waits for
    the broker's (CLOSE_WAIT s, longer while the broker still takes our bytes: it may be
    pausing our reads for backpressure; see ``close_patience``), closes the socket and
    cancels handler tasks (and a reconnect under way); pending calls fail with
    ConnectionLost; descriptors that came with messages nobody took are closed.

    Raises:
        ConnectError: no broker at the address, TLS failed, it refused the handshake
            (``code`` ``version-mismatch``, ``limit-exceeded``, ``unauthenticated``...),
            or there was no WELCOME within ``timeout`` s.
        UsageError: a malformed ``tcp://``/``tls://`` address, a TLS file named by the
            environment that cannot be loaded, a bad ``reconnect`` or ``timeout``.
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
        connect_timeout=connect_timeout(timeout),
    )
    body_error: Exception | None = None
    async with trio.open_nursery() as nursery:
        bus._nursery = nursery
        try:
            bus._dial_with(ssl_context, server_hostname, send_buffer, token)
            await nursery.start(bus._run)
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
