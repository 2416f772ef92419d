"""The trio tasks that drive the queue engine: the group commit, the ack-deadline reaper,
page-ins, start-up and the operator's purge.

The decisions are the state machine's (state.py: deliveries and acks; commit.py: what
each commit writes and when); this layer owns the clock, the waits, the nursery and
the store thread, and runs each store call there (``StoreThread``). No store call spans
an await, none holds a read transaction after it returns.
"""

from __future__ import annotations

import logging

import trio
from msgq_trio.storage.api import QueueStore, StorageError, StoredMessage

from .commit import GroupCommit, store_commit
from .histogram import Histogram
from .model import PAGE, Producer, Queue
from .settings import QueueOptions, QueueSettings
from .writer import StoreThread

__all__ = ["Engine"]

log = logging.getLogger("msgq_trio.plugins.queue")


class Engine(GroupCommit):
    """All queues of one plugin process: the state machine (``GroupCommit``) and the
    tasks that drive it. The plugin's service runs ``flush_loop`` and ``reaper`` in
    ``nursery`` (set before the first put) and ``final_commit`` on a graceful stop.

    Args:
        store: the open store (used on ``thread`` only).
        thread: the store thread.
        settings: the plugin's settings.
    """

    def __init__(self, store: QueueStore, thread: StoreThread, settings: QueueSettings) -> None:
        super().__init__(settings)
        self.store = store
        self.thread = thread
        self.nursery: trio.Nursery | None = None
        self._wake = trio.Event()  # commit work appeared: the idle flush loop sleeps on it
        self._changed = trio.Event()  # an ack, nack or put: the grace wait looks again
        #: seconds per store commit (``flush_loop``), for the metrics endpoint (metrics.py)
        self.commit_seconds = Histogram()

    # -- the state machine's hooks --------------------------------------------------------
    def _kick(self) -> None:
        self._wake.set()
        self._changed.set()

    def _note_change(self) -> None:
        self._changed.set()

    def _schedule_dispatch(self) -> None:
        if self.nursery is not None:
            self.nursery.start_soon(self._dispatch_dirty)

    async def _dispatch_dirty(self) -> None:
        self.dispatch_pending(trio.current_time())

    def _load_producer_soon(self, q: Queue, producer: str, p: Producer) -> None:
        assert self.nursery is not None
        self.nursery.start_soon(self._load_producer, q, producer, p)

    async def _load_producer(self, q: Queue, producer: str, p: Producer) -> None:
        try:
            hwm = await self.thread.run(self.store.producer_state, q.name, producer)
        except StorageError as exc:
            log.error("queue %s: cannot read producer %r's state: %s", q.name, producer, exc)
            self.producer_failed(q, producer, p, str(exc))
            return
        self.producer_loaded(q, producer, p, hwm)

    # -- queues ---------------------------------------------------------------------------
    async def recover(self) -> None:
        """Open every stored queue: its counts come from the store's metadata (one
        lookup per queue), its messages stay on disk and are paged in when a consumer
        wants them, so start-up takes the same time whatever the backlog. Call once,
        before serving."""
        names = await self.thread.run(self.store.queues)
        for name in names:
            st = await self.thread.run(self.store.stats, name)
            q = self.restore_queue(name, st.depth, st.bytes)
            if q.live:
                log.info("queue %s: %d messages (%d bytes) stored", name, q.live, q.bytes)

    async def declare(self, name: str, opts: QueueOptions | None) -> bool:
        """Declare ``name`` durably (and its dead-letter queue); ``opts`` None keeps the
        current options. Returns True if the store created it.

        Raises:
            ValueError: bad name (from the store).
            StorageError: the store failed.
        """
        created = await self.thread.run(self.store.declare_queue, name)
        q = self.set_options(name, opts)
        if q.opts.max_deliveries:
            dlq = q.opts.dlq_name(name)
            if dlq == name:
                raise ValueError(f"queue {name!r} cannot be its own dead-letter queue")
            if dlq not in self.queues:
                await self.declare(dlq, None)
        return created

    # -- paging -----------------------------------------------------------------------
    def refill_soon(self, q: Queue) -> None:
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
        order (``admit_page``).

        Each read runs on the store thread after every commit submitted before it, in one
        short read transaction, so it sees every message those commits stored; it is
        used with memory as it was read (:meth:`read_settled`)."""
        done = q.refilling
        assert done is not None
        admitted = 0
        try:
            while q.spilled:
                room = self.page_room(q)
                if room <= 0 or admitted >= PAGE:
                    return  # memory is full of this queue's messages: acks make room
                try:
                    chunk = await self.read_settled(q.name, q.disk_next, room)
                except StorageError as exc:
                    log.error("queue %s: cannot read stored messages: %s (will retry)", q.name, exc)
                    await trio.sleep(0.1)
                    return
                # Memory is now as the page was read: spilled messages waiting for a
                # commit now were not stored yet then.
                n, end = self.admit_page(q, chunk, room, q.spill_epoch, q.unstored_spilled)
                admitted += n
                if end:
                    return
        finally:
            q.stats["paged_in"] += admitted
            q.refilling = None
            done.set()
            # Nothing read: the next page-in comes from the next commit (it stores what
            # was spilled) or ack (it makes room), not from this dispatch in a loop.
            if admitted:
                self.dispatch(q)

    async def read_settled(self, name: str, start: int, n: int) -> list[StoredMessage]:
        """``store.read_range(name, start, n)``, returned when memory is as the page was
        read: the commit that ran before the read (if one was running) is applied, and
        none that ran after it is, else the page is read again.

        Why: a commit's results (``deleting`` emptied of the seqs it deleted, messages it
        stored given their seqs) reach this task in any order against the read's, as
        trio schedules the two wake-ups. A page read before a delete committed but used
        after its results were applied shows messages acked meanwhile as stored and not
        being deleted: they would be delivered again.

        Raises:
            StorageError: the read failed.
        """
        while True:
            flushing, commits = self._flushing, self.counters["commits"]
            page = await self.thread.run(self.store.read_range, name, start, n)
            if flushing:  # that commit ran before the read: apply it first
                while self.counters["commits"] == commits:
                    await trio.lowlevel.checkpoint()
            if self.counters["commits"] == commits + flushing:
                return page

    # -- ack deadlines --------------------------------------------------------------------
    async def reaper(self) -> None:
        """Check ack deadlines every ``reap_period`` (a deadline is kept within 25 %;
        deliveries to bound-group members use the broker's request deadline instead)."""
        while True:
            await trio.sleep(self.reap_period())
            self.expire(trio.current_time())

    # -- group commit ---------------------------------------------------------------------
    async def flush_loop(self) -> None:
        """Commit forever (rule 2); see commit.py."""
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
            self.dispatch_pending(trio.current_time())
            grace = self.grace_wanted()
            if grace:
                await self._grace()
                if not self._has_work():
                    continue
            batch = self.choose(trio.current_time(), grace)
            if batch.idle:
                if batch.wake is not None:
                    with trio.move_on_at(batch.wake):
                        self._changed = trio.Event()
                        await self._changed.wait()
                continue
            self._flushing = True
            started = trio.current_time()  # the commit's latency: commit_seconds
            try:
                res = await self.thread.run(store_commit, self.store, batch)
            finally:
                self._flushing = False
            self.commit_seconds.observe(trio.current_time() - started)
            self.committed(batch, res)
            if res.failed:
                await trio.sleep(0.1)  # failed store calls are retried, not in a busy loop

    async def _grace(self) -> None:
        """Wait while ``grace_wake`` holds the commit back: until it says commit now, its
        deadline passes, or an ack, nack or put changes what is pending."""
        while True:
            self.dispatch_pending(trio.current_time())
            wake = self.grace_wake(trio.current_time())
            if wake is None:
                return
            with trio.move_on_at(wake):
                self._changed = trio.Event()
                await self._changed.wait()

    async def final_commit(self) -> dict[str, int]:
        """On a graceful stop, after ``flush_loop`` ended: commit at once, without the
        grace, everything the store does not have yet (``final_batch``), so that a
        restart neither redelivers an acked message nor takes a consumed one's resend
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
        batch = self.final_batch()
        counts = {
            "messages": len(batch.new),
            "marks": len(batch.marks),
            "deletes": sum(len(seqs) for seqs in batch.deletes.values()),
        }
        if not (batch.new or batch.marks or batch.deletes or batch.incr):
            self.marks_durable({})  # nothing consumed waits for a mark
            return counts
        res = await self.thread.run(store_commit, self.store, batch)
        errors = [*res.errors, *([res.full] if res.full else [])]
        if res.error:
            errors.append(res.error)
        if errors:
            raise StorageError("; ".join(errors))
        # Its producers may still be connected (a SIGTERM of this process alone).
        self.marks_durable(batch.marks)
        return counts

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
            seqs = self.take_ready_stored(q)
            removed += len(seqs)
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
                    page = await self.read_settled(name, start, PAGE)
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
