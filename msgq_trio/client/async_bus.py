"""The public API of the asynchronous clients, the trio :class:`~msgq_trio.Bus` and
the asyncio :class:`~msgq_trio.aio.AioBus`: one :class:`AsyncBus` with the public
methods, their argument handling and their docstrings, over the primitives each driver
provides (client/async_driver.py). The plugin clients (client/queue.py,
client/pipe_core.py) use this API only, so they run on either driver. It imports
neither trio nor asyncio (``tests/test_layering.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

from ..errors import ConnectionLost, MsgqError, UsageError
from ..protocol.framing import close_fds
from .async_driver import AsyncDriver, Handler
from .loop import run_callback
from .message import Buffer, Member, Message, Result
from .queue import Queue
from .session import (
    PendingCall,
)

__all__ = ["AsyncBus", "Handler"]


class AsyncBus(AsyncDriver):
    """The public API of the asynchronous clients (see :class:`~msgq_trio.Bus` and
    :class:`~msgq_trio.aio.AioBus`); not instantiated on its own."""

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
        exception it raises is logged. Subscribe to the group separately. ``group`` may be
        a pattern (``Zone.*``): it then serves the notifications to the groups it
        matches that have no callback of their own."""
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
