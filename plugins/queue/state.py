"""The queue engine's state machine: queues, producers, deliveries, acks, redeliveries.

No trio, no store calls, time passed in (``now``): the trio tasks (tasks.py) feed it puts,
acks, nacks and consumers, run the store calls it decides on, and hand back their results;
the group commit's decisions (what to write, when) are in commit.py. The rules
(docs/QUEUE.md states them for users):

1. Ack 1 (the producer's answer) is given when the message is durable (its commit
   returned) or when a consumer acked it (ack 2) before it was written and its
   producer's mark covering it is durable; then the message is never written ("writes
   skipped"). A duplicate is answered once everything that arrived
   before it has been flushed, so its original is durable (or consumed) by then.
2. Group commit (commit.py): one task takes everything pending when the previous commit
   has finished and hands it to the store thread as ONE job; a message in flight to a
   consumer for less than ``ack_grace`` is left for a later commit (its ack may come
   first: then it is never written), and so are its producer's later messages.
3. A message's life: READY -> INFLIGHT (delivered, owned by one consumer) -> DONE (acked
   or removed), INFLIGHT -> READY (nack, consumer gone, ack deadline) with its delivery
   count (redelivered before anything never delivered, in arrival order), or -> DEAD
   (max deliveries) -> moved to the dead-letter queue once stored.
4. Deduplication: per (queue, producer) the highest producer seq accepted; the first put
   of a producer in this run waits for its durable high-water mark from the store, so a
   resend after a crash is recognised even if a consumer is online (no skip-write of a
   duplicate). A message consumed before it was written raises that mark in the store
   with the next commit (``_consumed``, taken by commit.py; never past an earlier message
   of the same producer still waiting for its commit, which the store would then drop),
   and its ack 1 ("consumed") is sent once that mark is durable (``_mark_waits``): a
   resend of a message its producer got ack 1 for is a duplicate, whatever crashed.
5. Storage full: every message of the failed append is removed and its producer gets
   ``queue-full``; deletes still run, so the queue works again once drained.
6. Memory: each queue holds at most ``resident_messages`` / ``resident_bytes`` in memory
   (ready, in flight, waiting for a commit). Past them the queue *spills*: new messages
   wait for their commit in ``pending`` only and then leave memory; page-ins
   (``page_room``, ``admit_page``) read stored messages back in seq order as consumers
   take them, skipping those memory holds and those acked but not yet deleted, and end
   spilling once a read reached the end of the store with nothing spilled waiting for its
   commit. Start-up reads each queue's counts, not its messages.

What needs the trio side is asked through the hooks at the top of ``QueueState``
(``_kick``, ``_note_change``, ``_schedule_dispatch``, ``_load_producer_soon``,
``refill_soon``), which the driver (tasks.py) implements.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections import deque
from typing import Any

from msgq_trio.storage.api import StoredMessage

from .model import (
    DEAD,
    DONE,
    INFLIGHT,
    PAGE,
    READY,
    Consumer,
    Deliver,
    DupCount,
    Msg,
    Producer,
    Queue,
    Waiter,
)
from .settings import QueueOptions, QueueSettings

__all__ = ["QueueState"]

_new_object = object.__new__

log = logging.getLogger("msgq_trio.plugins.queue")


class QueueState:
    """All queues of one plugin process, as data.

    Args:
        settings: the plugin's settings.
    """

    def __init__(self, settings: QueueSettings) -> None:
        self.settings = settings
        self.queues: dict[str, Queue] = {}
        self.pending: deque[Msg] = deque()
        self.producers: dict[tuple[str, str], Producer] = {}
        self.deliver: Deliver = lambda q, c, msgs: None
        self._dirty: set[Queue] = set()
        # Delivery ids start at a random point: an ack for a delivery of an earlier
        # plugin process (a consumer that did not see the restart yet) must not match a
        # message this process delivered.
        self._next_mid = int.from_bytes(os.urandom(5), "big") << 16
        #: a commit is on the store thread (set by the driver around it)
        self._flushing = False
        self._flushed_mid = 0  # every message with a lower mid was flushed or skipped
        self._dup_waiters: list[tuple[int, DupCount]] = []
        #: (queue, producer) -> highest producer seq consumed without being written and
        #: not yet recorded in the store (``GroupCommit._take_marks``)
        self._consumed: dict[tuple[str, str], int] = {}
        #: (queue, producer) -> the acks 1 of its consumed, never written messages:
        #: (highest producer seq, waiter, messages, answer). They are sent once a commit
        #: made a mark covering them durable (``GroupCommit.committed``): a producer
        #: that got its ack 1 and resends anyway (after a crash of this process) is
        #: answered "duplicate" instead of the message being delivered again.
        self._mark_waits: dict[tuple[str, str], list[tuple[int, Waiter, int, Any]]] = {}
        #: (queue, producer) -> the part of its mark in ``_consumed`` already durable,
        #: while an earlier message of it waits for a commit (``_take_marks``)
        self._partial_marks: dict[tuple[str, str], int] = {}
        #: the acks 1 of messages consumed while the commit writing them runs: sent
        #: when it returns (waiter, messages, answer)
        self._commit_waits: list[tuple[Waiter, int, Any]] = []
        #: (queue, producer) -> its messages in ``pending``: once every producer there
        #: has a young message in flight, nothing more can be committed, and the grace
        #: wait and the commit stop scanning (``_left_pending`` keeps it exact)
        self._pending_keys: dict[tuple[Queue, str], int] = {}
        self.counters = dict.fromkeys(
            ("commits", "fsyncs", "batches", "batch_max", "batch_sum", "storage_full"), 0
        )
        self.last_batch = 0

    # -- hooks: what the driver (tasks.py) does for the state machine ---------------------
    def _kick(self) -> None:
        """Work for the commit appeared (a put, a delete, a mark...): wake it."""

    def _note_change(self) -> None:
        """An ack, nack or put: a commit waiting for young in-flight messages looks again."""

    def _schedule_dispatch(self) -> None:
        """Run ``dispatch_pending`` soon (once per scheduler tick)."""

    def _load_producer_soon(self, q: Queue, producer: str, p: Producer) -> None:
        """Read ``producer``'s durable high-water mark in ``q`` from the store, then call
        ``producer_loaded`` (or ``producer_failed``)."""

    def refill_soon(self, q: Queue) -> None:
        """Page in ``q``'s next stored messages in the background (``page_room``,
        ``admit_page``), if it is spilled and no page-in runs."""

    # -- queues ---------------------------------------------------------------------------
    def restore_queue(self, name: str, depth: int, nbytes: int) -> Queue:
        """Start-up: the stored queue ``name`` holds ``depth`` messages of ``nbytes``,
        all on disk (paged in when a consumer wants them)."""
        q = self.queues.get(name) or self._new_queue(name, QueueOptions())
        q.live, q.bytes = depth, nbytes
        q.spilled = depth > 0
        return q

    def _new_queue(self, name: str, opts: QueueOptions) -> Queue:
        q = Queue(name, opts, self.settings.ack_grace)
        self.queues[name] = q
        return q

    def set_options(self, name: str, opts: QueueOptions | None) -> Queue:
        """``name`` was declared: create it with ``opts`` or, if it exists, take ``opts``
        (None keeps the current ones)."""
        q = self.queues.get(name)
        if q is None:
            q = self._new_queue(name, opts or QueueOptions())
        elif opts is not None:
            q.opts = opts
            q.grace = self.settings.ack_grace if opts.ack_grace is None else opts.ack_grace
        return q

    def _mid(self) -> int:
        mid = self._next_mid
        self._next_mid += 1
        return mid

    # -- producing ------------------------------------------------------------------------
    def put(
        self,
        q: Queue,
        producer: str,
        items: list[tuple[int, bytes]],
        waiter: Waiter,
        after: int | None = None,
    ) -> None:
        """Accept ``items`` ((producer seq, stored value) in producer order) into ``q``.

        Synchronous and in call order, so a producer's seqs are seen in the order they
        were sent. ``waiter`` is told about each item (see ``Waiter``).

        ``after``: accept only if this producer's seq ``after`` already arrived here (the
        high-water mark is at least ``after``), else fail the whole put ``out-of-order``
        and accept nothing. A forwarder that pipelines puts sends it, so that a put
        overtaking a failed earlier one cannot raise the mark past messages that never
        arrived (they would be taken for duplicates when resent)."""
        key = (q.name, producer)
        p = self.producers.get(key)
        if p is None:
            p = self.producers[key] = Producer()
            self._load_producer_soon(q, producer, p)
        if p.hwm is None:
            p.held.append((items, waiter, after))
            return
        self._accept(q, producer, p, items, waiter, after)

    def producer_loaded(self, q: Queue, producer: str, p: Producer, hwm: int) -> None:
        """``producer``'s durable high-water mark in ``q`` is ``hwm``: accept its puts
        held meanwhile."""
        p.hwm = hwm
        held, p.held = p.held, []
        for items, waiter, after in held:
            self._accept(q, producer, p, items, waiter, after)

    def producer_failed(self, q: Queue, producer: str, p: Producer, why: str) -> None:
        """``producer``'s high-water mark could not be read: fail its held puts (the next
        put reads it again)."""
        for _items, waiter, _after in p.held:
            waiter.fail("internal-error", f"store failed: {why}")
        self.producers.pop((q.name, producer), None)

    def _accept(
        self,
        q: Queue,
        producer: str,
        p: Producer,
        items: list[tuple[int, bytes]],
        waiter: Waiter,
        after: int | None = None,
    ) -> None:
        hwm = p.hwm
        assert hwm is not None
        if after is not None and hwm < after:
            q.stats["out_of_order"] += 1
            waiter.fail(
                "out-of-order",
                f"queue {q.name!r}: producer {producer!r}'s seq {after} has not arrived "
                f"here (its high-water mark is {hwm}); resend from there",
            )
            return
        dups = nbytes = 0
        mid = self._next_mid
        new: list[Msg] = []
        add = new.append
        # The hot loop of a producer: one Msg per item, nothing else per item; the fields
        # of Msg.__init__ set here without its call (the call is a large share of the loop).
        new_msg = _new_object
        for pseq, data in items:
            if pseq <= hwm:
                dups += 1
                continue
            hwm = pseq
            m = new_msg(Msg)
            m.mid = mid
            m.queue = q
            m.data = data
            m.producer = producer
            m.pseq = pseq
            m.seq = None
            m.deliveries = 0
            m.waiter = waiter
            m.state = READY
            m.owner = None
            m.deadline = m.sent = 0.0
            m.in_batch = m.spilled = False
            add(m)
            mid += 1
            nbytes += len(data)
        self._next_mid = mid
        p.hwm = hwm
        if new:
            self.pending.extend(new)
            key = (q, producer)
            self._pending_keys[key] = self._pending_keys.get(key, 0) + len(new)
        spill = new
        if not q.spilled:
            # As many as the bounds leave room for go to memory, the rest (and, from now
            # on, everything new) is spilled.
            settings = self.settings
            room_n = settings.resident_messages - q.resident
            room_b = settings.resident_bytes - q.resident_bytes
            k = 0
            if room_n >= len(new) and room_b >= nbytes:
                k = len(new)
            else:
                for m in new:
                    room_b -= len(m.data)
                    if k >= room_n or room_b < 0:
                        break
                    k += 1
            if k:
                q.ready.extend(new if k == len(new) else new[:k])
            spill = new[k:] if k < len(new) else []
            if spill:
                q.spilled = True
                log.info(
                    "queue %s: %d messages (%d bytes) in memory: new ones wait on disk",
                    q.name,
                    q.resident + k,
                    q.resident_bytes + nbytes - sum(len(m.data) for m in spill),
                )
        if spill:
            # Kept only until stored: they reach consumers by a page-in, after the
            # stored messages before them.
            for m in spill:
                m.spilled = True
            q.unstored_spilled += len(spill)
            q.spill_epoch += 1
        q.resident += len(new)
        q.resident_bytes += nbytes
        q.live += len(new)
        q.bytes += nbytes
        q.stats["put"] += len(items)
        if dups:
            q.stats["duplicates"] += dups
            if not self.pending and not self._flushing:
                for _ in range(dups):
                    waiter.one("duplicate")
            else:
                # Answered once what arrived before it is flushed (rule 1).
                self._dup_waiters.append((self._next_mid - 1, DupCount(waiter, dups)))
        self._kick()
        self.dispatch(q)

    # -- delivering -----------------------------------------------------------------------
    def add_consumer(self, q: Queue, c: Consumer) -> None:
        """Register ``c`` (replacing one of the same name and kind).

        A forwarder (``ids``) consuming again on the same connection (a link's next
        session) first gets back everything its previous consumer still holds
        (deliveries in transit, that the client will refuse): they are redelivered
        before anything later, so the forwarder sees each producer's messages in order
        (it puts them downstream in the order received; a later seq first would make
        the next queue drop the earlier ones as resends)."""
        if c.kind == "fetch":
            q.fetchers[c.lname] = c
        else:
            if c.ids:
                self.nack_many(
                    [
                        m
                        for m in q.by_id.values()
                        if m.owner is not None
                        and m.owner is not c
                        and m.owner.kind == "push"
                        and m.owner.lname == c.lname
                    ]
                )
            q.consumers[c.lname] = c
        self.dispatch(q)

    def remove_consumer(self, lname: str) -> None:
        """``lname`` left: forget it everywhere; what it held unacked is redelivered
        (deliveries to a bound-group member fail by themselves: recipient-gone)."""
        for q in self.queues.values():
            q.consumers.pop(lname, None)
            q.fetchers.pop(lname, None)
            self.nack_owned(q, lname)

    def nack_owned(self, q: Queue, lname: str) -> None:
        """Redeliver every message of ``q`` that ``lname`` holds unacked (by id)."""
        self.nack_many([m for m in q.by_id.values() if m.owner and m.owner.lname == lname])

    def nack_many(self, msgs: list[Msg]) -> None:
        """Nack several messages (see ``nack``: whatever the order of the calls, they
        are redelivered in their original order)."""
        for m in msgs:
            self.nack(m)

    def dispatch(self, q: Queue) -> None:
        """Deliver soon: acks, puts and nacks of one scheduler tick are coalesced into
        one dispatch, so a consumer gets a batch per tick, not a frame per message."""
        if q in self._dirty:
            return
        self._dirty.add(q)
        if len(self._dirty) == 1:
            self._schedule_dispatch()

    def dispatch_pending(self, now: float) -> None:
        """Run the dispatches ``dispatch`` deferred, now (the commit calls this before it
        chooses its batch, so a message a consumer with credit is about to get is in
        flight, not taken for one nobody holds)."""
        dirty, self._dirty = self._dirty, set()
        for q in dirty:
            self.dispatch_now(q, now)

    def dispatch_now(self, q: Queue, now: float) -> None:
        """Deliver ready messages to consumers with credit: assigned one by one round
        robin, sent as one batch per consumer.

        While more messages are ready than a push consumer has credit for, it gets some
        only once a quarter of its window is free (like a TCP window update): refilling
        each single freed slot would cost a frame per message."""
        backlog = q.backlog()
        if not q.consumers:
            return
        if not backlog:
            if q.spilled and q.refilling is None:
                self.refill_soon(q)
            return
        cons = [
            c
            for c in q.consumers.values()
            if c.kind != "push"
            or (free := c.window - c.inflight) >= backlog
            or free >= max(1, c.window // 4)
        ]
        n = len(cons)
        if not n:
            return
        ready, again = q.ready, q.again
        if n == 1:
            # One consumer (the common case): as many as its credit allows, in one go.
            c = cons[0]
            room = c.window - c.inflight
            msgs: list[Msg] = []
            while room > 0 and (ready or again):
                if again and (not ready or again[0][0] < ready[0].mid):
                    m = heapq.heappop(again)[1]
                else:
                    m = ready.popleft()
                if m.state != READY:
                    continue
                msgs.append(m)
                room -= 1
            if msgs:
                q.rr += len(msgs)
                self._mark_many(q, c, msgs, now)
                self.deliver(q, c, msgs)
            if q.spilled and q.refilling is None and q.backlog() < PAGE // 2:
                self.refill_soon(q)
            return
        idle = 0
        batches: dict[Consumer, list[Msg]] = {}
        while idle < n and (ready or again):
            c = cons[q.rr % n]
            q.rr += 1
            if c.inflight >= c.window:
                idle += 1
                continue
            # Queue.take inlined (the hot loop): redeliveries first, lowest mid first
            if again and (not ready or again[0][0] < ready[0].mid):
                m = heapq.heappop(again)[1]
            else:
                m = ready.popleft()
            if m.state != READY:
                q.rr -= 1  # that consumer did not get anything: keep its turn
                continue
            idle = 0
            self._mark_inflight(q, c, m, now)
            batches.setdefault(c, []).append(m)
        for c, msgs in batches.items():
            self.deliver(q, c, msgs)
        if q.spilled and q.refilling is None and q.backlog() < PAGE // 2:
            self.refill_soon(q)

    # -- paging -----------------------------------------------------------------------
    def page_room(self, q: Queue) -> int:
        """How many messages the next page-in of ``q`` may read: what ``resident_*``
        leave room for (bytes counted at the queue's average size), at most ``PAGE``."""
        settings = self.settings
        room = min(PAGE, settings.resident_messages - q.resident)
        if q.live:
            # bodies of this queue's average size that fit in the bytes bound
            room = min(
                room,
                (settings.resident_bytes - q.resident_bytes) // max(1, q.bytes // q.live),
            )
        return room

    def admit_page(
        self, q: Queue, chunk: list[StoredMessage], room: int, epoch: int, unstored: int
    ) -> tuple[int, bool]:
        """A page-in read ``chunk`` (``room`` asked, from ``q.disk_next`` on) when the
        queue's ``spill_epoch`` was ``epoch`` and ``unstored_spilled`` was ``unstored``:
        admit into ``ready`` what memory does not hold yet (skipping what was acked but
        whose delete is not committed), move ``disk_next`` past it, and end spilling if
        the read reached the end of the store and nothing was spilled meanwhile.

        Returns (messages admitted, whether the read reached the end of the store)."""
        admitted = 0
        mem, deleting = q.mem, q.deleting
        for sm in chunk:
            if sm.seq in mem or sm.seq in deleting:
                continue
            q.admit(
                Msg(
                    self._mid(),
                    q,
                    sm.body,
                    sm.producer,
                    sm.producer_seq,
                    sm.seq,
                    sm.delivery_count,
                    None,
                )
            )
            admitted += 1
        if chunk:
            q.disk_next = chunk[-1].seq + 1
        if len(chunk) < room:
            if unstored == 0 and epoch == q.spill_epoch:
                q.spilled = False
                log.info("queue %s: every stored message is in memory again", q.name)
            return admitted, True
        return admitted, False

    def fetch(self, q: Queue, c: Consumer, n: int, now: float) -> list[Msg]:
        """Take up to ``n`` ready messages for the fetcher ``c`` (ack by id before
        ``now + c.ack_timeout``)."""
        out: list[Msg] = []
        while len(out) < n and (m := q.take()) is not None:
            if m.state != READY:
                continue
            self._mark_inflight(q, c, m, now)
            out.append(m)
        return out

    def _mark_many(self, q: Queue, c: Consumer, msgs: list[Msg], now: float) -> None:
        """``_mark_inflight`` of each of ``msgs`` (READY, in queue order), counted once."""
        again = 0
        for m in msgs:
            m.state = INFLIGHT
            m.sent = now
            m.owner = c
            d = m.deliveries = m.deliveries + 1
            if d > 1:
                again += 1
        if c.kind != "member":
            deadline = now + c.ack_timeout
            by_id = q.by_id
            for m in msgs:
                m.deadline = deadline
                by_id[m.mid] = m
        c.inflight += len(msgs)
        q.stats["delivered"] += len(msgs)
        if again:
            q.stats["redelivered"] += again

    def _mark_inflight(self, q: Queue, c: Consumer, m: Msg, now: float) -> None:
        m.state = INFLIGHT
        m.sent = now
        if c.kind != "member":
            m.deadline = now + c.ack_timeout
            q.by_id[m.mid] = m
        m.owner = c
        m.deliveries += 1
        c.inflight += 1
        q.stats["delivered"] += 1
        if m.deliveries > 1:
            q.stats["redelivered"] += 1

    def ack(self, m: Msg, answer: Any = None) -> None:
        """Ack 2: ``m`` was consumed; remove it (never written if not stored yet)."""
        if m.state == DONE:
            return  # a late or repeated ack
        q = m.queue
        self._release(q, m)
        m.state = DONE
        q.forget(m)
        q.stats["acked"] += 1
        self._note_change()
        w, m.waiter = m.waiter, None
        if m.seq is not None:
            q.deletes.append(m.seq)
            q.deleting.add(m.seq)
            self._kick()
            if w is not None:
                w.one("consumed", answer)
        elif not m.in_batch:
            q.stats["writes_skipped"] += 1
            # Never written: its producer seq goes to the store as a mark instead, so a
            # resend after a crash is still a duplicate (rule 4); its ack 1 waits for
            # that mark's commit.
            key = (q.name, m.producer)
            if m.pseq > self._consumed.get(key, 0):
                self._consumed[key] = m.pseq
            self._kick()
            if w is not None:
                self._mark_waits.setdefault(key, []).append((m.pseq, w, 1, answer))
        elif w is not None:
            self._commit_waits.append((w, 1, answer))  # its commit runs: told after it
        self.dispatch(q)

    def ack_ids(self, q: Queue, lname: str, ids: list[Any]) -> int:
        """Ack 2 of the messages ``ids`` of ``q`` that the consumer ``lname`` holds by
        id, as ``ack`` of each (without an answer), with one wake-up of the commit and
        one dispatch; returns how many it held (an unknown id, one held by another or
        redelivered meanwhile, or given twice, counts nothing). A consumer's acks
        arrive in batches, and this loop is the per-message cost of the path where
        nothing is written."""
        consumed = self._consumed
        by_id = q.by_id
        get = by_id.get
        mem = q.mem
        name = q.name
        kick = False
        acked = skipped = nbytes = 0
        # Waiters wait once per batch with their count (a put_many of 500 acked in one
        # batch costs one entry, not 500), and the queue's counts change once
        # (``Queue.forget`` for the whole batch: a delivered message is never spilled).
        # A waiter here is one of a message not stored yet (a stored one's was told at
        # its commit), and all its messages are of one producer.
        waits: list[tuple[str, int, Waiter, int]] = []
        last_w: Waiter | None = None
        last_k = 0
        last_wp = ""
        last_ws = 0
        last_p: str | None = None
        last_high = 0
        for mid in ids:
            # Held by id means in flight to a push consumer or fetcher (never a member):
            # leaving ``by_id`` is what makes a repeated id count once.
            m = get(mid) if type(mid) is int else None
            if m is None:
                continue
            c = m.owner
            if c is None or c.lname != lname:
                continue
            c.inflight -= 1
            m.owner = None
            del by_id[mid]
            m.state = DONE
            acked += 1
            nbytes += len(m.data)
            seq = m.seq
            if seq is not None:
                mem.pop(seq, None)
                q.deletes.append(seq)
                q.deleting.add(seq)
                kick = True
            elif not m.in_batch:
                skipped += 1
                # A mark instead of a write, as in ``ack``: the highest seq per producer
                # of the batch, kept in locals while one producer's acks run.
                pseq = m.pseq
                if m.producer != last_p:
                    if last_p is not None:
                        kick |= _raise_mark(consumed, (name, last_p), last_high)
                    last_p, last_high = m.producer, pseq
                elif pseq > last_high:  # a comparison, not max(): this runs per message
                    last_high = pseq
            w = m.waiter
            if w is not None:
                m.waiter = None
                if m.in_batch:
                    self._commit_waits.append((w, 1, None))  # told when its commit returns
                elif w is last_w:
                    last_k += 1
                    if m.pseq > last_ws:  # noqa: PLR1730 - a comparison, not max(): per message
                        last_ws = m.pseq
                else:
                    if last_w is not None:
                        waits.append((last_wp, last_ws, last_w, last_k))
                    last_w, last_k, last_wp, last_ws = w, 1, m.producer, m.pseq
        if last_p is not None:
            kick |= _raise_mark(consumed, (name, last_p), last_high)
        if last_w is not None:
            waits.append((last_wp, last_ws, last_w, last_k))
        q.live -= acked
        q.resident -= acked
        q.bytes -= nbytes
        q.resident_bytes -= nbytes
        # Their acks 1 go out once the marks covering them are durable (``ack``).
        mark_waits = self._mark_waits
        for producer, high, w, k in waits:
            mark_waits.setdefault((name, producer), []).append((high, w, k, None))
        q.stats["acked"] += acked
        q.stats["writes_skipped"] += skipped
        self._note_change()
        if kick or skipped:
            self._kick()
        self.dispatch(q)
        return acked

    def nack(self, m: Msg) -> None:
        """A delivery of ``m`` ended without ack: redeliver it before anything never
        delivered, in original (arrival) order among the other redeliveries, or move it
        to the dead-letter queue after ``max_deliveries``.

        The order matters to a link to another broker: the next queue deduplicates by
        each producer's highest seq, so a producer's messages must reach it in order, and
        a link's give-back arrives in several ``nack`` messages (and refused delivery
        batches one by one), in any order."""
        if m.state != INFLIGHT:
            return
        q = m.queue
        self._release(q, m)
        self._note_change()  # no longer in flight: the commit need not wait for it
        if q.opts.max_deliveries and m.deliveries >= q.opts.max_deliveries:
            m.state = DEAD
            q.to_dlq.append(m)
            self._kick()
            return
        m.state = READY
        q.give_back(m)
        if m.seq is not None:
            q.incr.append(m.seq)
            self._kick()
        self.dispatch(q)

    def _release(self, q: Queue, m: Msg) -> None:
        c = m.owner
        if c is not None:
            c.inflight -= 1
            m.owner = None
            if c.kind != "member":
                q.by_id.pop(m.mid, None)

    def expire(self, now: float) -> int:
        """Redeliver messages held by id whose ack deadline passed; returns how many."""
        n = 0
        for q in self.queues.values():
            late = [m for m in q.by_id.values() if m.deadline <= now]
            for m in late:
                if m.owner is not None:
                    log.warning(
                        "queue %s: %s did not ack message %d within %.1f s: redelivering",
                        q.name,
                        m.owner.lname,
                        m.mid,
                        m.owner.ack_timeout,
                    )
            self.nack_many(late)
            n += len(late)
        return n

    def reap_period(self) -> float:
        """How long the reaper sleeps between ``expire`` calls: a quarter of the shortest
        ack timeout of any consumer (at most a second), so a deadline is kept within
        25 %."""
        return min(
            [1.0]
            + [
                c.ack_timeout / 4
                for q in self.queues.values()
                for c in (*q.fetchers.values(), *q.consumers.values())
            ]
        )

    # -- statistics -----------------------------------------------------------------------
    def stats(self, q: Queue) -> dict[str, Any]:
        """A snapshot of ``q``: see docs/QUEUE.md ("Statistics")."""
        c = self.counters
        inflight = q.inflight()
        return {
            "queue": q.name,
            "depth": q.live,
            "bytes": q.bytes,
            "ready": max(0, q.live - inflight - len(q.to_dlq)),
            "in_flight": inflight,
            "resident": q.resident,
            "resident_bytes": q.resident_bytes,
            "paging": q.spilled,
            "consumers": len(q.consumers),
            "ack_grace": q.grace,
            **q.stats,
            "fsyncs": c["fsyncs"],
            "commits": c["commits"],
            "batches": c["batches"],
            "batch_max": c["batch_max"],
            "batch_mean": c["batch_sum"] / c["batches"] if c["batches"] else 0.0,
            "batch_last": self.last_batch,
            "storage_full": c["storage_full"],
            "marks_pending": len(self._consumed),
        }

    def take_ready_stored(self, q: Queue) -> list[int]:
        """Purge, step one: every ready stored message of ``q`` in memory leaves memory
        (no consumer gets it from here on) and is marked being deleted (page-ins skip
        it); returns their seqs, which the caller deletes from the store."""
        seqs: list[int] = []
        for m in [m for m in q.mem.values() if m.state == READY]:
            m.state = DONE
            q.forget(m)
            assert m.seq is not None
            seqs.append(m.seq)
        q.ready = deque(m for m in q.ready if m.state == READY)
        q.again = [(mid, m) for mid, m in q.again if m.state == READY]
        heapq.heapify(q.again)
        q.deleting.update(seqs)  # page-ins and peeks skip them until deleted
        return seqs


def _raise_mark(consumed: dict[tuple[str, str], int], key: tuple[str, str], high: int) -> bool:
    """Raise ``key``'s consumed mark to ``high``; True if it rose (the commit has work)."""
    if high > consumed.get(key, 0):
        consumed[key] = high
        return True
    return False
