"""Client side of the durable queues of the queue plugin (docs/QUEUE.md).

``bus.queue(name)`` returns a :class:`Queue`. Producers ``put``/``put_many`` and get the
answer when the messages are durable (ack 1); consumers ``consume`` (push, credit window)
or ``fetch`` (pull) and ``ack`` each message (ack 2).

One implementation for every asynchronous driver (the trio ``Bus`` and the asyncio
``AioBus``): the protocol logic here (requests, producer seqs, the window and ack
batching, re-attach after a plugin restart) is written against the public API of
:class:`~msgq_trio.client.async_bus.AsyncBus` only (calls, inline commands and notifications,
``start_soon``, ``sleep``, ``checkpoint``, ``new_event``, ``shielded``, ``wait_lost``)
and a :class:`~msgq_trio.client.mailbox.Mailbox`. It imports no event loop
(``tests/test_layering.py``).
"""

from __future__ import annotations

import io
import logging
import os
import socket
import uuid
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import cbor2

from ..errors import (
    ConnectionLost,
    MalformedMessage,
    MsgqError,
    NoRecipient,
    RemoteError,
    UsageError,
)
from ..protocol.codes import ErrorCode
from .mailbox import Mailbox

if TYPE_CHECKING:
    from .async_bus import AsyncBus as Bus
    from .message import Message

__all__ = ["DEFAULT_GROUP", "Consumer", "Queue", "QueueMessage"]

log = logging.getLogger("msgq_trio.client.queue")

#: The queue plugin's group (its ``group`` setting's default).
DEFAULT_GROUP = "msgq-queue"
#: The command deliveries arrive with (see plugins/queue/service.py).
DELIVER = "queue.deliver"
#: Error code a consumer answers to refuse a delivery (the plugin redelivers it).
NACK = "nack"
#: Longest an ack waits to be sent with others (when the consumer has more messages to
#: work on; it is sent at once when the consumer runs out): 2 ms is well below any ack
#: deadline and the queue's ack_grace (50 ms), and lets ~100 acks share a frame.
ACK_DELAY = 0.002

#: Iteration over a consumer and acks yield to other tasks at least every this many
#: messages (the trio client's iteration uses the same rule).
FAIRNESS = 256
#: Longest a consumer's close waits for the plugin to answer its ``cancel`` (the plugin
#: answers at once when it runs; a plugin that is gone fails the call at once too): a
#: bound only for a plugin that is stopped (SIGSTOP) or a broker that stopped reading.
CANCEL_WAIT = 5.0

#: Per bus: queue name -> its active push consumer.
_consumers: weakref.WeakKeyDictionary[Bus, dict[str, Consumer]] = weakref.WeakKeyDictionary()
#: Buses whose reconnects re-attach their consumers (hooked once per bus).
_reconnect_hooked: weakref.WeakSet[Bus] = weakref.WeakSet()


class _Delivery:
    """What every message of one delivery (or one fetch) shares: a message points at its
    delivery instead of holding five fields of its own (a consumer makes one message
    object per message, so each field costs per message)."""

    __slots__ = ("bus", "consumer", "gen", "queue")

    def __init__(self, bus: Bus, queue: str, consumer: Consumer | None) -> None:
        self.bus = bus
        self.queue = queue
        self.consumer = consumer
        #: the consumer's generation when it arrived (see ``Consumer._reattach``)
        self.gen = consumer._gen if consumer is not None else 0


_UNDECODED: Any = object()
_new_message = object.__new__


