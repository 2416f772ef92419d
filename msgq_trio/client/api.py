"""The client API shared by the trio :class:`~msgq_trio.Bus` and the asyncio
:class:`~msgq_trio.aio.AioBus`: one :class:`BusBase` with the public methods, their
argument handling and their docstrings, over a few primitives each driver provides.

What a frame means and what to answer is the :class:`~msgq_trio.client.session.Session`'s;
what the API does with it (a call's result, the callback registries, the end of
iteration, the heartbeat decision, how long closing waits) is here, once; sockets,
tasks, clocks and waiting are the drivers'. It imports neither trio nor asyncio
(``tests/test_layering.py``), so the asyncio driver can use it.

The primitives a driver implements (see each one's docstring below): ``_queue_request``,
``_wait_out``, ``_finish_call``, ``_wait_done``, ``_queue``, ``_queue_answer``,
``_checkpoint``, ``_task``, ``_now``, ``_unsent``, ``_wait_goodbye``,
``_state_changed`` and ``_call_started`` (and, for reconnect, a supervisor that calls
``_ended_connection``, ``_restore`` and ``_gave_up``); the public ``send`` and the
event-loop services the plugin clients build on (``sleep``, ``checkpoint``,
``new_event``, ``shielded``); and the attributes ``_s`` (the session), ``_closed``,
``_lost_event`` (an event with ``set()`` and ``async wait()``), ``_new_waiter`` and
``_in`` (filled through :meth:`BusBase._in_put`). The plugin clients
(client/queue.py, client/pipe_core.py) use this public API only, so they run on either
driver. The blocking ``DirectBus`` shares :class:`SessionView` only: it has no tasks to
run callbacks in.
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..config import default_socket_path
from ..errors import ConnectError, ConnectionLost, MsgqError, UsageError
from ..protocol.codes import ErrorCode
from ..protocol.connection import EOF, NEED_DATA
from ..protocol.errors import LocalProtocolError, ProtocolError
from ..protocol.framing import Frame, close_fds
from .message import Buffer, Member, Message, Result, new_message
from .session import (
    CLOSE_WAIT,
    IN_HIGH_COUNT,
    IN_HIGH_WATER,
    PendingCall,
    Session,
    as_handler,
    never_suspends,
)

if TYPE_CHECKING:  # imported lazily at run time: client/queue.py imports this module
    from .queue import Queue

__all__ = [
    "BusBase",
    "Handler",
    "HeartbeatMonitor",
    "SessionView",
    "client_name",
    "connect_target",
    "hello_extra",
    "parse_address",
    "run_callback",
]

log = logging.getLogger("msgq_trio.client")

_SHUTDOWN = str(ErrorCode.BROKER_SHUTDOWN)

#: A command handler as registered: ``fn(params)`` or ``fn(params, request)``, a plain
#: function or an ``async def``.
Handler = Callable[..., Any]


class _Event(Protocol):
    """trio.Event or asyncio.Event: what the API needs of the driver's "lost" event."""

    def set(self) -> None: ...

    async def wait(self) -> Any: ...


def parse_address(address: str) -> tuple[str, str, int]:
    """``tcp://HOST:PORT`` / ``tls://HOST:PORT`` -> (scheme, host, port).

    Raises:
        UsageError: not such a URL (the caller's address is malformed).
    """
    scheme, _, rest = address.partition("://")
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if scheme not in ("tcp", "tls") or not sep or not host or not port.isdigit():
        raise UsageError(f"bus address {address!r} must be tcp://HOST:PORT or tls://HOST:PORT")
    return scheme, host, int(port)


def connect_target(socket: str | os.PathLike[str] | None) -> str:
    """The address ``connect()`` dials: ``socket``, else ``$MSGQ_TRIO_SOCKET`` (a path or
    a ``tcp://``/``tls://`` URL), else the per-user path
    (:func:`msgq_trio.config.default_socket_path`)."""
    if socket is not None:
        return os.fspath(socket)
    return os.environ.get("MSGQ_TRIO_SOCKET", "") or str(default_socket_path())


def client_name(name: str | None) -> str:
    """The name sent in HELLO: ``name``, else the program's file name."""
    return name or Path(sys.argv[0] or "client").name


def hello_extra(remote: bool, token: str | None) -> dict[str, object]:
    """HELLO's fields beyond the name: over TCP the credential (``token``, else
    ``$MSGQ_TRIO_TOKEN``); nothing on a Unix socket (the kernel vouches for the peer)."""
    hello: dict[str, object] = {}
    if remote:
        tok = token if token is not None else os.environ.get("MSGQ_TRIO_TOKEN")
        if tok:
            hello["token"] = tok
    return hello


