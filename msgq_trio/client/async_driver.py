"""What the trio and the asyncio drivers share under the public API
(client/async_bus.py): the primitives each driver provides, the inbox's accounting,
a connection's start and end (handshake, heartbeat, the reconnect's restore,
GOODBYE) and the dispatch of requests and notifications to their handlers.

What a frame means and what to answer is the :class:`~msgq_trio.client.session.Session`'s,
and what follows a loss is its lifecycle's (client/lifecycle.py); sockets, tasks,
clocks and waiting are the drivers'. It imports neither trio nor asyncio
(``tests/test_layering.py``), so the asyncio driver can use it.

The primitives a driver implements (see each one's docstring below): ``_queue_request``,
``_wait_out``, ``_finish_call``, ``_wait_done``, ``_queue``, ``_queue_answer``,
``_checkpoint``, ``_unsent``, ``_wait_goodbye``, ``_fail_all``, ``_state_changed`` and
``_call_started``; the loop services of :class:`~msgq_trio.client.loop.LoopServices`;
a supervisor that dials and sleeps as the session's lifecycle says; and the attributes
``_s`` (the session), ``_closed``, ``_lost_event`` (an event with ``set()`` and ``async
wait()``), ``_new_waiter`` and ``_in`` (filled through :meth:`AsyncDriver._in_put`).
"""

from __future__ import annotations

import collections
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import ConnectError, ConnectionLost, UsageError
from ..protocol.codes import ErrorCode, FrameType
from ..protocol.connection import EOF, NEED_DATA
from ..protocol.errors import LocalProtocolError, ProtocolError
from ..protocol.framing import Frame, close_fds
from ..protocol.names import is_pattern, pattern_matches
from .facade import SessionView
from .inbox import Inbox
from .lifecycle import HeartbeatMonitor, State
from .loop import LoopEvent, LoopServices, run_callback
from .message import Buffer, Message, new_message
from .session import (
    CLOSE_WAIT,
    IN_HIGH_COUNT,
    IN_HIGH_WATER,
    Closed,
    PendingCall,
    Request,
    Send,
    never_suspends,
)
from .tracing import dispatching_in_a_trace, handler_in_its_trace, received

__all__ = ["AsyncDriver", "Handler"]

log = logging.getLogger("msgq_trio.client")

_SHUTDOWN = str(ErrorCode.BROKER_SHUTDOWN)
_MESSAGE = int(FrameType.MESSAGE)  # a plain int: compared once per received frame

#: A command handler as registered: ``fn(params)`` or ``fn(params, request)``, a plain
#: function or an ``async def``.
Handler = Callable[..., Any]


