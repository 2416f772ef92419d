"""The queue client's push consumer (:class:`Consumer`): deliveries taken inline from
the reader into a :class:`~msgq_trio.client.mailbox.Mailbox`, the credit window, ack
batching, and consuming again after a plugin restart or a reconnect. No event loop
(``tests/test_layering.py``)."""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, NoReturn

from ..errors import (
    ConnectionLost,
    MsgqError,
    NoRecipient,
    UsageError,
)
from .mailbox import Mailbox
from .tracing import delivered_traces

if TYPE_CHECKING:
    from .message import Message
    from .queue_bus import QueueBus as Bus
    from .queue_bus import QueueHandle

from .queue_message import (
    ACK_DELAY,
    CANCEL_WAIT,
    DELIVER,
    FAIRNESS,
    NACK,
    QueueMessage,
    _Delivery,
)

__all__ = ["Consumer"]

log = logging.getLogger("msgq_trio.client.queue")

#: Per bus: queue name -> its active push consumer.
_consumers: weakref.WeakKeyDictionary[Bus, dict[str, Consumer]] = weakref.WeakKeyDictionary()
#: Buses whose reconnects re-attach their consumers (hooked once per bus).
_reconnect_hooked: weakref.WeakSet[Bus] = weakref.WeakSet()


def _on_event(bus: Bus, msg: Message) -> None:
    """A notification on ``<group>.events``: a plugin process that ``started`` after the
    one a consumer of ``bus`` consumes from means that one is gone: consume again."""
    body = msg.body
    if msg.event != "started" or not isinstance(body, dict):
        return
    instance = body.get("instance")
    if not isinstance(instance, str):
        return
    for consumer in list(_consumers.get(bus, {}).values()):
        consumer._plugin_started(instance)


def _on_reconnected(bus: Bus) -> None:
    """The bus reconnected (``connect(..., reconnect=...)``): no plugin process knows
    the new connection's consumers, so each consumes again."""
    for consumer in list(_consumers.get(bus, {}).values()):
        consumer._reconnected()


def _on_deliver(bus: Bus, request: Message) -> None:
    """Inline handler of ``queue.deliver`` (a batch, as columns: ``ids``, ``bodies``,
    ``deliveries`` and, for ``consume(ids=True)``, ``producers`` and ``seqs``): hand the
    messages to the queue's consumer and answer "received"; an error answer gives the
    whole batch back."""
    p = request.body
    ids = bodies = counts = None
    if isinstance(p, dict):
        ids, bodies, counts = p.get("ids"), p.get("bodies"), p.get("deliveries")
    if not (
        type(ids) is list
        and type(bodies) is list
        and type(counts) is list
        and len(ids) == len(bodies) == len(counts)
        and all(type(b) is bytes for b in bodies)
    ):
        bus.answer_error(request, "bad-request", "malformed delivery")
        return
    name = str(p.get("queue"))
    consumer = _consumers.get(bus, {}).get(name)
    if consumer is None:
        bus.answer_error(request, NACK, f"{bus.lname} no longer consumes {name!r}")
        return
    box = consumer._box
    if len(ids) > box.room:
        # The plugin keeps within the window, so this is a bug on one side: refuse all.
        bus.answer_error(
            request,
            NACK,
            f"{bus.lname}: delivery beyond the window "
            f"({len(box)} held + {len(ids)} > {consumer._window})",
        )
        return
    producers, seqs = p.get("producers"), p.get("seqs")
    origins = None
    if type(producers) is list and type(seqs) is list and len(producers) == len(ids) == len(seqs):
        origins = list(zip(producers, seqs, strict=True))
    traces = p.get("traces")
    if traces is not None:
        traces = delivered_traces(traces, len(ids), f"deliver {name}")
    box.put_many(
        QueueMessage._many(_Delivery(bus, name, consumer), ids, bodies, counts, origins, traces)
    )
    bus.answer(request, True)


