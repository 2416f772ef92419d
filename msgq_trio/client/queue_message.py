"""A delivered message of the queue client (:class:`QueueMessage`) and the constants the
queue client shares with the queue plugin (its group, its delivery command, the
refusal code) and uses itself (ack batching, fairness, the close bound). No event loop
(``tests/test_layering.py``)."""

from __future__ import annotations

import io
import logging
from typing import TYPE_CHECKING, Any

import cbor2

from ..errors import (
    MalformedMessage,
)

if TYPE_CHECKING:
    from .queue_bus import QueueBus as Bus
    from .queue_bus import Settler


__all__ = ["DEFAULT_GROUP", "QueueMessage"]

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


def _group(_bus: Bus) -> str:
    return DEFAULT_GROUP


class _Delivery:
    """What every message of one delivery (or one fetch) shares: a message points at its
    delivery instead of holding five fields of its own (a consumer makes one message
    object per message, so each field costs per message)."""

    __slots__ = ("bus", "consumer", "gen", "queue")

    def __init__(self, bus: Bus, queue: str, consumer: Settler | None) -> None:
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

    __slots__ = ("_d", "_done", "_origin", "_raw", "_trace", "_value", "deliveries", "id")

    _d: _Delivery
    _done: bool
    #: (producer, producer seq) for ``consume(ids=True)``, else None
    _origin: tuple[str, int] | None
    _raw: bytes
    #: the W3C traceparent it was put with (a traced put), else None
    _trace: str | None
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
        traces: list[str | None] | None = None,
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
            m._trace = traces[i] if traces is not None else None
            append(m)
        return out

    @property
    def queue(self) -> str:
        return self._d.queue

    @property
    def trace_header(self) -> dict[str, object]:
        """The trace context the message was put with, as a header
        (``{"traceparent": ...}``; empty for an untraced put): ``with
        msgq_trio.client.tracing.continued(m.trace_header):`` processes it in its trace,
        so what the block sends belongs to that trace (docs/PROTOCOL.md, "Trace
        context"). With OpenTelemetry it names the consumer span of its delivery."""
        return {"traceparent": self._trace} if self._trace else {}

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