class QueueMessage:
    """One delivered message. Ack it (``await m.ack()``) once processed, or ``nack`` it
    to have it redelivered; an unacked message is redelivered after the consumer's
    ``ack_timeout`` or when its connection ends. Made by the queue client only.

    Attributes:
        queue: the queue's name.
        id: the delivery id (unique within the plugin process).
        deliveries: how often it was delivered, this time included.
        producer, producer_seq: the message's producer name and producer seq, with which
            it was put (a resend keeps them); only for a consumer started with
            ``consume(ids=True)``, else None.
    """

    __slots__ = ("_d", "_done", "_origin", "_raw", "_value", "deliveries", "id")

    _d: _Delivery
    _done: bool
    #: (producer, producer seq) for ``consume(ids=True)``, else None
    _origin: tuple[str, int] | None
    _raw: bytes
    _value: Any
    deliveries: int
    id: int

    @classmethod
    def _many(
        cls,
        d: _Delivery,
        ids: list[int],
        bodies: list[bytes],
        counts: list[int],
        origins: list[tuple[str, int]] | None = None,
    ) -> list[QueueMessage]:
        """The messages of one delivery (columns of equal length). No ``__init__``: the
        fields are set here, which halves the cost per message."""
        out: list[QueueMessage] = []
        append = out.append
        new = _new_message
        for i, (mid, raw, count) in enumerate(zip(ids, bodies, counts, strict=True)):
            m = new(cls)
            m._d = d
            m.id = mid
            m._raw = raw
            m.deliveries = count
            m._value = _UNDECODED
            m._done = False
            m._origin = origins[i] if origins is not None else None
            append(m)
        return out

    @property
    def queue(self) -> str:
        return self._d.queue

    @property
    def producer(self) -> str | None:
        return self._origin[0] if self._origin is not None else None

    @property
    def producer_seq(self) -> int | None:
        return self._origin[1] if self._origin is not None else None

    @property
    def raw(self) -> bytes:
        """The body as CBOR bytes, as the producer encoded it (not decoded)."""
        return self._raw

    @property
    def body(self) -> Any:
        """The body as the producer gave it (decoded on first access).

        Raises:
            MalformedMessage: the body is not one well-formed CBOR value (the producer's
                fault; the message can still be acked or nacked).
        """
        value = self._value
        if value is _UNDECODED:
            value = self._value = self._decode() if self._raw else None
        return value

    def _decode(self) -> Any:
        """One CBOR value filling the body exactly (cbor2 alone ignores trailing bytes)."""
        raw = self._raw
        fp = io.BytesIO(raw)
        who = f"the producer of message {self.id} of queue {self.queue!r}"
        try:
            value = cbor2.load(fp)
        except Exception as exc:  # cbor2 raises several unrelated types on bad input
            raise MalformedMessage(f"malformed CBOR in a queued body: {exc}", who) from None
        if fp.tell() != len(raw):
            raise MalformedMessage("a queued body has bytes after its CBOR value", who)
        return value

    async def ack(self) -> None:
        """Ack 2: the message is consumed and removed. Idempotent."""
        await self._finish(True)

    async def nack(self) -> None:
        """Give the message back for redelivery (its delivery count stays)."""
        await self._finish(False)

    async def _finish(self, ok: bool) -> None:
        d = self._d
        if self._done:
            await d.bus.checkpoint()
            return
        self._done = True
        consumer = d.consumer
        if consumer is not None:
            consumer._settle(self.id, ok, d.gen)
            consumer._acked_since_yield += 1
            if consumer._acked_since_yield >= FAIRNESS:
                consumer._acked_since_yield = 0
                await d.bus.checkpoint()
        else:
            await d.bus.call(
                _group(d.bus), "ack" if ok else "nack", {"queue": d.queue, "ids": [self.id]}
            )

    def __repr__(self) -> str:
        return f"QueueMessage({self.queue!r}, id={self.id}, deliveries={self.deliveries})"


def _group(_bus: Bus) -> str:
    return DEFAULT_GROUP


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
    box.put_many(QueueMessage._many(_Delivery(bus, name, consumer), ids, bodies, counts, origins))
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

    def __init__(self, q: Queue, window: int, ack_timeout: float | None, ids: bool = False) -> None:
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