class AsyncDriver(SessionView, LoopServices):
    """The shared part of the asynchronous drivers (see the module's docstring); not
    instantiated on its own."""

    _closed: bool
    _lost_event: LoopEvent
    _notify_cbs: dict[str, list[Callable[[Message], Any]]]
    _notify_inline: dict[str, Callable[[Message], None]]
    _message_inline: Callable[[Message], None] | None
    #: Received messages the application has not taken yet, bounded by
    #: ``IN_HIGH_WATER`` bytes and ``IN_HIGH_COUNT`` messages (client/inbox.py: the
    #: bound, and why the bytes are counted by batch). A plain MESSAGE waits as its Frame
    #: and becomes a Message when taken (:meth:`_take`): a burst of one receive is
    #: thousands of messages, and as Message objects they would all be alive at once
    #: for the cyclic garbage collector to walk and promote to older generations
    #: (frames from the compiled scanner are not tracked by it).
    _inbox: Inbox[Message | Frame]
    #: ``_inbox.items``, the deque the hot paths take from.
    _in: collections.deque[Message | Frame]

    #: The address dialled (the session's lifecycle holds the reconnect policy).
    _target: str
    _reconnected_cbs: list[Callable[[], Any]]
    #: Whether a connection is up, and the event set when it ends (the driver's).
    _up: bool
    _down: LoopEvent
    #: Fail the connection with a ConnectionLost and wake every waiter (the driver's).
    _fail_all: Callable[[ConnectionLost], None]
    #: Set when the broker's GOODBYE (or EOF) came on this connection (the driver's).
    _broker_goodbye: LoopEvent
    #: Calls answered by the last receive (the trio driver batches the next requests
    #: of several woken callers into one write).
    _answered: int = 0

    def _init_api(self, target: str = "") -> None:
        """The registries of the API (called by the driver's ``__init__``)."""
        self._inbox = Inbox(IN_HIGH_WATER, IN_HIGH_COUNT)
        self._in = self._inbox.items
        self._notify_cbs = {}
        self._notify_inline = {}
        self._message_inline = None
        self._target = target
        self._reconnected_cbs = []

    def _dial_with(
        self, ssl_context: Any, server_hostname: str | None, send_buffer: int, token: str | None
    ) -> None:
        """How each connection dials (``connect()``'s arguments, the same for every
        reconnect): TLS context and host name, SO_SNDBUF, the TCP token."""
        self._ssl_context = ssl_context
        self._server_hostname = server_hostname
        self._send_buffer = send_buffer
        self._token = token

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

    def _unsent(self) -> int:
        """Bytes queued or written but not yet taken by the broker."""
        raise NotImplementedError

    async def _wait_goodbye(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the broker's GOODBYE (or EOF); whether it came."""
        raise NotImplementedError

    def _take(self, item: Message | Frame) -> Message:
        """The Message of an ``_in`` entry just popped."""
        if isinstance(item, Message):
            return item
        return new_message(item, self._s.sources)

    def _in_put(self, entries: int, nbytes: int) -> None:
        """``entries`` were just appended to ``_in``, ``nbytes`` in all: one batch."""
        self._inbox.put(entries, nbytes)

    def _in_held(self) -> int:
        """The bytes of ``_in`` against ``IN_HIGH_WATER`` (:meth:`Inbox.held`)."""
        return self._inbox.held()

    def _drop_in(self) -> None:
        """Close every message nobody took (their descriptors are ours to close)."""
        for item in self._inbox.clear():
            if isinstance(item, Message):
                item.close()
            else:
                close_fds(item.fds)

    def _in_full(self) -> bool:
        """Over the inbox's bound (:meth:`Inbox.full`), wait for the application: the
        driver reads no more until it takes some."""
        return self._inbox.full(bool(self._s.calls))

    def _call_started(self) -> None:
        """A call was queued: a driver whose reader paused on the count bound reads
        again (see :meth:`_in_full`)."""
        raise NotImplementedError

    async def _wait_done(self, call: PendingCall) -> None:
        """Wait until the session woke ``call`` (its ``waiter``); cancel-safe: the waiter
        stays usable to be waited for again."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._s.lost is not None:
            raise self._s.lost
        if self._closed:
            raise UsageError("the bus is closed")

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

    def _welcomed(self, remote: bool) -> bool:
        """WELCOME taken on a new connection: it is up. Over TCP the broker's
        ``msgq.heartbeat`` requests are answered inline. True when it is a reconnect's:
        the driver then runs :meth:`_restore` in a task of the connection."""
        if remote:
            self._s.inline["msgq.heartbeat"] = self._answer_heartbeat
        return self._s.welcomed(remote) is State.RESTORING

    def _answer_heartbeat(self, request: Message) -> None:
        self._queue_answer(self._s.encode_answer(request))

    async def _heartbeat(self, interval: float, misses: int) -> None:
        """Detect a silent broker over TCP (a dead host or path sends no FIN or RST),
        in a task of the connection.

        Every ``interval``: if nothing arrived since the last tick, ask the broker
        ``ping`` (its answer, or any traffic, proves it alive); after ``misses`` silent
        intervals the connection is declared lost (ConnectionLost code
        ``heartbeat-timeout``), which fails every pending call exactly as a Unix
        disconnect does, and the supervisor closes the socket. Intervals in which our
        own reader is paused (the application is not consuming) do not count.
        """
        monitor = HeartbeatMonitor(interval, misses)
        s = self._s
        while s.lost is None:
            await self.sleep(interval)
            lost = monitor.tick(s.conn.received_bytes, self._in_full())
            if lost is not None:
                self._fail_all(lost)
                return
            if monitor.silent:
                self._queue_request(s.encode_ping(), ())

    def _closing(self) -> None:
        """The application closes the bus: no reconnect follows (an attempt under way
        or scheduled is given up)."""
        self._closed = True
        self._s.life.close()

    async def _supervise(self, started: Callable[[], None]) -> None:
        """The bus's connections, one after another, as the session's lifecycle says
        (the one reconnect supervisor of the asynchronous drivers): dial, handshake and
        serve (``_connection``, bounded by the lifecycle's ``attempt_deadline`` until
        WELCOME) until the connection ends; then, with ``reconnect``, sleep as the
        backoff says and dial again, until one succeeds (the groups are joined again)
        or the policy gives up (the loss is final). ``started()`` once the first
        connection is up.

        Raises:
            ConnectError, UsageError: the first connection failed, or had no WELCOME
                within ``connect()``'s ``timeout`` (see the drivers' ``connect``).
        """
        life = self._s.life
        while True:
            life.dialing(self._now())
            try:
                await self._connection(life.attempt_deadline, started)
            except (ConnectError, UsageError) as exc:
                if life.state is State.CONNECTING:
                    life.attempt_failed(exc, self._now())
                    raise
                self._attempt_failed(exc)
            delay = life.wait(self._now())
            if delay is None:
                return  # the end is final (reconnect off, given up, or the bus closed)
            await self.sleep(delay)

    async def _connection(self, deadline: float | None, started: Callable[[], None]) -> None:
        """One connection (the driver's): dial, send HELLO and take WELCOME by
        ``deadline`` on the driver's clock (None: no bound), else raise the
        lifecycle's ``timed_out()``; then serve it until it ends (reader, writer, the
        heartbeat over TCP; a reconnect's restore, or ``started()`` for the first).

        Raises:
            ConnectError, UsageError: the dial or the handshake failed, or timed out.
        """
        raise NotImplementedError

    def _attempt_failed(self, exc: BaseException) -> bool:
        """A reconnect attempt failed: True once the policy gave up (the loss is final:
        whoever waits for the connection wakes to see it)."""
        if not self._s.attempt_failed(exc, self._now()):
            return False
        self._lost_event.set()
        self._state_changed()
        return True

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

    # -- receiving: one receive's frames, in order -------------------------------------
    def _receive_events(self, evs: list[Any], burst: int) -> bool:
        """Act on what one receive brought (``evs``, the codec's events; ``burst``: its
        ``message_burst``), in arrival order, through the session's one dispatch
        (:meth:`~msgq_trio.client.session.Session.handle`). True once the broker ended
        the connection (EOF): the bus has then failed its calls.

        The hot path: a plain MESSAGE's event is the Message of its frame, and the frame
        waits in the inbox as it is, made that Message when the application takes it
        (see ``_in``); a receive of plain messages only (``burst`` >= 0) goes to the
        inbox whole, without a step per message.
        """
        inq, inline = self._in, self._message_inline
        if inline is None and burst >= 0:
            inq.extend(evs)
            self._in_put(len(evs), burst)
            return False
        handle = self._s.handle
        for ev in evs:
            if ev is EOF:
                self._broker_goodbye.set()
                self._fail_all(ConnectionLost("the broker closed the connection"))
                return True
            assert isinstance(ev, Frame)
            if ev.type == _MESSAGE and inline is None:
                inq.append(ev)
                self._in_put(1, len(ev.raw) + len(ev.large_body))
                continue
            event = handle(ev)
            if isinstance(event, Message):
                if ev.type == _MESSAGE:
                    assert inline is not None
                    self._inline_callback(inline, event)
                elif not self._notification(event):
                    inq.append(event)
                    self._in_put(1, len(ev.raw) + len(ev.large_body))
            elif isinstance(event, PendingCall):
                if event.done:
                    self._answered += 1
            elif isinstance(event, Request):
                msg = event.message
                if event.inline is not None:
                    try:
                        event.inline(msg)
                    except Exception as exc:
                        self._queue_answer(self._s.inline_failed(msg, exc))
                else:
                    assert event.handler is not None
                    self._start_request(msg, event.handler)
            elif isinstance(event, Send):
                self._queue_answer(event.pieces)
            elif isinstance(event, Closed):
                if event.goodbye:
                    self._broker_goodbye.set()
                if event.error is not None:
                    self._fail_all(event.error)
        return False

    def _start_request(self, msg: Message, handler: Handler) -> None:
        """Run ``handler`` for a request, in the reader: a plain function is answered
        right here, without a task per request (a task costs more than a small handler),
        and so is an ``async`` one whose code has no ``await`` (it cannot suspend:
        :func:`~msgq_trio.client.session.never_suspends`); any other ``async`` one
        returns an awaitable, which a task of its own awaits."""
        if msg.traced or dispatching_in_a_trace():  # (client/tracing.py)
            handler = handler_in_its_trace(handler, msg)
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
            icb = self._notify_inline.get(msg.target) or _by_pattern(
                self._notify_inline, msg.target
            )
            if icb is not None:
                try:
                    with received(msg):  # in the sender's trace, if it sent one
                        icb(msg)
                except Exception:
                    log.exception("inline notification callback %r raised", icb)
                finally:
                    msg.close()
                return True
        if self._notify_cbs:
            cbs = self._notify_cbs.get(msg.target) or _by_pattern(self._notify_cbs, msg.target)
            if cbs:
                self._task(self._notify_callbacks, list(cbs), msg)
                return True
        return False

    async def _notify_callbacks(self, cbs: list[Callable[[Message], Any]], msg: Message) -> None:
        try:
            # In this task's own context: the callbacks' sends continue the sender's
            # trace, and no other task sees it.
            with received(msg):
                for cb in cbs:
                    await run_callback(cb, msg)
        finally:
            msg.close()  # descriptors a callback did not take_fds() are closed here

    def _end_of_iteration(self) -> BaseException:
        """What iteration raises once every message was taken: StopAsyncIteration after
        a clean end (closed here, or the broker's shutdown), else the loss."""
        lost = self._s.lost
        if self._closed or lost is None or lost.code == _SHUTDOWN:
            return StopAsyncIteration()
        return lost


T = TypeVar("T")


def _by_pattern(table: Mapping[str, T], group: str) -> T | None:
    """The entry of ``table`` (callbacks by group) whose key is a subscription pattern
    matching ``group`` (the first registered), or None: a callback registered for
    ``Zone.*`` hears ``Zone.a``. Asked only when ``group`` has no entry of its own, so an
    exact group is one dict lookup; the patterns are few (one per callback)."""
    for key, value in table.items():
        if is_pattern(key) and pattern_matches(key, group):
            return value
    return None
