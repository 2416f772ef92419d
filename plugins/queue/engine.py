"""The queue engine: group commit to the store, delivery, redelivery, paging.

Rules (docs/QUEUE.md states them for users):

1. Ack 1 (the producer's answer) is given when the message is durable (its commit
   returned) or when a consumer acked it (ack 2) before it was written; then it is never
   written ("writes skipped"). A duplicate is answered once everything that arrived
   before it has been flushed, so its original is durable (or consumed) by then.
2. Group commit: one task (``flush_loop``) takes everything pending when the previous
   commit has finished (at most ``max_batch``; after ``max_delay`` if set) and hands it to
   the store thread as ONE job: deletes, delivery-count increments, dead-letter moves,
   then one ``append_batch``. Deletes go first so a full map gets room before appends.
   Before choosing, it runs the deferred dispatches, so a message a consumer with credit
   is about to get is in flight. With a consumer online, a message in flight for less
   than ``ack_grace`` is left for a later commit (its ack may come first: then it is
   never written), and so are its producer's later messages (the store needs each
   producer's messages in producer order, rule 4); everything else is taken at once.
3. A message's life: READY -> INFLIGHT (delivered, owned by one consumer) -> DONE (acked
   or removed), INFLIGHT -> READY (nack, consumer gone, ack deadline) with its delivery
   count (redelivered before anything never delivered, in arrival order), or -> DEAD
   (max deliveries) -> moved to the dead-letter queue once stored.
4. Deduplication: per (queue, producer) the highest producer seq accepted; the first put
   of a producer in this run waits for its durable high-water mark from the store, so a
   resend after a crash is recognised even if a consumer is online (no skip-write of a
   duplicate). A message consumed before it was written raises that mark in the store
   with a later commit (``_take_marks``; never past an earlier message of the same
   producer still waiting for its commit, which the store would then drop): the next
   one, or while young in-flight messages hold the commit back, one at most
   ``ack_grace`` after the mark began waiting.
5. Storage full: every message of the failed append is removed and its producer gets
   ``queue-full``; deletes still run, so the queue works again once drained.
6. Memory: each queue holds at most ``resident_messages`` / ``resident_bytes`` in memory
   (ready, in flight, waiting for a commit). Past them the queue *spills*: new messages
   wait for their commit in ``pending`` only and then leave memory; ``_refill`` reads
   stored messages back in seq order as consumers take them, skipping those memory
   holds and those acked but not yet deleted, and ends spilling once a read reached the
   end of the store with nothing spilled waiting for its commit. Start-up reads each
   queue's counts, not its messages (``recover``).

Everything here runs on the trio thread except the store calls (``StoreThread``); no store
call spans an await, none holds a read transaction after it returns.
"""

from __future__ import annotations

import heapq
import logging
import os
from collections import deque
from collections.abc import Iterable
from typing import Any

import trio
from msgq_trio.storage.api import NewMessage, QueueStore, StorageError, StorageFull

from .metrics import Histogram
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
from .writer import StoreThread

_new_tuple = tuple.__new__
_new_object = object.__new__

log = logging.getLogger("msgq_trio.plugins.queue")