async def run_callback(cb: Callable[..., Any], *args: Any) -> None:
    """Run a user callback (a plain function or an ``async def``); what it raises is
    logged: nobody else would see it."""
    try:
        r = cb(*args)
        if inspect.isawaitable(r):
            await r
    except Exception:
        log.exception("callback %r raised", cb)


class HeartbeatMonitor:
    """The heartbeat decision of a TCP connection, one call per interval: a silent
    broker (a dead host or path sends no FIN or RST) is declared lost after ``misses``
    intervals in which nothing arrived. Intervals in which the driver's reader is paused
    (the application is not consuming, so nothing can arrive) do not count."""

    def __init__(self, interval: float, misses: int) -> None:
        self.interval = interval
        self.misses = misses
        self._last = -1
        self._missed = 0

    def tick(self, received_bytes: int, paused: bool) -> ConnectionLost | None:
        """One interval passed. Returns None while the broker is alive (the driver then
        pings if :attr:`silent`), or the :class:`ConnectionLost` (code
        ``heartbeat-timeout``) to fail the connection with."""
        if received_bytes != self._last or paused:
            self._last, self._missed = received_bytes, 0
            return None
        self._missed += 1
        if self._missed < self.misses:
            return None
        log.error(
            "the broker sent nothing for %d heartbeat intervals of %s s: connection lost",
            self._missed,
            self.interval,
        )
        return ConnectionLost(
            f"the broker sent nothing for {self._missed * self.interval:g} s (heartbeat)",
            code=str(ErrorCode.HEARTBEAT_TIMEOUT),
        )

    @property
    def silent(self) -> bool:
        """Whether the last interval brought nothing (ask the broker ``ping``: its answer,
        or any traffic, proves it alive)."""
        return self._missed > 0


class SessionView:
    """The connection's identity, read from the session: shared by every driver (the
    blocking ``DirectBus`` too)."""

    _s: Session

    @property
    def name(self) -> str:
        """The client name sent in HELLO."""
        return self._s.name

    @property
    def lname(self) -> str:
        """This connection's unique address, assigned by the broker (``l.N``)."""
        return self._s.lname

    @property
    def broker_version(self) -> str:
        """The broker's version from WELCOME."""
        return self._s.broker_version

    @property
    def session(self) -> Session:
        """The sans-I/O protocol state under this driver (for plugin clients and tests)."""
        return self._s


