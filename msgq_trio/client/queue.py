"""Client side of the durable queues of the queue plugin (docs/QUEUE.md).

``bus.queue(name)`` returns a :class:`Queue`. Producers ``put``/``put_many`` and get the
answer when the messages are durable (ack 1); consumers ``consume`` (push, credit window)
or ``fetch`` (pull) and ``ack`` each message (ack 2).

One implementation for every asynchronous driver (the trio ``Bus`` and the asyncio
``AioBus``): the protocol logic here (requests, producer seqs, the window and ack
batching, re-attach after a plugin restart) is written against the part of
:class:`~msgq_trio.client.async_bus.AsyncBus`'s public API that
:class:`~msgq_trio.client.queue_bus.QueueBus` names (calls, inline commands and
notifications, ``start_soon``, ``sleep``, ``checkpoint``, ``new_event``, ``shielded``,
``wait_lost``) and a :class:`~msgq_trio.client.mailbox.Mailbox`. It imports no event
loop and no driver (``tests/test_layering.py``).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import cbor2

from ..errors import RemoteError, UsageError
from ..protocol.codes import ErrorCode
from .queue_consumer import Consumer
from .queue_message import DEFAULT_GROUP, QueueMessage, _Delivery
from .tracing import delivered_traces, producing

if TYPE_CHECKING:
    from .queue_bus import QueueBus as Bus

__all__ = ["DEFAULT_GROUP", "Consumer", "Queue", "QueueMessage"]


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
        with producing():  # (a PRODUCER span when traced with OpenTelemetry)
            wait = self._bus.start_call(
                self.group,
                "put",
                {
                    "queue": self.name,
                    "producer": self.producer,
                    "seq": seq,
                    "body": cbor2.dumps(body),
                },
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
        with producing():
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
        traces: Sequence[str | None] | None = None,
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
            traces: the W3C traceparent each message was put with (``QueueMessage.
                trace_header``), or None: the next queue keeps it (a message's trace
                goes on through a link).

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
        if traces is not None and any(traces):
            if len(traces) != len(seq_list):
                raise UsageError("traces must have one entry per body")
            params["traces"] = list(traces)
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
            and all(
                isinstance(r, list) and 3 <= len(r) <= 4 and isinstance(r[1], bytes) for r in rows
            )
        ):
            raise RemoteError(
                f"the queue plugin answered fetch with {rows!r:.100}, not rows",
                code=ErrorCode.PROTOCOL_ERROR.value,
            )
        traces = None
        if any(len(r) == 4 for r in rows):  # traced puts: their traceparents (4th item)
            column = [r[3] if len(r) == 4 else None for r in rows]
            traces = delivered_traces(column, len(rows), f"fetch {self.name}")
        return QueueMessage._many(
            _Delivery(self._bus, self.name, None),
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
            None,
            traces,
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