class Queue:
    """A handle on the durable queue ``name`` (``bus.queue(name)``).

    Args:
        producer: this producer's name for deduplication. Give the same name to a
            producer that resends after a crash, with the same ``seq`` per message; the
            default is a fresh unique name per handle (dedup within this handle only).
        group: the queue plugin's group.

    The queue is declared (without options) on first use; call :meth:`declare` first to
    set options. Errors: ``QueueFull`` (store full, nothing stored), ``RemoteError``
    (``bad-request``: malformed or unknown), ``NoRecipient`` (no queue plugin running).
    """

    def __init__(
        self, bus: Bus, name: str, *, producer: str | None = None, group: str = DEFAULT_GROUP
    ) -> None:
        self._bus = bus
        self.name = name
        self.group = group
        self.producer = producer or f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}"
        self._declared = False
        self._next_seq: int | None = None
        #: set while one task asks the plugin for this producer's state; the others
        #: wait for it (see ``_seqs``)
        self._seq_asked: Any = None

    async def declare(self, **options: Any) -> bool:
        """Declare the queue with ``options`` (docs/QUEUE.md: bind, max_deliveries,
        dead_letter, ack_timeout, window); True if it was created."""
        created = bool(await self._bus.call(self.group, "declare", {"queue": self.name, **options}))
        self._declared = True
        return created

    async def _ensure_declared(self) -> None:
        if not self._declared:
            await self.declare()

    async def producer_state(self) -> int:
        """The highest producer seq of this producer the plugin has accepted (durably,
        or in this plugin run); 0 if none."""
        await self._ensure_declared()
        return int(
            await self._bus.call(
                self.group, "producer_state", {"queue": self.name, "producer": self.producer}
            )
        )

    async def _seqs(self, n: int) -> int:
        # The first task asks the plugin; concurrent ones wait for its answer (and ask
        # again themselves if it failed), so seqs are taken in the order tasks came.
        while self._next_seq is None:
            if self._seq_asked is not None:
                await self._seq_asked.wait()
                continue
            self._seq_asked = asked = self._bus.new_event()
            try:
                self._next_seq = await self.producer_state() + 1
            finally:
                self._seq_asked = None
                asked.set()
        first = self._next_seq
        self._next_seq += n
        return first

    async def prepare(self) -> None:
        """Declare the queue and learn this producer's next seq, so that the ``start_*``
        methods can send without waiting. Idempotent."""
        await self._ensure_declared()
        if self._next_seq is None:
            await self._seqs(0)

    def _take_seqs(self, n: int, first: int | None) -> int:
        if first is not None:
            return first
        if self._next_seq is None:
            raise UsageError("call `await queue.prepare()` first (or pass the seq)")
        first = self._next_seq
        self._next_seq += n
        return first

    def start_put(self, body: Any, *, seq: int | None = None) -> Callable[[], Awaitable[str]]:
        """Send one put now, synchronously; ``await wait()`` gives what :meth:`put`
        returns. For a window of puts in flight: puts leave in call order, which
        deduplication needs (a seq below one already accepted counts as a resend).

        Raises:
            UsageError: not prepared (see :meth:`prepare`) and no ``seq`` given.
        """
        seq = self._take_seqs(1, seq)
        wait = self._bus.start_call(
            self.group,
            "put",
            {"queue": self.name, "producer": self.producer, "seq": seq, "body": cbor2.dumps(body)},
        )

        async def result() -> str:
            return str(await wait())

        return result

    def start_put_many(
        self, bodies: Sequence[Any], *, first_seq: int | None = None
    ) -> Callable[[], Awaitable[dict[str, int]]]:
        """Send a batch now, synchronously (see :meth:`start_put`); ``await wait()``
        gives what :meth:`put_many` returns. The windowed producer's tool::

            await q.prepare()
            waits = collections.deque()
            for batch in batches:
                if len(waits) == window:
                    await waits.popleft()()
                waits.append(q.start_put_many(batch))
        """
        first = self._take_seqs(len(bodies), first_seq)
        dumps = cbor2.dumps
        wait = self._bus.start_call(
            self.group,
            "put_many",
            {
                "queue": self.name,
                "producer": self.producer,
                "first_seq": first,
                "bodies": [dumps(b) for b in bodies],
            },
        )

        async def result() -> dict[str, int]:
            return dict(await wait())

        return result

    def start_put_encoded(
        self,
        encoded: Sequence[bytes],
        seqs: Sequence[int],
        *,
        producer: str | None = None,
        timeout: float | None = None,
        after: int | None = None,
    ) -> Callable[[], Awaitable[dict[str, int]]]:
        """Send already CBOR-encoded bodies with explicit producer seqs, now and
        synchronously; ``await wait()`` gives the counts :meth:`put_many` returns. The
        forwarder's tool (a link between brokers): a message keeps the identity it was
        put with, so the next queue recognises a resend.

        Args:
            encoded: CBOR bytes per message (``QueueMessage.raw``).
            seqs: strictly increasing positive producer seqs, one per body.
            producer: the producer name (default this handle's).
            timeout: the request's deadline (the broker's ``request_timeout`` if None);
                ``wait()`` then raises ``RequestTimeout``, also when the broker itself
                stopped answering (one second later).
            after: the seq of this producer's previous message: the queue refuses the
                put (``RemoteError`` code ``out-of-order``, nothing accepted) unless that
                one arrived. Pipelined puts need it: one overtaking a failed earlier put
                would otherwise make the earlier messages look like duplicates.

        Raises:
            UsageError: ``seqs`` do not match ``encoded`` or do not increase.
        """
        seq_list = list(seqs)
        if len(seq_list) != len(encoded) or any(
            a >= b for a, b in zip([0, *seq_list], seq_list, strict=False)
        ):
            raise UsageError("seqs must be strictly increasing positive integers, one per body")
        params: dict[str, Any] = {
            "queue": self.name,
            "producer": producer or self.producer,
            "seqs": seq_list,
            "bodies": list(encoded),
        }
        if after is not None:
            params["after"] = after
        wait = self._bus.start_call(self.group, "put_many", params, timeout=timeout)

        async def result() -> dict[str, int]:
            return dict(await wait())

        return result

    async def put(self, body: Any, *, seq: int | None = None) -> str:
        """Put one message; returns when it is durable (``"stored"``), consumed before it
        was written (``"consumed"``), or recognised as a resend (``"duplicate"``).

        ``seq`` is the producer sequence number (positive, increasing per producer);
        default the next one of this handle. Concurrent puts on one handle are sent in
        the order their seqs were taken.
        """
        if seq is None:
            await self.prepare()
        else:
            await self._ensure_declared()
        return await self.start_put(body, seq=seq)()

    async def send(
        self,
        body: Any,
        attachments: Sequence[bytes | memoryview] = (),
        *,
        anycast: bool = False,
        seq: int | None = None,
    ) -> str:
        """Send a one-way message to the group this queue is bound to (``bind``), with a
        producer ack: returns once it is durable (``"stored"``), taken by the members
        before it was written (``"consumed"``), or recognised as a resend
        (``"duplicate"``, deduplicated by this handle's ``producer`` and ``seq``, across
        plugin restarts). The members receive it exactly as if it had been sent with
        ``bus.send(group, body, attachments)`` (``group[?]`` with ``anycast``): one-way,
        from this client, ``via`` the queue.

        ``seq``: as in :meth:`put` (the same producer's seqs are shared by puts and
        sends).

        Raises:
            RemoteError: ``bad-request`` if the queue is not bound to a group (use
                :meth:`put`), others as :meth:`put`.
        """
        if seq is None:
            await self.prepare()
            seq = self._take_seqs(1, None)
        else:
            await self._ensure_declared()
        params: dict[str, Any] = {
            "queue": self.name,
            "producer": self.producer,
            "seq": seq,
            "body": cbor2.dumps(body),
        }
        if anycast:
            params["anycast"] = True
        return str(await self._bus.call(self.group, "send", params, attachments=attachments))

    async def put_many(
        self, bodies: Sequence[Any], *, first_seq: int | None = None
    ) -> dict[str, int]:
        """Put ``bodies`` in one frame and one commit; returns ``{"stored", "consumed",
        "duplicates"}`` counts once all of them are durable or consumed. Messages get the
        seqs ``first_seq``, ``first_seq + 1``... (default: this handle's next ones).
        """
        if first_seq is None:
            await self.prepare()
        else:
            await self._ensure_declared()
        return await self.start_put_many(bodies, first_seq=first_seq)()

    def consume(
        self, window: int = 1, *, ack_timeout: float | None = None, ids: bool = False
    ) -> Consumer:
        """Push consumer with ``window`` unacked deliveries at most (window 1: one at a
        time). ``ack_timeout`` overrides the queue's. ``ids``: each message also carries
        its producer name and producer seq (``QueueMessage.producer``, ``producer_seq``),
        for a forwarder that must put it elsewhere under the same identity. One consumer
        per queue and bus."""
        return Consumer(self, window, ack_timeout, ids)

    async def fetch(self, n: int = 1, *, ack_timeout: float | None = None) -> list[QueueMessage]:
        """Pull up to ``n`` ready messages now (possibly none); ack each within
        ``ack_timeout`` (default the queue's) or it is redelivered."""
        await self._ensure_declared()
        params: dict[str, Any] = {"queue": self.name, "n": n}
        if ack_timeout is not None:
            params["ack_timeout"] = ack_timeout
        rows = await self._bus.call(self.group, "fetch", params)
        if not (
            isinstance(rows, list)
            and all(isinstance(r, list) and len(r) == 3 and isinstance(r[1], bytes) for r in rows)
        ):
            raise RemoteError(
                f"the queue plugin answered fetch with {rows!r:.100}, not rows",
                code=ErrorCode.PROTOCOL_ERROR.value,
            )
        return QueueMessage._many(
            _Delivery(self._bus, self.name, None),
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
        )

    async def ack(self, messages: Sequence[QueueMessage]) -> int:
        """Ack fetched ``messages`` in one request; returns how many were still owed."""
        ids = [m.id for m in messages if not m._done]
        for m in messages:
            m._done = True
        return int(await self._bus.call(self.group, "ack", {"queue": self.name, "ids": ids}))

    async def stats(self) -> dict[str, Any]:
        """The queue's statistics (docs/QUEUE.md, "Statistics")."""
        return dict(await self._bus.call(self.group, "stats", {"queue": self.name}))
