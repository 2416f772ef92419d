"""The queue engine's group commit: what each commit writes, when, and what its result
changes (rule 2 of state.py). No trio: time passed in, the waits returned as deadlines.

One task (tasks.py, ``Engine.flush_loop``) takes everything pending when the previous
commit has finished (at most ``max_batch``; after ``max_delay`` if set) and hands it to
the store thread as ONE job (``store_commit``): deletes, delivery-count increments,
dead-letter moves, then one ``append_batch``, so many puts share one fsync. Deletes go
first so a full map gets room before appends. Before choosing, the task runs the deferred
dispatches, so a message a consumer with credit is about to get is in flight. With a
consumer online, a message in flight for less than ``ack_grace`` is left for a later
commit (its ack may come first: then it is never written, ``grace_wake``), and so are its
producer's later messages (the store needs each producer's messages in producer order);
everything else is taken at once (``choose``). The marks of messages consumed before
they were written go with the next commit (``_take_marks``): their acks 1 wait for it
(``committed`` sends them), so marks end the grace wait at once; the acks that arrive
while one commit runs share the next one (one fsync for all of them, nothing written
for the messages themselves).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import attrs
from msgq_trio.storage.api import NewMessage, QueueStore, StorageError, StorageFull

from .model import DEAD, DONE, INFLIGHT, Msg, Queue, Waiter
from .state import QueueState

__all__ = ["Batch", "CommitResult", "GroupCommit", "store_commit"]

_new_tuple = tuple.__new__

log = logging.getLogger("msgq_trio.plugins.queue")


@attrs.define
class Batch:
    """One commit's work, taken from the state (``GroupCommit.choose``).

    Attributes:
        items: the messages to append, in ``pending`` order.
        new: ``items`` as the store takes them.
        deletes: queue -> seqs of acked stored messages.
        incr: queue -> seqs whose delivery count rises.
        moves: queue -> (dead-letter queue, stored messages moving there).
        move_seqs: ``moves`` as seqs (what the store thread reads).
        marks: (queue, producer) -> producer seq consumed without being written.
        idle: nothing to commit; wait for a change (an ack, nack or put), or until
            ``wake`` if set (the first young in-flight message's grace ends).
    """

    items: list[Msg] = attrs.Factory(list)
    new: list[NewMessage] = attrs.Factory(list)
    deletes: dict[str, list[int]] = attrs.Factory(dict)
    incr: dict[str, list[int]] = attrs.Factory(dict)
    moves: dict[str, tuple[str, list[Msg]]] = attrs.Factory(dict)
    move_seqs: dict[str, tuple[str, list[int]]] = attrs.Factory(dict)
    marks: dict[tuple[str, str], int] = attrs.Factory(dict)
    idle: bool = False
    wake: float | None = None


@attrs.define
class CommitResult:
    """What one ``store_commit`` did. Storage errors are reported here, never raised, so
    the trio side decides what to retry.

    Attributes:
        fsyncs: durable commits made.
        errors: failed deletes, increments and moves, one line each (retried).
        moved: queue -> {old seq: seq in the dead-letter queue}.
        seqs: ``append_batch``'s answer (None: not run, or it failed).
        full: the append failed for lack of space (why), or None.
        error: the append failed otherwise (why), or None.
        failed_deletes, failed_incr: queue -> the seqs to retry.
        failed_moves: queues whose dead-letter move failed.
    """

    fsyncs: int = 0
    errors: list[str] = attrs.Factory(list)
    moved: dict[str, dict[int, int]] = attrs.Factory(dict)
    seqs: list[int | None] | None = None
    full: str | None = None
    error: str | None = None
    failed_deletes: dict[str, list[int]] = attrs.Factory(dict)
    failed_incr: dict[str, list[int]] = attrs.Factory(dict)
    failed_moves: set[str] = attrs.Factory(set)

    @property
    def failed(self) -> bool:
        """Some store call failed (the commit task pauses before the next one, so
        failed calls are retried, not in a busy loop)."""
        return bool(self.errors) or self.full is not None or self.error is not None


def store_commit(store: QueueStore, batch: Batch) -> CommitResult:
    """One group commit, on the store thread (rule 2): reads only ``batch``'s store-side
    fields (``new``, ``deletes``, ``incr``, ``move_seqs``, ``marks``), never the
    messages the trio thread changes. Never raises for storage errors: reports them."""
    out = CommitResult()
    for name, seqs in batch.deletes.items():
        try:
            if store.delete_batch(name, seqs):
                out.fsyncs += 1
        except StorageError as exc:
            out.failed_deletes[name] = seqs
            out.errors.append(f"delete from {name}: {exc}")
    for name, seqs in batch.incr.items():
        try:
            if store.increment_delivery(name, seqs):
                out.fsyncs += 1
        except StorageError as exc:
            out.failed_incr[name] = seqs
            out.errors.append(f"delivery counts of {name}: {exc}")
    for name, (dlq, seqs) in batch.move_seqs.items():
        try:
            out.moved[name] = store.move_to_dead_letter(name, seqs, dlq)
            out.fsyncs += 1
        except StorageError as exc:
            out.failed_moves.add(name)
            out.errors.append(f"dead-letter move from {name}: {exc}")
    if batch.new or batch.marks:
        try:
            out.seqs = store.append_batch(batch.new, batch.marks)
            if batch.marks or any(s is not None for s in out.seqs):
                out.fsyncs += 1
        except StorageFull as exc:
            out.full = str(exc)
        except StorageError as exc:
            out.error = str(exc)
    return out


class GroupCommit(QueueState):
    """The state machine's commit decisions (see the module docstring); the commit task
    (tasks.py) runs them."""

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
        partial = self._partial_marks
        for key, high in list(consumed.items()):
            below = low.get(key)
            if below is None or below > high:
                marks[key] = high
                del consumed[key]
            elif below - 1 > partial.get(key, 0):
                # Only if it rose since the last one written: the same part again would
                # make every commit cycle a commit (and an fsync) while the earlier
                # message waits.
                marks[key] = below - 1
        return marks

    def grace_wanted(self) -> bool:
        """Whether the commit waits for acks at all: only a message delivered but not yet
        written can be skipped, so without any consumer there is nothing to wait for
        (and no pending list to scan). Each queue has its own grace (a link's queue
        waits for a downstream round trip): True if any queue with a consumer has one."""
        return any((q.consumers or q.by_id) and q.grace > 0 for q in self.queues.values())

    def grace_wake(self, now: float) -> float | None:
        """Hold the commit while everything pending is a message in flight to a consumer
        for less than its queue's grace (an ack in that time means it is never written:
        the consumer has it, so the disk is not needed). Returns None as soon as anything
        else needs a commit (a message no consumer holds, one held longer, deletes, marks
        of consumed messages, whose acks 1 wait for them...):
        commit now; the commit then leaves out the young in-flight ones (and their
        producers' later messages). Else returns when to look again (``inf``: only after
        an ack, nack or put). Drops acked messages from ``pending`` on the way.

        Call after ``dispatch_pending``."""
        pending = self.pending
        # Acks come mostly in order: dropping the acked head is enough here (the
        # commit drops the others as it meets them).
        if pending and pending[0].state == DONE:
            gone = []
            while pending and pending[0].state == DONE:
                gone.append(pending.popleft())
            self._left_pending(gone)
        if any(q.deletes or q.incr or q.to_dlq for q in self.queues.values()):
            return None
        if not pending and not self._consumed:
            return None
        wake = float("inf")
        if self._consumed:
            # Marks end the wait at once: the acks 1 of the consumed messages wait for
            # them. Under a steady stream of skipped writes this is one commit (one
            # small write, one fsync) per commit cycle, shared by every ack that arrived
            # while the previous one ran, not one per message.
            return None
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
                return None
            seen.add(key)
            wake = min(wake, end)
            if len(seen) == need:
                break
        return wake

    def choose(self, now: float, grace: bool) -> Batch:
        """Take the next commit's work out of the state: up to ``max_batch`` pending
        messages (without, if ``grace``, those in flight for less than their queue's
        grace and their producers' later ones), the marks that may go (``_take_marks``),
        the deletes, increments and dead-letter moves. An ``idle`` batch means only
        young in-flight messages (and what waits behind them) are pending.

        Call after ``dispatch_pending`` (and, if ``grace``, once ``grace_wake`` said
        commit now)."""
        max_batch = self.settings.max_batch
        take: list[Msg] = []
        pending = self.pending
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
        if (
            not items
            and not marks
            and not any(q.deletes or q.incr or q.to_dlq for q in self.queues.values())
        ):
            # Only young in-flight messages (and what waits behind them) pending:
            # wait for an ack, a nack, a put, or the oldest one's grace to end.
            self._flushed_mid = self.pending[0].mid - 1 if self.pending else self._next_mid - 1
            return Batch(idle=True, wake=wake if held else None)
        # tuple.__new__: the named tuple without its Python-level __new__, which would
        # run once per message committed.
        new = [_new_tuple(NewMessage, (m.queue.name, m.producer, m.pseq, m.data)) for m in items]
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
        return Batch(items, new, deletes, incr, moves, move_seqs, marks)

    def final_batch(self) -> Batch:
        """On a graceful stop: everything the store does not have yet, without the
        grace -- every message pending and not acked (delivered or not), every mark of a
        consumed message never written, every delete of an acked stored message and
        every delivery-count increment (not the dead-letter moves: a restart redelivers
        and moves those). The state is not used after it."""
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
        return Batch(items, new, deletes, incr, marks=marks)

    def committed(self, batch: Batch, res: CommitResult) -> None:
        """``batch``'s commit returned ``res``: apply it (seqs to the stored messages,
        ack 1 to their producers, dead-letter moves, failed calls queued again)."""
        if res.seqs is None and batch.marks:
            for key, high in batch.marks.items():  # not written: the next commit tries
                self._consumed[key] = max(high, self._consumed.get(key, 0))
        else:
            partial = self._partial_marks
            for key, high in batch.marks.items():
                if key in self._consumed:
                    partial[key] = high  # part of its mark: the rest waits
                else:
                    partial.pop(key, None)
            self.marks_durable(batch.marks)
        waits, self._commit_waits = self._commit_waits, []
        for w, k, answer in waits:  # consumed while their commit ran: it returned
            _consumed_ack(w, k, answer)
        self._apply(batch.items, res, batch.deletes, batch.moves)

    def marks_durable(self, marks: dict[tuple[str, str], int]) -> None:
        """A commit made ``marks`` durable: send the acks 1 of the consumed messages they
        cover. A (queue, producer) no longer in ``_consumed`` has every consumed seq
        durable (its whole mark was taken by this commit or an earlier one); one still
        there had only part taken (``_take_marks``): its seqs up to that part are."""
        mark_waits = self._mark_waits
        if not mark_waits:
            return
        consumed = self._consumed
        for key in list(mark_waits):
            if key not in consumed:
                ready = mark_waits.pop(key)
            else:
                high = marks.get(key)
                if high is None:
                    continue
                waits = mark_waits[key]
                ready = [x for x in waits if x[0] <= high]
                if not ready:
                    continue
                left = [x for x in waits if x[0] > high]
                if left:
                    mark_waits[key] = left
                else:
                    del mark_waits[key]
            for _pseq, w, k, answer in ready:
                _consumed_ack(w, k, answer)

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

    def _apply(
        self,
        items: list[Msg],
        res: CommitResult,
        deletes: dict[str, list[int]],
        moves: dict[str, tuple[str, list[Msg]]],
    ) -> None:
        c = self.counters
        c["commits"] += 1
        c["fsyncs"] += res.fsyncs
        for err in res.errors:
            log.error("queue store: %s (will retry)", err)
        for name, seqs in deletes.items():
            if name not in res.failed_deletes:
                self.queues[name].deleting.difference_update(seqs)
        for name, seqs in res.failed_deletes.items():
            self.queues[name].deletes.extend(seqs)
        for name, seqs in res.failed_incr.items():
            self.queues[name].incr.extend(seqs)
        for name, (dlq, ms) in moves.items():
            q = self.queues[name]
            if name in res.failed_moves:
                q.to_dlq.extend(ms)
                continue
            mapping = res.moved.get(name, {})
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
            if res.error is not None or res.full is not None:
                self._refuse(items, res.full or res.error or "", res.full is not None)
            else:
                got = res.seqs
                assert got is not None  # the append ran and did not fail
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
                for m, seq in zip(items, got, strict=True):
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


def _consumed_ack(w: Waiter, k: int, answer: Any) -> None:
    """Ack 1 "consumed" of ``k`` messages of ``w`` (with a bound request's answer)."""
    if answer is None:
        w.consumed_n(k)
    else:
        w.one("consumed", answer)


def _uncount(keys: dict[tuple[Queue, str], int], key: tuple[Queue, str], n: int) -> None:
    left = keys[key] - n
    if left > 0:
        keys[key] = left
    else:
        del keys[key]