class BusBase(SessionView):
    """The public API of the asynchronous clients (see :class:`~msgq_trio.Bus` and
    :class:`~msgq_trio.aio.AioBus`); not instantiated on its own."""

    _closed: bool
    _lost_event: _Event
    _notify_cbs: dict[str, list[Callable[[Message], Any]]]
    _notify_inline: dict[str, Callable[[Message], None]]
    _message_inline: Callable[[Message], None] | None
    #: Received messages the application has not taken yet, and their frames' bytes.
    #: A plain MESSAGE waits as its Frame and becomes a Message when taken
    #: (:meth:`_take`): a burst of one receive is thousands of messages, and as Message
    #: objects they would all be alive at once for the cyclic garbage collector to walk
    #: and promote to older generations (frames from the compiled scanner are not
    #: tracked by it).
    _in: collections.deque[Message | Frame]
    #: The bytes of ``_in``, counted by batch: the reader puts a receive's messages in
    #: with one :meth:`_in_put`, and their bytes leave when the last of them is taken
    #: (:meth:`_in_held`). Taking a message is then one counter's increment
    #: (``_in_popped``, which the trio driver's fairness also counts on) instead of two
    #: lengths per message; the bound is over by at most one batch (a receive's worth,
    #: or one large frame), and exact when ``_in`` is empty.
    _in_bytes: int
    _in_marks: collections.deque[tuple[int, int]]  # (``_in_count`` after a batch, its bytes)
    _in_count: int  # entries ever put in ``_in``
    _in_popped: int  # entries ever taken from ``_in`` (or dropped)

    #: The address dialled (the session's lifecycle holds the reconnect policy).
    _target: str
    _reconnected_cbs: list[Callable[[], Any]]
    #: Whether a connection is up, and the event set when it ends (the driver's).
    _up: bool
    _down: _Event

    def _init_api(self, target: str = "") -> None:
        """The registries of the API (called by the driver's ``__init__``)."""
        self._in_bytes = 0
        self._in_marks = collections.deque()
        self._in_count = self._in_popped = 0
        self._notify_cbs = {}
        self._notify_inline = {}
        self._message_inline = None
        self._target = target
        self._reconnected_cbs = []

    #: Makes a pending call's waiter (trio.Event, an asyncio future), which the
    #: session's ``wake`` sets; the driver's ``_finish_call`` waits on it.
    _new_waiter: Callable[[], Any]

    # -- primitives the driver provides ----------------------------------------------
    def _queue_request(self, pieces: list[Buffer], fds: Sequence[int]) -> None:
        """Queue a request's pieces (``fds``: the descriptors it carries); latency
        matters, so a driver may write it at once."""
        raise NotImplementedError

    async def _wait_out(self) -> None:
        """Wait while more than the driver's ``OUT_HIGH_WATER`` bytes are queued.

        Raises:
            ConnectionLost: the connection ended meanwhile.
        """
        raise NotImplementedError

    async def _finish_call(self, call: PendingCall) -> None:
        """Wait for ``call``'s outcome (or its local deadline), then forget its slot."""
        raise NotImplementedError

    def _queue(self, pieces: list[Buffer]) -> None:
        """Queue a frame's pieces for the socket."""
        raise NotImplementedError

    def _queue_answer(self, pieces: list[Buffer]) -> None:
        """Queue an answer while the connection is up; otherwise drop it and close the
        descriptors it would have carried."""
        raise NotImplementedError

    async def _checkpoint(self) -> None:
        """The driver's scheduling point after queueing a notification (may be none)."""

    def _task(self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
        """Run ``fn(*args)`` in a task of this bus (cancelled when it closes)."""
        raise NotImplementedError

    def _now(self) -> float:
        """The driver's clock (the one call deadlines are on)."""
        raise NotImplementedError

    def _unsent(self) -> int:
        """Bytes queued or written but not yet taken by the broker."""
        raise NotImplementedError

    async def _wait_goodbye(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the broker's GOODBYE (or EOF); whether it came."""
        raise NotImplementedError

    def _take(self, item: Message | Frame) -> Message:
        """The Message of an ``_in`` entry just popped (counted in ``_in_popped``)."""
        self._in_popped += 1
        if isinstance(item, Message):
            return item
        return new_message(item, self._s.sources)

    def _in_put(self, entries: int, nbytes: int) -> None:
        """``entries`` were just appended to ``_in``, ``nbytes`` in all: one batch."""
        count = self._in_count + entries
        self._in_count = count
        self._in_bytes += nbytes
        self._in_marks.append((count, nbytes))

    def _in_held(self) -> int:
        """The bytes of ``_in`` against ``IN_HIGH_WATER``: every batch not yet taken
        to its last message (so at most one batch more than exact; 0 when empty)."""
        marks, popped = self._in_marks, self._in_popped
        while marks and marks[0][0] <= popped:
            self._in_bytes -= marks.popleft()[1]
        return self._in_bytes

    def _drop_in(self) -> None:
        """Close every message nobody took (their descriptors are ours to close)."""
        for item in self._in:
            if isinstance(item, Message):
                item.close()
            else:
                close_fds(item.fds)
        self._in.clear()
        self._in_marks.clear()
        self._in_bytes = 0
        self._in_popped = self._in_count

    def _in_full(self) -> bool:
        """Over ``IN_HIGH_WATER`` bytes, or ``IN_HIGH_COUNT`` messages while none of our
        calls waits for its answer, wait for the application: the driver reads no more
        until it takes some (backpressure to the broker, never loss). The count does not
        apply while a call is pending: its answer may be behind the messages, and a
        caller that takes its messages after the answer would wait for ever."""
        return self._in_held() > IN_HIGH_WATER or (
            len(self._in) > IN_HIGH_COUNT and not self._s.calls
        )

    def _call_started(self) -> None:
        """A call was queued: a driver whose reader paused on ``IN_HIGH_COUNT`` reads
        again (see :meth:`_in_full`)."""
        raise NotImplementedError

    async def _wait_done(self, call: PendingCall) -> None:
        """Wait until the session woke ``call`` (its ``waiter``); cancel-safe: the waiter
        stays usable to be waited for again."""
        raise NotImplementedError

    # -- what plugin clients build on (client/queue.py, client/pipe_core.py) -----------
    # The event-loop services a plugin client needs, so that its protocol logic is
    # written once for every asynchronous driver: a clock, sleeping, scheduling points,
    # events, background tasks and cleanup that outlives the caller's cancellation.
    def current_time(self) -> float:
        """The driver's clock in seconds (trio's ``current_time``, the asyncio loop's
        ``time()``): the one call deadlines are on."""
        return self._now()

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` on the driver's event loop."""
        raise NotImplementedError

    async def checkpoint(self) -> None:
        """A scheduling point: other tasks run, and a cancelled caller is cancelled
        here (for plugin clients that must stay fair and cancellable in a loop that
        otherwise never waits)."""
        raise NotImplementedError

    def new_event(self) -> Any:
        """A new event of the driver's event loop (``trio.Event`` / ``asyncio.Event``):
        ``set()``, ``is_set()``, ``await wait()``."""
        raise NotImplementedError

    async def shielded(
        self, fn: Callable[[], Coroutine[Any, Any, None]], timeout: float | None = None
    ) -> None:
        """Run ``fn()`` to its end even if the caller is cancelled meanwhile (cleanup
        that must reach the broker: a consumer's last acks, a handle's close), giving it
        up after ``timeout`` s (None: no limit). ``fn`` must catch its own errors:
        under asyncio a cancelled caller returns at once while ``fn`` finishes in a
        task of this bus, where nobody would see them.

        Raises:
            The caller's cancellation, once ``fn`` is done (trio) or at once (asyncio).
        """
        raise NotImplementedError

    def start_soon(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``fn()`` in a task of this bus: it is cancelled when the bus closes (for
        plugin clients' background work: acks, watchers).

        Raises:
            UsageError: the bus is not running (closed, or not yet started).
        """
        self._task(fn)

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
        call = self._start_call(
            target, command, params, timeout, attachments, False, on_behalf_of=on_behalf_of
        )

        async def wait() -> Any:
            await self._finish_call(call)
            if call.error is not None:
                raise call.error
            if call.frame is not None and call.frame.fds:
                close_fds(call.frame.fds)
            return call.result

        return wait

    def start_request(
        self,
        target: str,
        command: str,
        params: Any = None,
        *,
        attachments: Sequence[Buffer] = (),
    ) -> PendingCall:
        """Send a request now and return its :class:`~msgq_trio.client.session.PendingCall`
        (for plugin clients that keep several in flight and wait for them in order, the
        pipe client). Wait with :meth:`wait_call`; then read ``error``, ``result`` and
        ``frame`` (whose descriptors the caller owns); :meth:`forget_call` frees the slot.

        Raises:
            UsageError, ConnectionLost: as :meth:`call`, before anything is sent.
        """
        return self._start_call(target, command, params, None, attachments, False)

    async def wait_call(self, call: PendingCall) -> None:
        """Wait until ``call`` (from :meth:`start_request`) is done. Cancel-safe: the call
        stays in flight and registered, to be waited for again."""
        await self._wait_done(call)

    def forget_call(self, call: PendingCall) -> None:
        """Free ``call``'s slot: an answer still to come is dropped."""
        self._s.finish(call)

    # -- durable queues (plugins/queue, docs/QUEUE.md) ----------------------------------
    def queue(self, name: str, *, producer: str | None = None) -> Queue:
        """A handle on the durable queue ``name`` of the queue plugin (docs/QUEUE.md).

        ``producer`` names this producer for deduplication; give a stable name to resend
        after a crash without duplicates, default a fresh random one per handle.
        Returns a :class:`msgq_trio.client.queue.Queue` (one implementation for every
        asynchronous driver).
        """
        from .queue import Queue

        return Queue(self, name, producer=producer)

    # -- state ---------------------------------------------------------------------------
    @property
    def limits(self) -> dict[str, object]:
        """The broker's limits from WELCOME (``max_frame_size``, ``request_timeout``,
        ``max_pending_requests``, ...; docs/PROTOCOL.md), empty before the handshake or
        from a broker that sent none."""
        return self._s.limits

    @property
    def lost(self) -> ConnectionLost | None:
        """None while the connection is up; once it ended (the broker dropped us or shut
        down, the socket broke, or the bus was closed), the :class:`ConnectionLost` that
        calls raise, whose ``code`` says why (with ``reconnect``, while reconnecting: the
        loss's, its message saying that the client is reconnecting; after giving up:
        ``reconnect-gave-up``). For a component that only sends and would
        not otherwise notice that the broker refused its last message."""
        return self._s.lost

    async def wait_lost(self) -> ConnectionLost:
        """Wait until the connection ends for good; returns :attr:`lost` (for a plugin
        client whose iteration must end with the connection). With ``reconnect`` that is
        when the bus is closed or gave up reconnecting, not at each loss."""
        await self._lost_event.wait()
        lost = self._s.lost
        assert lost is not None
        return lost

    def _check_open(self) -> None:
        if self._s.lost is not None:
            raise self._s.lost
        if self._closed:
            raise UsageError("the bus is closed")

    # -- reconnect (connect(..., reconnect=...); client/reconnect.py) ---------------------
    @property
    def connected(self) -> bool:
        """Whether the bus is connected (after a reconnect: once the groups it had
        joined are joined again)."""
        return self._s.life.connected and self._s.lost is None and not self._closed

    @property
    def reconnects(self) -> int:
        """How many times this bus reconnected (``connect(..., reconnect=...)``)."""
        return self._s.life.reconnects

    def on_reconnected(self, callback: Callable[[], Any]) -> None:
        """Run ``callback()`` (a plain function or an ``async def``) in a task of this
        bus after each reconnect, once the groups it had joined are joined again: for
        state the broker keeps per connection that the bus cannot restore by itself (the
        queue client consumes again). What it raises is logged."""
        self._reconnected_cbs.append(callback)

    def _final(self) -> bool:
        """Whether the connection ended for good (no reconnect under way)."""
        return self._s.lost is not None and not self._s.life.reconnecting

    def _fresh_session(self) -> None:
        """Before a reconnect's HELLO: the session starts over (a fresh codec and
        identity; handlers and joined groups stay) but stays down until WELCOME, so that
        nothing is sent before HELLO. Nothing to do for the first connection."""
        s = self._s
        if s.generation or s.lname:
            lost = s.lost
            s.reset()
            s.lost = lost

    def _connection_failed(self, exc: ConnectionLost) -> None:
        """The state change of a driver's ``_fail_all``: the session fails every pending
        call with ``exc`` (the first reason stays once the connection is down) and its
        lifecycle decides what follows; unless a reconnect follows, the bus is lost for
        good (``_lost_event``). The driver then wakes its own waiters."""
        s = self._s
        if self._up:
            self._up = False
            if s.connection_lost(exc, self._now()):
                self._lost_event.set()
            self._down.set()
        else:
            s.fail(exc)
            if s.life.final:
                self._lost_event.set()

    def _closing(self) -> None:
        """The application closes the bus: no reconnect follows (an attempt under way
        or scheduled is given up)."""
        self._closed = True
        self._s.life.close()

    def _attempt_failed(self, exc: BaseException) -> bool:
        """A reconnect attempt failed: True once the policy gave up (the loss is final:
        whoever waits for the connection wakes to see it)."""
        if not self._s.attempt_failed(exc, self._now()):
            return False
        self._lost_event.set()
        self._state_changed()
        return True

    async def _restore(self) -> None:
        """After a reconnect: join the groups again (the session's restore policy:
        :meth:`~msgq_trio.client.session.Session.restore_groups`), then mark the bus
        connected and run the :meth:`on_reconnected` callbacks. If the new connection is
        lost meanwhile, the supervisor goes on reconnecting."""
        s = self._s
        try:
            for group in s.restore_groups():
                try:
                    await self.call("msgq", "subscribe", {"group": group})
                except ConnectionLost:
                    raise
                except MsgqError as exc:
                    s.restore_refused(group, exc)
        except ConnectionLost:
            return
        s.restored()
        self._state_changed()
        for cb in list(self._reconnected_cbs):
            self._task(run_callback, cb)

    def _state_changed(self) -> None:
        """Wake whoever waits for the connection's state (``wait_connected``, the
        iteration)."""
        raise NotImplementedError

    def _take_welcome(self, data: bytes) -> bool:
        """Feed bytes received during the handshake to the codec; True once WELCOME was
        taken (frames right behind it stay in the codec for the driver's reader).

        Raises:
            ConnectError: the broker refused (``code``), closed, or broke the protocol.
        """
        conn = self._s.conn
        try:
            conn.receive_data(data)
            ev = conn.next_event()
            if ev is EOF:
                raise ConnectError("broker closed the connection during the handshake")
            if ev is NEED_DATA:
                return False
            assert isinstance(ev, Frame)
            self._s.receive_welcome(ev)
        except ProtocolError as exc:
            raise ConnectError(f"broker violated the protocol in the handshake: {exc}") from exc
        return True

    async def _say_goodbye(self) -> None:
        """Queue GOODBYE and wait for the broker's, unless the connection ended already.

        The wait ends after CLOSE_WAIT s, or while bytes we sent are still unread by the
        broker, after :func:`~msgq_trio.client.session.close_patience` s in which it took
        none of them (it may be pausing our reads for backpressure: what it has not read
        when the socket closes is lost; it logs and counts that)."""
        s = self._s
        if s.lost is not None:
            return
        try:
            self._queue(s.goodbye())
        except LocalProtocolError:
            pass
        left, since = self._unsent(), self._now()
        while s.lost is None:
            if await self._wait_goodbye(CLOSE_WAIT):
                break
            before, left = left, self._unsent()
            if not left:
                break
            if left < before:
                since = self._now()  # the broker is still reading us
            elif self._now() - since >= s.close_patience:
                break

    # -- sending -----------------------------------------------------------------------
    #: ``send(target, body, attachments, *, header, fds, on_behalf_of)``: the driver's
    #: (its backpressure and writing are its own); see :meth:`msgq_trio.Bus.send`.
    send: Callable[..., Awaitable[None]]

    async def send_many(self, target: str, bodies: Iterable[Any]) -> None:
        """Send one one-way message per body to ``target``, in order, as :meth:`send`
        would one by one (no attachments, descriptors or header): for a program that
        has many messages at hand, without a call, an encoder call and a queue append
        per message. Every body is encoded before anything is queued, so a body that
        cannot be encoded sends none of them. Waits, like ``send``, while more than
        ``OUT_HIGH_WATER`` bytes are queued; a scheduling point once per call.

        Raises:
            UsageError: the bus is closed, or a body cannot be encoded (named by its
                index in the error; nothing was sent).
            ConnectionLost: the broker went away.
        """
        self._check_open()
        self._queue(self._s.encode_messages(target, bodies))
        await self._wait_out()
        await self._checkpoint()

    async def notify(self, group: str, event: str, params: Any = None) -> None:
        """Publish notification ``event`` to ``group``; notifications are never answered.

        Raises:
            UsageError: ``params`` cannot be encoded, or the bus is closed.
            ConnectionLost: the broker went away.
        """
        self._check_open()
        self._queue(self._s.encode_notify(group, event, params))
        await self._wait_out()
        await self._checkpoint()

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
    ) -> PendingCall:
        """Start a call in the session (its local deadline on the driver's clock), give
        it a waiter and queue its request.

        Raises:
            UsageError, ConnectionLost: as :meth:`call`, before anything is sent.
        """
        self._check_open()
        call, pieces = self._s.start_call(
            target,
            command,
            params,
            now=self._now() if timeout is not None else 0.0,
            timeout=timeout,
            attachments=attachments,
            multi=multi,
            fds=fds,
            on_behalf_of=on_behalf_of,
        )
        call.waiter = self._new_waiter()
        self._queue_request(pieces, fds)
        self._call_started()
        return call

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
        black-holes the request; ``timeout`` shortens that deadline for this call (the
        client gives up by itself ``LOCAL_GRACE`` s after it if even the broker is
        silent). Descriptors in the answer are closed (:meth:`request` hands them out).

        Raises:
            NoRecipient, RecipientGone, RequestTimeout, ReceiverFull, MultipleRecipients,
            LimitExceeded: the broker's answers. RemoteError: the handler failed
            (``.code``, ``.message``, ``.data``). UsageError: a bad argument or a closed
            bus. ConnectionLost: the broker went away.
        """
        call = self._start_call(target, command, params, timeout, attachments, False, fds)
        await self._wait_out()
        await self._finish_call(call)
        return self._s.call_result(call, command)

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
        call = self._start_call(target, command, params, timeout, attachments, False, fds)
        await self._wait_out()
        await self._finish_call(call)
        if call.error is not None:
            raise call.error
        assert call.frame is not None
        answer = Message(call.frame, self._s.sources)
        answer._body, answer._decoded = call.result, True  # decoded once, by the call
        return answer

    async def call_all(
        self, group: str, command: str, params: Any = None, *, timeout: float | None = None
    ) -> list[Result]:
        """Call ``command`` on every member of ``group`` (except this client).

        Returns one :class:`Result` per member, in join order of the members the broker
        routed to; a member that fails or leaves yields an error Result.

        Raises:
            NoRecipient: the group is empty. ConnectionLost: the broker went away.
        """
        call = self._start_call(group, command, params, timeout, (), True)
        await self._wait_out()
        await self._finish_call(call)
        return call.member_results()

    async def call_many(
        self,
        requests: Iterable[tuple[str, str] | tuple[str, str, Any]],
        *,
        timeout: float | None = None,
    ) -> list[Result]:
        """Issue many calls at once; returns each result or error, in request order.

        Raises:
            UsageError, ConnectionLost: as :meth:`call`, before anything is sent (calls
                already started then go on, their answers dropped).
        """
        reqs = [(r[0], r[1], r[2] if len(r) > 2 else None) for r in requests]
        started = []
        try:
            for target, command, params in reqs:
                started.append(self._start_call(target, command, params, timeout, (), False))
        except BaseException:
            for call in started:
                self._s.finish(call)
            raise
        await self._wait_out()
        results: list[Result] = []
        for call, (target, _c, _p) in zip(started, reqs, strict=True):
            await self._finish_call(call)
            if call.frame is not None and call.frame.fds:
                close_fds(call.frame.fds)  # as call() does: only request() hands them out
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
        """Start a call now; later run ``callback(ok, result_or_error)`` (a plain
        function or an ``async def``) in a task of this bus; what it raises is logged.

        Raises:
            UsageError, ConnectionLost: as :meth:`call`, before anything is sent.
        """
        call = self._start_call(target, command, params, timeout, (), False)
        self._task(self._call_cb_finish, call, callback)

    async def _call_cb_finish(
        self, call: PendingCall, callback: Callable[[bool, Any], Any]
    ) -> None:
        await self._finish_call(call)
        ok = call.error is None
        if ok and call.frame is not None and call.frame.fds:
            close_fds(call.frame.fds)
        await run_callback(callback, ok, call.result if ok else call.error)

    def call_many_cb(
        self,
        requests: Iterable[tuple[str, str] | tuple[str, str, Any]],
        callback: Callable[[list[Result]], Any],
        *,
        timeout: float | None = None,
    ) -> None:
        """Start many calls; run ``callback(results)`` once all are done (see
        :meth:`call_many` and :meth:`call_cb`). If they cannot be started (a bad
        argument, the connection lost), every Result carries that error."""
        self._task(self._call_many_cb_finish, list(requests), callback, timeout)

    async def _call_many_cb_finish(
        self,
        reqs: list[tuple[str, str] | tuple[str, str, Any]],
        callback: Callable[[list[Result]], Any],
        timeout: float | None,
    ) -> None:
        try:
            results = await self.call_many(reqs, timeout=timeout)
        except (UsageError, ConnectionLost) as exc:
            results = [Result(r[0], False, None, exc) for r in reqs]
        await run_callback(callback, results)

    # -- serving commands ----------------------------------------------------------------
    def command(self, name: str) -> Callable[[Handler], Handler]:
        """Decorator: register ``fn`` to answer requests for ``name``.

        ``fn(params)`` or ``fn(params, request)``, a plain function or an ``async def``.
        A plain function is called by the reader as the request arrives, without a task
        (it must not block: it would block the whole event loop in a task too); an
        ``async def`` runs in a task of its own per request. What the result or
        exception answers is the one handler contract of every driver
        (:meth:`msgq_trio.client.session.Session.answer_for`): the return value (or a
        :class:`Reply`) is the answer; ``CommandFailed(code, message, data)`` answers
        with that error; ``TypeError``/``ValueError``/``KeyError`` and a malformed
        request answer ``bad-request``; any other exception ``internal-error`` naming
        its type.

        Raises:
            UsageError: ``fn`` takes neither (params) nor (params, request).
        """

        def register(fn: Handler) -> Handler:
            self.add_command(name, fn)
            return fn

        return register

    def add_command(self, name: str, fn: Handler) -> None:
        """Register ``fn`` for ``name`` (see :meth:`command`).

        Raises:
            UsageError: ``fn`` takes neither (params) nor (params, request).
        """
        self._s.commands[name] = as_handler(fn)

    def add_inline_command(self, name: str, fn: Callable[[Message], None]) -> None:
        """Register ``fn(request)`` for command ``name``, called synchronously by the reader
        in the order requests arrive, without a task. ``fn`` must not block; it answers
        later (or at once) with :meth:`answer` or :meth:`answer_error`, exactly once.

        For plugins that must see requests in order (the queue's puts: deduplication by
        increasing sequence numbers) or cannot afford a task per request. An exception
        from ``fn`` answers ``internal-error`` and is logged.
        """
        self._s.inline[name] = fn

    def set_default_handler(self, fn: Handler | None) -> None:
        """Handle requests for commands that have no handler with ``fn(params, request)``
        instead of answering ``unknown-command`` (a bound queue takes any command); None
        restores that.

        Raises:
            UsageError: ``fn`` does not take (params, request).
        """
        if fn is not None and len(inspect.signature(fn).parameters) != 2:
            raise UsageError("a default handler takes (params, request)")
        self._s.default_handler = fn

    def answer(
        self, request: Message, result: Any = None, *, attachments: Sequence[Buffer] = ()
    ) -> None:
        """Answer ``request`` (received by an inline handler) with ``result`` and
        optional binary ``attachments`` (the pipe plugin's read answers). A request
        whose caller is gone is answered anyway; the broker discards it.

        Raises:
            UsageError: ``result`` cannot be encoded (nothing was sent).
        """
        self._queue_answer(self._s.encode_answer(request, result, attachments))

    def answer_error(self, request: Message, code: str, message: str, data: object = None) -> None:
        """Answer ``request`` (received by an inline handler) with an ERROR ``code``.

        Raises:
            UsageError: ``data`` cannot be encoded (nothing was sent).
        """
        self._queue_answer(self._s.encode_error(request, code, message, data))

    def _start_request(self, msg: Message, handler: Handler) -> None:
        """Run ``handler`` for a request, in the reader: a plain function is answered
        right here, without a task per request (a task costs more than a small handler),
        and so is an ``async`` one whose code has no ``await`` (it cannot suspend:
        :func:`~msgq_trio.client.session.never_suspends`); any other ``async`` one
        returns an awaitable, which a task of its own awaits."""
        try:
            result = handler(msg.body, msg)
        except Exception as exc:
            self._finish_request(msg, None, exc)
            return
        except BaseException:
            msg.close()
            raise
        if never_suspends(result):
            # An async handler without an await: its answer is ready on the first
            # step, here in the reader, without a task and a scheduler pass for it.
            try:
                result.send(None)
            except StopIteration as done:
                self._finish_request(msg, done.value, None)
            except Exception as exc:
                self._finish_request(msg, None, exc)
            except BaseException:
                msg.close()
                raise
            else:  # cannot happen (no await in its code); never leave it half run
                result.close()
                self._finish_request(msg, None, RuntimeError("the handler suspended"))
        elif inspect.isawaitable(result):
            self._task(self._await_request, msg, result, self._s.generation)
        else:
            self._finish_request(msg, result, None)

    async def _await_request(self, msg: Message, result: Awaitable[Any], generation: int) -> None:
        try:
            value = await result
        except Exception as exc:
            self._finish_request(msg, None, exc, generation)
            return
        except BaseException:
            msg.close()  # cancelled (the bus is closing): no answer
            raise
        self._finish_request(msg, value, None, generation)

    def _finish_request(
        self, msg: Message, result: Any, error: Exception | None, generation: int | None = None
    ) -> None:
        """Send the session's answer for the handler's ``result`` or ``error``; none for
        a request that came over an earlier connection (a reconnect since: its caller
        was told ``recipient-gone`` by the broker)."""
        if generation is not None and generation != self._s.generation:
            msg.close()
            return
        pieces = self._s.answer_for(msg, result, error)
        if pieces is not None:
            self._queue_answer(pieces)

    # -- broker commands ---------------------------------------------------------------
    async def subscribe(self, group: str) -> bool:
        """Join ``group``; returns False if already a member. Confirmed by the broker.
        With ``reconnect``, a reconnect joins it again (at the end of its join order)."""
        joined = bool(await self.call("msgq", "subscribe", {"group": group}))
        self._s.subscribed(group)
        return joined

    async def unsubscribe(self, group: str) -> bool:
        """Leave ``group``; returns False if not a member. Confirmed by the broker."""
        left = bool(await self.call("msgq", "unsubscribe", {"group": group}))
        self._s.unsubscribed(group)
        return left

    async def members(self, group: str) -> list[Member]:
        """Members of ``group`` in join order (``G[0]`` first)."""
        rows = await self.call("msgq", "members", {"group": group})
        return [Member(r["lname"], r["name"], r.get("pid", -1)) for r in rows]

    async def version(self) -> dict[str, Any]:
        """The broker's ``version`` answer."""
        return dict(await self.call("msgq", "version"))

    # -- notifications and inline callbacks ----------------------------------------------
    def on_notification(self, group: str, callback: Callable[[Message], Any]) -> None:
        """Run ``callback(message)`` (a plain function or an ``async def``) for every
        notification to ``group``, in a task, instead of delivering it to iteration; an
        exception it raises is logged. Subscribe to the group separately."""
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

    @staticmethod
    def _inline_callback(callback: Callable[[Message], None], msg: Message) -> None:
        """Call an inline message callback; what it raises is logged (its bug, nobody to
        answer) and the descriptors it did not take are closed."""
        try:
            callback(msg)
        except Exception:
            log.exception("inline message callback %r raised", callback)
            msg.close()

    def _notification(self, msg: Message) -> bool:
        """Hand a notification to its group's inline callback, else its callbacks (in a
        task); False if it has neither (then it goes to iteration)."""
        if self._notify_inline:
            icb = self._notify_inline.get(msg.target)
            if icb is not None:
                try:
                    icb(msg)
                except Exception:
                    log.exception("inline notification callback %r raised", icb)
                finally:
                    msg.close()
                return True
        if self._notify_cbs:
            cbs = self._notify_cbs.get(msg.target)
            if cbs:
                self._task(self._notify_callbacks, list(cbs), msg)
                return True
        return False

    async def _notify_callbacks(self, cbs: list[Callable[[Message], Any]], msg: Message) -> None:
        try:
            for cb in cbs:
                await run_callback(cb, msg)
        finally:
            msg.close()  # descriptors a callback did not take_fds() are closed here

    # -- receiving ---------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[Message]:
        """Iterate over received messages and notifications, in arrival order.

        The iteration ends (like trio's ``EndOfChannel``) only when it was ended cleanly:
        this bus was closed locally, or the broker shut down and said GOODBYE. Every other
        end raises, so a consumer never mistakes a loss for the end of the stream. With
        ``reconnect`` it goes on across a reconnect (messages sent to the old lname while
        the bus was down are lost: the bus is not durable, a queue is) and ends when the
        bus is closed or gave up reconnecting (ConnectionLost, code ``reconnect-gave-up``).

        Raises:
            ConnectionLost: the connection broke (broker crashed) or the broker dropped this
                client; ``code`` says why (``slow-consumer``, ``protocol-error``,
                ``dropped``...). Messages received before it are all yielded first.
        """
        return self

    def __anext__(self) -> Awaitable[Message]:
        raise NotImplementedError  # the driver's: how it waits for the next message

    def _end_of_iteration(self) -> BaseException:
        """What iteration raises once every message was taken: StopAsyncIteration after
        a clean end (closed here, or the broker's shutdown), else the loss."""
        lost = self._s.lost
        if self._closed or lost is None or lost.code == _SHUTDOWN:
            return StopAsyncIteration()
        return lost
