"""The queue plugin's data: a message's life states, the ack-1 bookkeeping of a put
(``Waiter``), one message (``Msg``), a receiver of deliveries (``Consumer``), one queue's
state in the plugin (``Queue``) and one producer's deduplication state (``Producer``).

Plain data with the small operations that keep each object's counts consistent; the
rules that move messages between them are the state machine's (state.py, commit.py).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .settings import QueueOptions

if TYPE_CHECKING:  # a page-in's event; the state machine itself runs without trio
    import trio

__all__ = [
    "DEAD",
    "DONE",
    "INFLIGHT",
    "KIND_BODY",
    "KIND_MESSAGE",
    "KIND_REQUEST",
    "KIND_TRACED",
    "PAGE",
    "READY",
    "TRACEPARENT_LEN",
    "Consumer",
    "Deliver",
    "DupCount",
    "Msg",
    "Producer",
    "Queue",
    "Waiter",
]

READY, INFLIGHT, DONE, DEAD = range(4)

#: Body kinds (first byte of the stored value): a queue-API body (CBOR, as the producer
#: encoded it), a request to a bound group (CBOR [cmd, params]), a one-way message to a
#: bound group (CBOR body).
KIND_BODY, KIND_REQUEST, KIND_MESSAGE = b"B"[0], b"R"[0], b"M"[0]
#: A queue-API body put by a traced request (docs/PROTOCOL.md, "Trace context"): the kind
#: byte, the request's W3C ``traceparent`` (version 00: 55 ASCII characters), then the
#: body as for :data:`KIND_BODY`. Deliveries hand the traceparent to the consumer.
KIND_TRACED = b"T"[0]
TRACEPARENT_LEN = 55


def body_of(data: bytes) -> bytes:
    """The body of a queue-API value (:data:`KIND_BODY` or :data:`KIND_TRACED`)."""
    return data[1 + TRACEPARENT_LEN :] if data[0] == KIND_TRACED else data[1:]


def trace_of(data: bytes) -> str | None:
    """The traceparent a :data:`KIND_TRACED` value was put with, else None."""
    return data[1 : 1 + TRACEPARENT_LEN].decode("ascii") if data[0] == KIND_TRACED else None


def body_prefix(traceparent: object) -> bytes:
    """What a queue-API body is stored after: the kind byte, and the ``traceparent`` of
    the request that put it if it is a valid version-00 one (else it is not kept)."""
    if type(traceparent) is str and len(traceparent) == TRACEPARENT_LEN:
        parts = traceparent.split("-")
        if (
            len(parts) == 4
            and parts[0] == "00"
            and [len(x) for x in parts] == [2, 32, 16, 2]
            and set(traceparent) <= set("0123456789abcdef-")
        ):
            return b"T" + traceparent.encode("ascii")
    return b"B"


#: Most messages one page-in reads: one short read transaction on the store thread, so a
#: commit queued behind it waits little, and enough that paging a backlog takes few reads.
PAGE = 1000


class Waiter:
    """Ack 1 bookkeeping of one put request (one or many messages).

    ``callback(waiter)`` runs once every message is accounted for, or at the first
    failure (``error`` set).
    """

    __slots__ = ("answer", "callback", "consumed", "duplicates", "error", "remaining", "stored")

    def __init__(self, n: int, callback: Callable[[Waiter], None]) -> None:
        self.remaining = n
        self.stored = self.consumed = self.duplicates = 0
        self.error: tuple[str, str] | None = None
        self.answer: Any = None
        self.callback: Callable[[Waiter], None] | None = callback

    def one(self, how: str, answer: Any = None) -> None:
        if how == "stored":
            self.stored += 1
        elif how == "consumed":
            self.consumed += 1
            self.answer = answer
        else:
            self.duplicates += 1
        self.remaining -= 1
        if self.remaining <= 0:
            self._finish()

    def stored_n(self, k: int) -> None:
        """``k`` of its messages are durable."""
        self.stored += k
        self.remaining -= k
        if self.remaining <= 0:
            self._finish()

    def consumed_n(self, k: int) -> None:
        """``k`` of its messages were consumed (acked) before they were written."""
        self.consumed += k
        self.remaining -= k
        if self.remaining <= 0:
            self._finish()

    def fail(self, code: str, message: str) -> None:
        self.error = (code, message)
        self._finish()

    def _finish(self) -> None:
        cb, self.callback = self.callback, None
        if cb is not None:
            cb(self)


class Msg:
    """One message of one queue while the plugin holds it."""

    __slots__ = (
        "data",
        "deadline",
        "deliveries",
        "in_batch",
        "mid",
        "owner",
        "producer",
        "pseq",
        "queue",
        "sent",
        "seq",
        "spilled",
        "state",
        "waiter",
    )

    def __init__(
        self,
        mid: int,
        queue: Queue,
        data: bytes,
        producer: str,
        pseq: int,
        seq: int | None,
        deliveries: int,
        waiter: Waiter | None,
    ) -> None:
        self.mid = mid
        self.queue = queue
        self.data = data
        self.producer = producer
        self.pseq = pseq
        self.seq = seq
        self.deliveries = deliveries
        self.waiter = waiter
        self.state = READY
        self.owner: Consumer | None = None
        self.deadline = 0.0
        self.sent = 0.0  # when its current delivery started
        self.in_batch = False
        #: accepted while its queue pages from the store: it waits for its commit in
        #: ``pending`` only, and leaves memory once stored (read back in seq order later)
        self.spilled = False


class Consumer:
    """A receiver of deliveries: a push consumer (``consume``), a member of a bound group,
    or a fetcher (``fetch``; window unlimited, acks by id, deadline per message)."""

    __slots__ = ("ack_timeout", "ids", "inflight", "kind", "lname", "window")

    def __init__(
        self, lname: str, kind: str, window: int, ack_timeout: float, ids: bool = False
    ) -> None:
        self.lname = lname
        self.kind = kind  # "push", "member" or "fetch"
        self.window = window
        self.ack_timeout = ack_timeout
        self.inflight = 0
        #: deliveries carry each message's producer name and producer seq (a link to
        #: another broker forwards them, so the next queue deduplicates resends)
        self.ids = ids


class Queue:
    """The in-memory state of one durable queue."""

    def __init__(self, name: str, opts: QueueOptions, default_grace: float) -> None:
        self.name = name
        self.opts = opts
        #: the effective ack grace (the queue's option, else the plugin's setting)
        self.grace = default_grace if opts.ack_grace is None else opts.ack_grace
        #: messages never delivered, in arrival (= mid) order
        self.ready: deque[Msg] = deque()
        #: messages given back for redelivery, a heap by mid: they go out before
        #: ``ready`` and in their original order however their nacks arrive (a link's
        #: give-back comes in several ``nack`` messages, refused delivery batches one by
        #: one; putting each at the front would send later messages first, and the next
        #: queue, deduplicating by each producer's highest seq, would take the earlier
        #: ones for resends and drop them)
        self.again: list[tuple[int, Msg]] = []
        self.consumers: dict[str, Consumer] = {}
        self.fetchers: dict[str, Consumer] = {}
        #: mid -> message in flight to a push consumer or a fetcher (acked by id, with a
        #: deadline); deliveries to bound-group members are requests and are not here.
        self.by_id: dict[int, Msg] = {}
        self.rr = 0
        #: messages and body bytes of the queue, in memory or only on disk
        self.live = 0
        self.bytes = 0
        #: messages (and their bytes) this queue holds in memory: ready, given back, in
        #: flight, or waiting for their commit. Bounded by the ``resident_*`` settings:
        #: past them new messages are spilled (kept only until stored)
        self.resident = 0
        self.resident_bytes = 0
        #: stored messages exist that are not in memory: ready messages are paged in from
        #: the store in seq order (``Engine.refill``), and new ones are spilled so they
        #: come after them
        self.spilled = False
        #: the next seq a page-in reads from (every live stored message below it is in
        #: memory, or was acked and its delete is not committed yet)
        self.disk_next = 0
        #: seq -> stored live message held in memory: a page-in skips them
        self.mem: dict[int, Msg] = {}
        #: seqs acked whose delete is not committed yet: a page-in skips them too
        self.deleting: set[int] = set()
        #: spilled messages not committed yet, and a count of spills: a page-in that found
        #: the end of the stored messages ends spilling only if neither changed meanwhile
        self.unstored_spilled = 0
        self.spill_epoch = 0
        self.refilling: trio.Event | None = None
        self.deletes: list[int] = []
        self.incr: list[int] = []
        self.to_dlq: list[Msg] = []
        self.stats = dict.fromkeys(
            (
                "put",
                "stored",
                "writes_skipped",
                "duplicates",
                "acked",
                "delivered",
                "redelivered",
                "dead_lettered",
                "refused_full",
                "out_of_order",
                "paged_in",
            ),
            0,
        )

    def backlog(self) -> int:
        """Messages waiting for a delivery (some may be done already: skipped when
        taken)."""
        return len(self.ready) + len(self.again)

    def take(self) -> Msg | None:
        """The waiting message with the lowest mid (redeliveries first: every message
        ever delivered arrived before every one still in ``ready``), or None."""
        again, ready = self.again, self.ready
        if again and (not ready or again[0][0] < ready[0].mid):
            return heapq.heappop(again)[1]
        return ready.popleft() if ready else None

    def give_back(self, m: Msg) -> None:
        """``m`` (READY again) waits for redelivery in its original order."""
        heapq.heappush(self.again, (m.mid, m))

    def inflight(self) -> int:
        members = sum(c.inflight for c in self.consumers.values() if c.kind == "member")
        return members + len(self.by_id)

    def admit(self, m: Msg) -> None:
        """``m`` (READY) enters memory at the end of ``ready``."""
        self.ready.append(m)
        self.resident += 1
        self.resident_bytes += len(m.data)
        if m.seq is not None:
            self.mem[m.seq] = m

    def forget(self, m: Msg) -> None:
        """``m`` is done (acked, dropped as a duplicate, refused, moved): it leaves the
        queue's counts and memory."""
        self.live -= 1
        self.bytes -= len(m.data)
        self.resident -= 1
        self.resident_bytes -= len(m.data)
        if m.seq is not None:
            self.mem.pop(m.seq, None)
        if m.spilled:
            m.spilled = False
            self.unstored_spilled -= 1


class Producer:
    """Deduplication state of one (queue, producer): None until the store answered."""

    __slots__ = ("held", "hwm")

    def __init__(self) -> None:
        self.hwm: int | None = None
        self.held: list[tuple[list[tuple[int, bytes]], Waiter, int | None]] = []


#: ``deliver(queue, consumer, msgs)``: start delivering ``msgs`` (in queue order) to one
#: consumer; the service sends the frames and later calls ``ack``/``nack``.
Deliver = Callable[[Queue, Consumer, list[Msg]], None]


class DupCount:
    """Answers ``n`` duplicates of one waiter at once when resolved."""

    __slots__ = ("n", "waiter")

    def __init__(self, waiter: Waiter, n: int) -> None:
        self.waiter = waiter
        self.n = n

    def resolve(self) -> None:
        for _ in range(self.n):
            self.waiter.one("duplicate")