class Consumer:
    """Push consumer of one queue: ``async for m in consumer`` (or ``async with`` it to
    stop promptly). Created by :meth:`Queue.consume`.

    Error handling: when the connection ends, the iteration yields what was already
    received, then raises ``ConnectionLost`` (the plugin redelivers everything unacked).
    When the queue plugin restarts (the broker's supervisor restarts it after a crash),
    the consumer consumes again from the new plugin process: messages received from the
    old one and not yet taken are dropped, acks of those taken are ignored, and the new
    process delivers them again (``reattached`` counts this). The same happens after the
    bus reconnects (``connect(..., reconnect=...)``), and the iteration goes on: if the
    plugin is not back yet, the consumer consumes again when it announces itself. If
    consuming again fails otherwise, the iteration raises that error.

    Resource handling: ``aclose()`` (or leaving ``async with``) tells the plugin to stop
    pushing and refuses deliveries still arriving (they are redelivered); messages taken
    but not acked are redelivered after their ack deadline or at disconnect.
    """

    def __init__(
        self, q: QueueHandle, window: int, ack_timeout: float | None, ids: bool = False
    ) -> None:
        if window < 1:
            raise UsageError("window must be >= 1")
        self._q = q
        self._window = window
        self._ack_timeout = ack_timeout
        self._ids = ids
        #: why the iteration ends with an error: the connection's end, or a failed
        #: consume after a plugin restart
        self._lost: MsgqError | None = None
        #: received deliveries, taken by the iteration (the window bounds them)
        self._box: Mailbox[QueueMessage] = Mailbox(window, q._bus.new_event)
        self._started = False
        self._closed = False
        # Acks and nacks are collected and sent as one one-way message per scheduler
        # tick (the plugin's answer-free ``ack``): a consumer acking each message costs
        # a frame per batch, not per message.
        self._acks: list[int] = []
        self._nacks: list[int] = []
        self._flush_pending = False
        #: Acks sent at once when this many are collected (a quarter window: the plugin
        #: refills a consumer's credit in quarter windows too); fewer wait for the
        #: consumer to run out of messages, or ACK_DELAY.
        self._ack_batch = max(1, window // 4)
        #: the plugin process consumed from (its ``consume`` answer), None before that
        self._instance: str | None = None
        #: raised at each re-attach: acks of messages from an earlier generation are
        #: dropped (their plugin process is gone; the new one redelivers them)
        self._gen = 0
        self.reattached = 0
        #: a consume after a restart or reconnect is under way; a plugin's "started"
        #: meanwhile is noted in ``_started_meanwhile`` (its answer may still be
        #: ``no-recipient``: then consume once more)
        self._attaching = False
        self._started_meanwhile = False
        #: messages returned / acked since the last checkpoint (see ``FAIRNESS``)
        self._since_yield = 0
        self._acked_since_yield = 0

    def _settle(self, mid: int, ok: bool, gen: int) -> None:
        if gen != self._gen:
            return  # delivered by a plugin process that is gone
        (self._acks if ok else self._nacks).append(mid)
        if len(self._acks) + len(self._nacks) >= self._ack_batch:
            self._q._bus.start_soon(self._flush)
        elif not self._flush_pending:
            self._flush_pending = True
            self._q._bus.start_soon(self._flush_later)

    async def _flush_later(self) -> None:
        await self._q._bus.sleep(ACK_DELAY)
        self._flush_pending = False
        await self._flush()

    async def _flush(self) -> None:
        bus, name = self._q._bus, self._q.name
        acks, self._acks = self._acks, []
        nacks, self._nacks = self._nacks, []
        try:
            if acks:
                await bus.send(self._q.group, {"ack": name, "ids": acks})
            if nacks:
                await bus.send(self._q.group, {"nack": name, "ids": nacks})
        except ConnectionLost:
            pass  # unacked messages are redelivered by the plugin

    async def _start(self) -> None:
        bus, name = self._q._bus, self._q.name
        await self._q._ensure_declared()
        table = _consumers.setdefault(bus, {})
        if name in table:
            raise UsageError(f"this bus already consumes {name!r}")
        if not table:
            bus.add_inline_command(DELIVER, lambda r: _on_deliver(bus, r))
            # Told when a plugin process starts: one that restarted has forgotten its
            # consumers (subscribed before consuming, so no restart after our
            # ``consume`` goes unseen).
            events = f"{self._q.group}.events"
            bus.on_notification_inline(events, lambda m: _on_event(bus, m))
            if bus not in _reconnect_hooked:
                _reconnect_hooked.add(bus)
                bus.on_reconnected(lambda: _on_reconnected(bus))
            await bus.subscribe(events)
        table[name] = self
        self._started = True
        bus.start_soon(self._watch_lost)
        await self._consume()

    async def _consume(self) -> None:
        """Ask the plugin to push to this consumer: the one place that (re)starts
        consuming, at the start and after the plugin process changed (``_reattach``;
        a driver that reconnects would consume again here too)."""
        params: dict[str, Any] = {"queue": self._q.name, "window": self._window}
        if self._ack_timeout is not None:
            params["ack_timeout"] = self._ack_timeout
        if self._ids:
            params["ids"] = True
        answer = await self._q._bus.call(self._q.group, "consume", params)
        if isinstance(answer, dict) and isinstance(answer.get("instance"), str):
            self._instance = answer["instance"]

    def _plugin_started(self, instance: str) -> None:
        if self._closed or self._instance is None or instance == self._instance:
            return
        if self._attaching:
            self._started_meanwhile = True
            return
        self._instance = instance
        self._q._bus.start_soon(self._reattach)

    def _reconnected(self) -> None:
        if self._closed:
            return
        # Any plugin process's "started" is news to the new connection.
        self._instance = ""
        self._q._bus.start_soon(self._reattach)

    async def _reattach(self) -> None:
        """The plugin process this consumer consumed from is gone and another started:
        drop what it delivered but the iteration did not take yet (not acked, so the new
        process delivers it again, unless it was never stored: then its producer was
        not answered and resends it), forget its pending acks, consume again. If that
        fails the iteration ends with the error."""
        self._gen += 1
        self.reattached += 1
        dropped = self._box.drain()
        self._acks.clear()
        self._nacks.clear()
        log.warning(
            "queue %s: the queue plugin restarted or the bus reconnected; consuming again "
            "(%d received messages dropped: they are redelivered)",
            self._q.name,
            len(dropped),
        )
        self._attaching = True
        try:
            while True:
                self._started_meanwhile = False
                try:
                    await self._consume()
                    return
                except NoRecipient:
                    if self._started_meanwhile:
                        continue
                    # No plugin process yet (the broker restarted with us): its
                    # "started" notification brings us back here.
                    self._instance = ""
                    return
        except ConnectionLost:
            return  # the bus reconnects (then we are back here) or is lost for good
        except MsgqError as exc:
            if self._closed:
                return
            log.error(
                "queue %s: cannot consume again after the plugin restarted: %s", self._q.name, exc
            )
            self._lost = exc
            self._box.close()
        finally:
            self._attaching = False

    async def _watch_lost(self) -> None:
        """End the iteration when the connection ends: the messages already received
        are still taken, then ``ConnectionLost`` (a consumer must not wait forever for
        deliveries from a broker that is gone)."""
        bus = self._q._bus
        self._lost = await bus.wait_lost()
        self._box.close()

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> QueueMessage:
        if not self._started:
            await self._start()
        # A message already received is returned without a trip through the scheduler,
        # with a full checkpoint every FAIRNESS messages (as Bus iteration does): the
        # iteration stays cancellable and fair, and a busy consumer does not pay a
        # schedule point per message.
        box = self._box
        if self._since_yield < FAIRNESS - 1:
            m = box.get_nowait()
            if m is not None:
                self._since_yield += 1
                return m
            if box.ended:
                return self._ended()
        self._since_yield = 0
        if self._acks or self._nacks:
            # About to wait (or at a checkpoint): the plugin needs our acks to send more.
            await self._flush()
        if len(box):
            await self._q._bus.checkpoint()  # the fairness checkpoint (get would not wait)
        m = await box.get()
        return self._ended() if m is None else m

    def _ended(self) -> NoReturn:
        if self._lost is not None and not self._closed:
            raise self._lost from None
        raise StopAsyncIteration from None

    def take_ready(self, limit: int) -> list[QueueMessage]:
        """Up to ``limit`` messages already received, without waiting (possibly none):
        a forwarder takes what arrived with one delivery batch and passes it on as one
        batch."""
        out: list[QueueMessage] = []
        while len(out) < limit:
            m = self._box.get_nowait()
            if m is None:
                break
            out.append(m)
        return out

    async def aclose(self) -> None:
        """Stop consuming (see the class docstring); the last acks and the ``cancel``
        are sent even if the caller is cancelled meanwhile (the cancel waits at most
        ``CANCEL_WAIT`` s). Idempotent."""
        if self._closed:
            return
        self._closed = True
        bus, name = self._q._bus, self._q.name
        table = _consumers.get(bus, {})
        if table.get(name) is self:
            del table[name]
        self._box.close()
        for m in self._box.drain():
            await m.nack()
        if self._acks or self._nacks:
            await bus.shielded(self._flush)
        if self._started:

            async def cancel() -> None:
                try:
                    await bus.call(self._q.group, "cancel", {"queue": name})
                except Exception:  # the bus or the plugin is gone: nothing to cancel
                    pass

            await bus.shielded(cancel, CANCEL_WAIT)

    async def __aenter__(self) -> Consumer:
        await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