class Engine:
    """All queues of one plugin process.

    Args:
        store: the open store (used on ``thread`` only).
        thread: the store thread.
        settings: the plugin's settings.
    """

    def __init__(self, store: QueueStore, thread: StoreThread, settings: QueueSettings) -> None:
        self.store = store
        self.thread = thread
        self.settings = settings
        self.queues: dict[str, Queue] = {}
        self.pending: deque[Msg] = deque()
        self.producers: dict[tuple[str, str], Producer] = {}
        self.deliver: Deliver = lambda q, c, msgs: None
        self._dirty: set[Queue] = set()
        self.nursery: trio.Nursery | None = None
        # Delivery ids start at a random point: an ack for a delivery of an earlier
        # plugin process (a consumer that did not see the restart yet) must not match a
        # message this process delivered.
        self._next_mid = int.from_bytes(os.urandom(5), "big") << 16
        self._wake = trio.Event()
        self._changed = trio.Event()  # an ack, nack or put: the grace wait looks again
        self._flushing = False
        self._flushed_mid = 0  # every message with a lower mid was flushed or skipped
        self._dup_waiters: list[tuple[int, DupCount]] = []
        #: (queue, producer) -> highest producer seq consumed without being written and
        #: not yet recorded in the store (``_take_marks``)
        self._consumed: dict[tuple[str, str], int] = {}
        #: when the marks waiting in ``_consumed`` end the grace wait (``_grace``)
        self._marks_due: float | None = None
        #: (queue, producer) -> its messages in ``pending``: once every producer there
        #: has a young message in flight, nothing more can be committed, and the grace
        #: wait and the commit stop scanning (``_left_pending`` keeps it exact)
        self._pending_keys: dict[tuple[Queue, str], int] = {}
        self.counters = dict.fromkeys(
            ("commits", "fsyncs", "batches", "batch_max", "batch_sum", "storage_full"), 0
        )
        self.last_batch = 0
        #: seconds per store commit (``flush_loop``), for the metrics endpoint (metrics.py)
        self.commit_seconds = Histogram()

    # -- queues ---------------------------------------------------------------------------
    async def recover(self) -> None:
        """Open every stored queue: its counts come from the store's metadata (one
        lookup per queue), its messages stay on disk and are paged in when a consumer
        wants them, so start-up takes the same time whatever the backlog. Call once,
        before serving."""
        names = await self.thread.run(self.store.queues)
        for name in names:
            q = self.queues.get(name) or self._new_queue(name, QueueOptions())
            st = await self.thread.run(self.store.stats, name)
            q.live, q.bytes = st.depth, st.bytes
            q.spilled = st.depth > 0
            if q.live:
                log.info("queue %s: %d messages (%d bytes) stored", name, q.live, q.bytes)

    def _new_queue(self, name: str, opts: QueueOptions) -> Queue:
        q = Queue(name, opts, self.settings.ack_grace)
        self.queues[name] = q
        return q

    async def declare(self, name: str, opts: QueueOptions | None) -> bool:
        """Declare ``name`` durably (and its dead-letter queue); ``opts`` None keeps the
        current options. Returns True if the store created it.

        Raises:
            ValueError: bad name (from the store).
            StorageError: the store failed.
        """
        q = self.queues.get(name)
        created: bool = await self.thread.run(self.store.declare_queue, name)
        if q is None:
            q = self._new_queue(name, opts or QueueOptions())
        elif opts is not None:
            q.opts = opts
            q.grace = self.settings.ack_grace if opts.ack_grace is None else opts.ack_grace
        if q.opts.max_deliveries:
            dlq = q.opts.dlq_name(name)
            if dlq == name:
                raise ValueError(f"queue {name!r} cannot be its own dead-letter queue")
            if dlq not in self.queues:
                await self.declare(dlq, None)
        return created

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
            assert self.nursery is not None
            self.nursery.start_soon(self._load_producer, q, producer, p)
        if p.hwm is None:
            p.held.append((items, waiter, after))
            return
        self._accept(q, producer, p, items, waiter, after)

    async def _load_producer(self, q: Queue, producer: str, p: Producer) -> None:
        try:
            hwm: int = await self.thread.run(self.store.producer_state, q.name, producer)
        except StorageError as exc:
            log.error("queue %s: cannot read producer %r's state: %s", q.name, producer, exc)
            for _items, waiter, _after in p.held:
                waiter.fail("internal-error", f"store failed: {exc}")
            self.producers.pop((q.name, producer), None)
            return
        p.hwm = hwm
        held, p.held = p.held, []
        for items, waiter, after in held:
            self._accept(q, producer, p, items, waiter, after)

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
        # of Msg.__init__ set here without its call (a third of the loop's time).
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

    def _kick(self) -> None:
        self._wake.set()
        self._changed.set()

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
        if len(self._dirty) == 1 and self.nursery is not None:
            self.nursery.start_soon(self._dispatch_dirty)

    async def _dispatch_dirty(self) -> None:
        self.dispatch_pending()

    def dispatch_pending(self) -> None:
        """Run the dispatches ``dispatch`` deferred, now (the commit calls this before it
        chooses its batch, so a message a consumer with credit is about to get is in
        flight, not taken for one nobody holds)."""
        dirty, self._dirty = self._dirty, set()
        for q in dirty:
            self.dispatch_now(q)

    def dispatch_now(self, q: Queue) -> None:
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
        now = trio.current_time()
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
    def refill_soon(self, q: Queue) -> None:
        """Page in ``q``'s next stored messages in the background (one at a time per
        queue); deliveries follow when they arrive."""
        if q.refilling is None and q.spilled and self.nursery is not None:
            q.refilling = trio.Event()
            self.nursery.start_soon(self._refill, q)

    async def refill(self, q: Queue) -> None:
        """Page in ``q``'s next stored messages (if it has any on disk only) and return
        once that read is done."""
        self.refill_soon(q)
        if q.refilling is not None:
            await q.refilling.wait()

    async def _refill(self, q: Queue) -> None:
        """One page-in: read the stored messages from ``q.disk_next`` on, as many as
        ``resident_*`` leave room for (at most ``PAGE`` per read), into ``ready`` in seq
        order.

        Skips what memory holds already (stored while not spilled, redeliveries) and
        what was acked but whose delete is not committed (reading on past them). Each
        read runs on the store thread after every commit submitted before it, in one
        short read transaction, so it sees every message those commits stored. Ends
        spilling when it read to the end of the stored messages and nothing was spilled
        meanwhile (new messages then go to memory again, after these)."""
        done = q.refilling
        assert done is not None
        admitted = 0
        settings = self.settings
        try:
            while q.spilled:
                room = min(PAGE, settings.resident_messages - q.resident)
                if q.live:
                    # bodies of this queue's average size that fit in the bytes bound
                    room = min(
                        room,
                        (settings.resident_bytes - q.resident_bytes) // max(1, q.bytes // q.live),
                    )
                if room <= 0 or admitted >= PAGE:
                    return  # memory is full of this queue's messages: acks make room
                epoch, unstored = q.spill_epoch, q.unstored_spilled
                try:
                    chunk = await self.thread.run(self.store.read_range, q.name, q.disk_next, room)
                except StorageError as exc:
                    log.error("queue %s: cannot read stored messages: %s (will retry)", q.name, exc)
                    await trio.sleep(0.1)
                    return
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
                    return
        finally:
            q.stats["paged_in"] += admitted
            q.refilling = None
            done.set()
            # Nothing read: the next page-in comes from the next commit (it stores what
            # was spilled) or ack (it makes room), not from this dispatch in a loop.
            if admitted:
                self.dispatch(q)

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
        self._changed.set()
        if m.seq is not None:
            q.deletes.append(m.seq)
            q.deleting.add(m.seq)
            self._kick()
        elif not m.in_batch:
            q.stats["writes_skipped"] += 1
            # Never written: its producer seq goes to the store as a mark instead, so a
            # resend after a crash is still a duplicate (rule 4).
            key = (q.name, m.producer)
            if m.pseq > self._consumed.get(key, 0):
                self._consumed[key] = m.pseq
                self._kick()
        w, m.waiter = m.waiter, None
        if w is not None:
            w.one("consumed", answer)
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
        # Waiters are told once per batch with their count (a put_many of 500 acked in
        # one batch costs one call, not 500), and the queue's counts change once
        # (``Queue.forget`` for the whole batch: a delivered message is never spilled).
        waiters: dict[Waiter, int] = {}
        last_w: Waiter | None = None
        last_k = 0
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
                if m.producer != last_p:
                    if last_p is not None:
                        kick |= _raise_mark(consumed, (name, last_p), last_high)
                    last_p, last_high = m.producer, 0
                last_high = max(last_high, m.pseq)
            w = m.waiter
            if w is not None:
                m.waiter = None
                if w is last_w:
                    last_k += 1
                else:
                    if last_w is not None:
                        waiters[last_w] = waiters.get(last_w, 0) + last_k
                    last_w, last_k = w, 1
        if last_p is not None:
            kick |= _raise_mark(consumed, (name, last_p), last_high)
        if last_w is not None:
            waiters[last_w] = waiters.get(last_w, 0) + last_k
        q.live -= acked
        q.resident -= acked
        q.bytes -= nbytes
        q.resident_bytes -= nbytes
        for w, k in waiters.items():
            w.consumed_n(k)
        q.stats["acked"] += acked
        q.stats["writes_skipped"] += skipped
        self._changed.set()
        if kick:
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
        self._changed.set()  # no longer in flight: the commit need not wait for it
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

    async def reaper(self) -> None:
        """Check ack deadlines four times per shortest ack timeout (at most every
        second): a deadline is kept within 25 % (deliveries to bound-group members use
        the broker's request deadline instead)."""
        while True:
            period = min(
                [1.0]
                + [
                    c.ack_timeout / 4
                    for q in self.queues.values()
                    for c in (*q.fetchers.values(), *q.consumers.values())
                ]
            )
            await trio.sleep(period)
            self.expire(trio.current_time())

    # -- group commit ---------------------------------------------------------------------
    def _has_work(self) -> bool:
        if self.pending:
            return True
        return self._store_work()

    def _store_work(self) -> bool:
        """Something other than new messages waits for a commit."""
        return bool(self._consumed) or any(
            q.deletes or q.incr or q.to_dlq for q in self.queues.values()
        )

    def _take_marks(self, waiting: Iterable[Msg]) -> dict[tuple[str, str], int]:
        """The marks of consumed, never written messages that can go to the store now:
        a producer's mark may not pass a message of its own still waiting for a commit
        (the store would take that one for a resend and drop it), so it stops below the
        lowest such one and the rest waits for a later commit. ``waiting``: the messages
        left in ``pending`` by this commit."""
        if not self._consumed:
            return {}
        low: dict[tuple[str, str], int] = {}
        consumed = self._consumed
        need = len(consumed)
        # ``waiting`` is in arrival order, in which each producer's seqs rise (a seq at
        # or below its high-water mark is dropped as a duplicate on arrival): a
        # producer's first message found is its lowest, and the scan ends once every
        # producer with a mark has one.
        for m in waiting:
            if m.state == DONE:
                continue
            key = (m.queue.name, m.producer)
            if key in consumed and key not in low:
                low[key] = m.pseq
                if len(low) == need:
                    break
        marks: dict[tuple[str, str], int] = {}
        for key, high in list(consumed.items()):
            below = low.get(key)
            if below is None or below > high:
                marks[key] = high
                del consumed[key]
            elif below > 1:
                marks[key] = below - 1
        return marks

    async def flush_loop(self) -> None:
        """Commit forever (rule 2); see the module docstring."""
        max_batch = self.settings.max_batch
        max_delay = self.settings.max_delay
        while True:
            if not self._has_work():
                self._wake = trio.Event()
                await self._wake.wait()
            if max_delay:
                await trio.sleep(max_delay)
            # Deliver first what arrived since the last dispatch: a message a consumer with
            # credit is about to get must be in flight (and so wait for its ack) before the
            # batch is chosen, or it is written although its ack comes a moment later.
            self.dispatch_pending()
            # Only a message delivered but not yet written can be skipped: without any
            # consumer there is nothing to wait for (and no pending list to scan).
            # Each queue has its own grace (a link's queue waits for a downstream round
            # trip); ``grace`` is True if any queue with a consumer has one.
            grace = any((q.consumers or q.by_id) and q.grace > 0 for q in self.queues.values())
            if grace:
                await self._grace()
                if not self._has_work():
                    continue
            take: list[Msg] = []
            pending = self.pending
            now = trio.current_time()
            held: list[Msg] = []  # left for a later commit, in pending order
            wake = float("inf")  # when the first young in-flight message's grace ends
            # (queue, producer) with a young message held back: its later messages are
            # held too. The store deduplicates by each producer's high-water mark, so a
            # producer's messages must reach it in producer order: one committed after
            # a later one would be taken for a resend and dropped (rule 4).
            blocked: set[tuple[Queue, str]] = set()
            dropped: list[Msg] = []
            need = len(self._pending_keys)
            while pending and len(take) < max_batch:
                if blocked and len(blocked) == need:
                    break  # every producer pending waits for a young message: all held
                m = pending.popleft()
                if m.state == DONE:
                    dropped.append(m)
                    continue  # acked before it was written: skipped
                if grace and m.state == INFLIGHT and now - m.sent < m.queue.grace:
                    held.append(m)  # its consumer may still ack it: next commit
                    blocked.add((m.queue, m.producer))
                    wake = min(wake, m.sent + m.queue.grace)
                elif blocked and (m.queue, m.producer) in blocked:
                    held.append(m)
                else:
                    take.append(m)
            pending.extendleft(reversed(held))
            self._left_pending(dropped)
            self._left_pending(take)
            items = take
            for m in items:
                m.in_batch = True
            # What this commit leaves in pending: the held messages, and past max_batch
            # the rest (only then is pending longer than what was held).
            marks = self._take_marks(held if len(pending) == len(held) else pending)
            self._marks_due = None
            if (
                not items
                and not marks
                and not any(q.deletes or q.incr or q.to_dlq for q in self.queues.values())
            ):
                # Only young in-flight messages (and what waits behind them) pending:
                # wait for an ack, a nack, a put, or the oldest one's grace to end.
                self._flushed_mid = self.pending[0].mid - 1 if self.pending else self._next_mid - 1
                if held:
                    with trio.move_on_at(wake):
                        self._changed = trio.Event()
                        await self._changed.wait()
                continue
            # tuple.__new__: the named tuple without its Python-level __new__ (half the
            # cost, once per message committed).
            new = [
                _new_tuple(NewMessage, (m.queue.name, m.producer, m.pseq, m.data)) for m in items
            ]
            deletes: dict[str, list[int]] = {}
            incr: dict[str, list[int]] = {}
            moves: dict[str, tuple[str, list[Msg]]] = {}
            for q in self.queues.values():
                if q.deletes:
                    deletes[q.name], q.deletes = q.deletes, []
                if q.incr:
                    incr[q.name], q.incr = q.incr, []
                if q.to_dlq:
                    ready = [m for m in q.to_dlq if m.seq is not None]
                    q.to_dlq = [m for m in q.to_dlq if m.seq is None and m.state == DEAD]
                    if ready:
                        moves[q.name] = (q.opts.dlq_name(q.name), ready)
            move_seqs = {
                name: (dlq, [m.seq for m in ms if m.seq is not None])
                for name, (dlq, ms) in moves.items()
            }
            self._flushing = True
            started = trio.current_time()  # the commit's latency: commit_seconds
            try:
                res = await self.thread.run(self._commit, new, deletes, incr, move_seqs, marks)
            finally:
                self._flushing = False
            self.commit_seconds.observe(trio.current_time() - started)
            if res["seqs"] is None and marks:
                for key, high in marks.items():  # not written: the next commit tries
                    self._consumed[key] = max(high, self._consumed.get(key, 0))
            self._apply(items, res, deletes, incr, moves)
            if res["errors"] or res["full"] is not None or res.get("error"):
                await trio.sleep(0.1)  # failed store calls are retried, not in a busy loop

    async def final_commit(self) -> dict[str, int]:
        """On a graceful stop, after ``flush_loop`` ended: commit at once, without the
        grace, everything the store does not have yet -- every message pending and not
        acked (delivered or not), every mark of a consumed message never written, every
        delete of an acked stored message and every delivery-count increment -- so that
        a restart neither redelivers an acked message nor takes a consumed one's resend
        for new (rule 4), and a producer's resend of a put it was not answered for is
        recognised as a duplicate. A commit the loop had on the store thread when it
        was cancelled ran to its end and was applied (``StoreThread.run`` is not
        cancellable, and everything after it up to the loop's next checkpoint is
        synchronous), so nothing taken for it is lost here. The engine is not used
        after it.

        Returns the counts written (``messages``, ``marks``, ``deletes``).

        Raises:
            StorageError: the store refused the commit (the caller logs it: what was
                not written behaves as after a crash, at least once).
        """
        items = [m for m in self.pending if m.state != DONE]
        new = [_new_tuple(NewMessage, (m.queue.name, m.producer, m.pseq, m.data)) for m in items]
        marks, self._consumed = dict(self._consumed), {}
        deletes: dict[str, list[int]] = {}
        incr: dict[str, list[int]] = {}
        for q in self.queues.values():
            if q.deletes:
                deletes[q.name], q.deletes = q.deletes, []
            if q.incr:
                incr[q.name], q.incr = q.incr, []
        counts = {
            "messages": len(new),
            "marks": len(marks),
            "deletes": sum(len(seqs) for seqs in deletes.values()),
        }
        if not (new or marks or deletes or incr):
            return counts
        res = await self.thread.run(self._commit, new, deletes, incr, {}, marks)
        errors = [*res["errors"], *([res["full"]] if res["full"] else [])]
        if res.get("error"):
            errors.append(res["error"])
        if errors:
            raise StorageError("; ".join(errors))
        return counts

    def _left_pending(self, msgs: list[Msg]) -> None:
        """``msgs`` left ``pending``: uncount them from ``_pending_keys`` (one update per
        run of one producer's messages, which is how they arrive)."""
        keys = self._pending_keys
        last_q: Queue | None = None
        last_p = ""
        run = 0
        for m in msgs:
            if m.queue is last_q and m.producer == last_p:
                run += 1
                continue
            if last_q is not None:
                _uncount(keys, (last_q, last_p), run)
            last_q, last_p, run = m.queue, m.producer, 1
        if last_q is not None:
            _uncount(keys, (last_q, last_p), run)

    async def _grace(self) -> None:
        """Hold the commit while everything pending is a message in flight to a consumer
        for less than its queue's grace (an ack in that time means it is never written:
        the consumer has it, so the disk is not needed). Returns as soon as anything
        else needs a commit (a message no consumer holds, one held longer, deletes...);
        the commit then leaves out the young in-flight ones (and their producers' later
        messages). Drops acked messages from ``pending`` on the way."""
        while True:
            self.dispatch_pending()
            pending = self.pending
            # Acks come mostly in order: dropping the acked head is enough here (the
            # commit drops the others as it meets them).
            if pending and pending[0].state == DONE:
                gone = []
                while pending and pending[0].state == DONE:
                    gone.append(pending.popleft())
                self._left_pending(gone)
            if any(q.deletes or q.incr or q.to_dlq for q in self.queues.values()):
                return
            if not pending and not self._consumed:
                return
            now = trio.current_time()
            wake = float("inf")
            if self._consumed:
                # Marks alone end the wait one ``ack_grace`` after they began waiting, not
                # at once: under a steady stream of skipped writes a commit per mark
                # would cost a scan of ``pending`` and an fsync per commit for nothing
                # the producers wait for (their acks went out with the consumer's).
                due = self._marks_due
                if due is None:
                    due = self._marks_due = now + self.settings.ack_grace
                if now >= due:
                    return
                wake = due
            # Only each producer's first message counts: if it is young in flight, the
            # later ones wait for it (rule 4), whatever their state.
            need = len(self._pending_keys)
            seen: set[tuple[Queue, str]] = set()
            last_q: Queue | None = None
            last_p = ""
            for m in pending:
                state = m.state
                if state == DONE:
                    continue
                q, p = m.queue, m.producer
                if q is last_q and p == last_p:
                    continue  # a run of one producer's messages: decided by its first
                last_q, last_p = q, p
                key = (q, p)
                if key in seen:
                    continue
                end = m.sent + q.grace
                if state != INFLIGHT or now >= end:
                    return
                seen.add(key)
                wake = min(wake, end)
                if len(seen) == need:
                    break
            with trio.move_on_at(wake):
                self._changed = trio.Event()
                await self._changed.wait()

    def _commit(
        self,
        new: list[NewMessage],
        deletes: dict[str, list[int]],
        incr: dict[str, list[int]],
        moves: dict[str, tuple[str, list[int]]],
        marks: dict[tuple[str, str], int],
    ) -> dict[str, Any]:
        """One group commit, on the store thread (rule 2). Never raises for storage
        errors: reports them so the trio side decides what to retry."""
        store = self.store
        out: dict[str, Any] = {"fsyncs": 0, "errors": []}
        failed: dict[str, Any] = {"deletes": {}, "incr": {}, "moves": {}}
        for name, seqs in deletes.items():
            try:
                if store.delete_batch(name, seqs):
                    out["fsyncs"] += 1
            except StorageError as exc:
                failed["deletes"][name] = seqs
                out["errors"].append(f"delete from {name}: {exc}")
        for name, seqs in incr.items():
            try:
                if store.increment_delivery(name, seqs):
                    out["fsyncs"] += 1
            except StorageError as exc:
                failed["incr"][name] = seqs
                out["errors"].append(f"delivery counts of {name}: {exc}")
        moved: dict[str, dict[int, int]] = {}
        for name, (dlq, seqs) in moves.items():
            try:
                moved[name] = store.move_to_dead_letter(name, seqs, dlq)
                out["fsyncs"] += 1
            except StorageError as exc:
                failed["moves"][name] = True
                out["errors"].append(f"dead-letter move from {name}: {exc}")
        out["moved"] = moved
        out["seqs"] = None
        out["full"] = None
        if new or marks:
            try:
                out["seqs"] = store.append_batch(new, marks)
                if marks or any(s is not None for s in out["seqs"]):
                    out["fsyncs"] += 1
            except StorageFull as exc:
                out["full"] = str(exc)
            except StorageError as exc:
                out["full"] = None
                out["error"] = str(exc)
        out["failed"] = failed
        return out

    def _apply(
        self,
        items: list[Msg],
        res: dict[str, Any],
        deletes: dict[str, list[int]],
        incr: dict[str, list[int]],
        moves: dict[str, tuple[str, list[Msg]]],
    ) -> None:
        c = self.counters
        c["commits"] += 1
        c["fsyncs"] += res["fsyncs"]
        for err in res["errors"]:
            log.error("queue store: %s (will retry)", err)
        failed = res["failed"]
        for name, seqs in deletes.items():
            if name not in failed["deletes"]:
                self.queues[name].deleting.difference_update(seqs)
        for name, seqs in failed["deletes"].items():
            self.queues[name].deletes.extend(seqs)
        for name, seqs in failed["incr"].items():
            self.queues[name].incr.extend(seqs)
        for name, (dlq, ms) in moves.items():
            q = self.queues[name]
            if name in failed["moves"]:
                q.to_dlq.extend(ms)
                continue
            mapping = res["moved"].get(name, {})
            target = self.queues[dlq]
            for m in ms:
                assert m.seq is not None
                new_seq = mapping.get(m.seq)
                m.state = DONE
                q.forget(m)
                q.stats["dead_lettered"] += 1
                if new_seq is None:
                    continue  # it was not stored any more (acked meanwhile)
                target.live += 1
                target.bytes += len(m.data)
                if (
                    not target.spilled
                    and target.resident < self.settings.resident_messages
                    and target.resident_bytes < self.settings.resident_bytes
                ):
                    target.admit(
                        Msg(
                            self._mid(),
                            target,
                            m.data,
                            m.producer,
                            m.pseq,
                            new_seq,
                            m.deliveries,
                            None,
                        )
                    )
                else:
                    target.spilled = True  # it is stored: a page-in reads it
                log.warning(
                    "queue %s: message %d moved to %s after %d deliveries",
                    name,
                    m.pseq,
                    dlq,
                    m.deliveries,
                )
            self.dispatch(target)
        if items:
            if res.get("error") or res["full"] is not None:
                self._refuse(items, res["full"] or res.get("error", ""), bool(res["full"]))
            else:
                seqs = res["seqs"]
                n = 0
                # Waiters are told once per commit with their count (a put_many of 1,000
                # costs one call, not 1,000); a put's messages are consecutive, so the
                # count runs in locals until the waiter changes. The same for the
                # queue's "stored" count.
                stored_by: dict[Waiter, int] = {}
                last_w: Waiter | None = None
                last_k = 0
                stored_q: Queue | None = None
                stored_k = 0
                for m, seq in zip(items, seqs, strict=True):
                    m.in_batch = False
                    q = m.queue
                    if seq is None:
                        # A resend of a message stored before a restart: drop this copy.
                        q.stats["duplicates"] += 1
                        if m.state != DONE:
                            self._release(q, m)
                            m.state = DONE
                            q.forget(m)
                        w, m.waiter = m.waiter, None
                        if w is not None:
                            w.one("duplicate")
                        continue
                    n += 1
                    m.seq = seq
                    if q is not stored_q:
                        if stored_q is not None:
                            stored_q.stats["stored"] += stored_k
                        stored_q, stored_k = q, 0
                    stored_k += 1
                    if m.spilled:
                        # Stored: it leaves memory; a page-in reads it back in its turn.
                        m.spilled = False
                        q.unstored_spilled -= 1
                        q.resident -= 1
                        q.resident_bytes -= len(m.data)
                    elif m.state == DONE:
                        q.deletes.append(seq)  # acked while its commit ran
                        q.deleting.add(seq)
                    else:
                        q.mem[seq] = m  # READY, in flight, or DEAD (moved next commit)
                    w, m.waiter = m.waiter, None
                    if w is not last_w:
                        if last_w is not None:
                            stored_by[last_w] = stored_by.get(last_w, 0) + last_k
                        last_w, last_k = w, 0
                    last_k += 1
                if last_w is not None:
                    stored_by[last_w] = stored_by.get(last_w, 0) + last_k
                if stored_q is not None:
                    stored_q.stats["stored"] += stored_k
                for w, k in stored_by.items():
                    w.stored_n(k)
                if n:
                    c["batches"] += 1
                    c["batch_sum"] += n
                    c["batch_max"] = max(c["batch_max"], n)
                    self.last_batch = n
        # Every message below the oldest still pending was flushed or skipped.
        self._flushed_mid = self.pending[0].mid - 1 if self.pending else self._next_mid - 1
        if self._dup_waiters:
            still = []
            for mark, dw in self._dup_waiters:
                if mark <= self._flushed_mid or not self.pending:
                    dw.resolve()
                else:
                    still.append((mark, dw))
            self._dup_waiters = still
        for q in self.queues.values():
            self.dispatch(q)

    def _refuse(self, items: list[Msg], why: str, full: bool) -> None:
        """The append failed: remove its messages, tell their producers (rule 5)."""
        self.counters["storage_full"] += full
        code = "queue-full" if full else "internal-error"
        log.error("queue store refused %d messages: %s", len(items), why)
        for m in items:
            m.in_batch = False
            q = m.queue
            q.stats["refused_full"] += 1
            # Its producer may resend it: forget the high-water mark (reloaded from the
            # store on the next put), so that resend is not taken for a duplicate.
            # Known limit (docs/QUEUE.md): a later message of the same producer held
            # back in flight (ack grace) and committed after it raises the store's mark
            # above the resend, which the store then drops as a duplicate; needs a full
            # store and a consumer holding that producer's messages at once.
            self.producers.pop((q.name, m.producer), None)
            if m.state != DONE:
                self._release(q, m)
                m.state = DONE
                q.forget(m)
            w, m.waiter = m.waiter, None
            if w is not None:
                w.fail(code, f"queue {q.name!r} cannot store the message: {why}")

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

    # -- operator commands ----------------------------------------------------------------
    async def purge(self, q: Queue) -> int:
        """Remove every message of ``q`` that no consumer holds and that is not waiting
        for its commit; return how many (the ``purge`` command, plugins/queue/admin.py).

        Kept: messages in flight (push, fetch, bound-group member; their ack or nack
        works as before), moving to the dead-letter queue, and not stored yet (their
        producer still waits for ack 1: removing them would leave it unanswered).
        Messages put while the purge runs may be removed or kept.

        Removed, durably when this returns: ready stored messages in memory (marked
        DONE, forgotten, deleted from the store), and every message only on disk
        (paged-out backlog), read page by page from ``disk_next`` and deleted in chunks
        of at most 10,000. ``live``/``bytes`` drop by exactly what was removed (the sizes
        read), so they stay right although commits run meanwhile; the store's own depth
        would also count acked messages whose delete is not committed yet.

        Each store call is one short job on the store thread; no read transaction spans
        an await. Page-ins of ``q`` wait meanwhile (the purge holds ``q.refilling``), so
        a message found only on disk stays only on disk until its delete: it cannot
        reach a consumer first. A page read is used only if no commit's results arrived
        between its read and its use other than the one that ran before it (a commit
        stores messages into memory under seqs the page already shows): else it is read
        again.

        Raises:
            StorageError: a store call failed; what was removed before stays removed and
                counted (stored messages already forgotten are deleted by the next
                commits).
        """
        chunk_max = 10_000  # seqs per delete_batch: bounds one write transaction
        while q.refilling is not None:  # a page-in or another purge of q is running
            await q.refilling.wait()
        q.refilling = hold = trio.Event()
        store, name = self.store, q.name
        removed = 0

        async def delete(seqs: list[int]) -> int:
            n: int = await self.thread.run(store.delete_batch, name, seqs)
            if n:
                self.counters["fsyncs"] += 1  # a durable commit like the flush loop's
            if n != len(seqs):
                log.error(
                    "queue %s: purge deleted %d of %d stored messages (the others "
                    "were gone already)",
                    name,
                    n,
                    len(seqs),
                )
            return n

        try:
            # 1. Ready stored messages in memory: gone from memory at once (no consumer
            # gets them from here on), then from the store.
            seqs: list[int] = []
            for m in [m for m in q.mem.values() if m.state == READY]:
                m.state = DONE
                q.forget(m)
                assert m.seq is not None
                seqs.append(m.seq)
            q.ready = deque(m for m in q.ready if m.state == READY)
            q.again = [(mid, m) for mid, m in q.again if m.state == READY]
            heapq.heapify(q.again)
            removed += len(seqs)
            q.deleting.update(seqs)  # page-ins and peeks skip them until deleted
            for i in range(0, len(seqs), chunk_max):
                part = seqs[i : i + chunk_max]
                try:
                    await delete(part)
                except StorageError:
                    q.deletes.extend(seqs[i:])  # the commits retry them
                    self._kick()
                    raise
                q.deleting.difference_update(part)
            # 2. Messages only on disk (a paged queue's backlog): seqs >= disk_next that
            # memory does not hold (in flight, dead) and that are not being deleted.
            if q.spilled:
                start = q.disk_next
                chosen: list[int] = []
                chosen_bytes = 0
                while True:
                    while True:
                        flushing, commits = self._flushing, self.counters["commits"]
                        page = await self.thread.run(store.read_range, name, start, PAGE)
                        if flushing:  # that commit ran before the read: apply it first
                            while self.counters["commits"] == commits:
                                await trio.lowlevel.checkpoint()
                        if self.counters["commits"] == commits + flushing:
                            break
                    # Memory is now as the page was read: spilled messages waiting for a
                    # commit now were not stored yet then.
                    epoch, unstored = q.spill_epoch, q.unstored_spilled
                    for sm in page:
                        if sm.seq not in q.mem and sm.seq not in q.deleting:
                            chosen.append(sm.seq)
                            chosen_bytes += len(sm.body)
                    if page:
                        start = page[-1].seq + 1
                    end = len(page) < PAGE
                    if chosen and (end or len(chosen) + PAGE > chunk_max):
                        n = await delete(chosen)
                        q.live -= n
                        q.bytes -= chosen_bytes
                        removed += n
                        chosen, chosen_bytes = [], 0
                    if end:
                        break
                # Everything stored below ``start`` is in memory or deleted now.
                q.disk_next = start
                if unstored == 0 and epoch == q.spill_epoch:
                    # Nothing spilled was waiting for its commit when the last page was
                    # read, nor since: no message is only on disk any more.
                    q.spilled = False
        finally:
            q.refilling = None
            hold.set()
            self.dispatch(q)
        return removed


def _uncount(keys: dict[tuple[Queue, str], int], key: tuple[Queue, str], n: int) -> None:
    left = keys[key] - n
    if left > 0:
        keys[key] = left
    else:
        del keys[key]


def _raise_mark(consumed: dict[tuple[str, str], int], key: tuple[str, str], high: int) -> bool:
    """Raise ``key``'s consumed mark to ``high``; True if it rose (the commit has work)."""
    if high > consumed.get(key, 0):
        consumed[key] = high
        return True
    return False
