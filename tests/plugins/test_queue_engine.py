"""The queue engine in-process on the memory store: paging decisions driven step by step
(commits run only when a test starts the flush loop), so each race is taken on purpose."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import trio
from msgq_trio.plugins.queue.model import Consumer, Msg, Queue, Waiter
from msgq_trio.plugins.queue.tasks import Engine
from plugin_helpers import engine_on_memory_store


class Rig:
    """An engine with one queue ``q`` and one push consumer ``c`` whose deliveries are
    recorded (``delivered``) and acked on demand."""

    def __init__(self, engine: Engine, q: Queue, nursery: trio.Nursery) -> None:
        self.engine, self.q, self.nursery = engine, q, nursery
        self.delivered: list[Msg] = []
        self.c = Consumer("c", "push", 1000, 30.0)
        engine.deliver = lambda _q, _c, msgs: self.delivered.extend(msgs)
        self.pseq = 0

    async def put(self, *bodies: bytes) -> Waiter:
        """Put ``bodies`` as producer ``p`` and let the engine take them in (its first
        put of a producer waits for the producer's state from the store)."""
        items = []
        for body in bodies:
            self.pseq += 1
            items.append((self.pseq, b"B" + body))
        w = Waiter(len(items), lambda _w: None)
        self.engine.put(self.q, "p", items, w)
        await trio.testing.wait_all_tasks_blocked(0.05)
        return w

    async def settle(self) -> None:
        """Let every task that can run (dispatches, page-ins, a started commit) run."""
        await trio.testing.wait_all_tasks_blocked(0.05)

    def bodies(self) -> list[bytes]:
        return [m.data[1:] for m in self.delivered]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with engine_on_memory_store() as (engine, nursery):
        yield Rig(engine, engine.queues["q"], nursery)


async def test_spilling_ends_only_when_nothing_spilled_is_waiting_for_its_commit(rig: Rig) -> None:
    """A page-in that finds the end of the stored messages while spilled ones still wait
    for their commit must keep paging; else those would never be read, and later
    messages would overtake them."""
    engine, q = rig.engine, rig.q
    await rig.put(b"1", b"2", b"3", b"4")  # in memory (the bound is 4)
    await rig.put(b"5", b"6")  # spilled, not committed: no flush loop yet
    assert q.spilled and q.unstored_spilled == 2
    engine.add_consumer(q, rig.c)
    await rig.settle()
    assert rig.bodies() == [b"1", b"2", b"3", b"4"]
    for m in rig.delivered:
        engine.ack(m)
    await rig.settle()  # a page-in reads the store: nothing stored
    assert q.spilled, "paging ended although 5 and 6 wait for their commit"
    rig.nursery.start_soon(engine.flush_loop)
    await rig.settle()  # 5, 6 committed, released, paged back in
    await rig.put(b"7")
    await rig.settle()
    assert rig.bodies() == [b"1", b"2", b"3", b"4", b"5", b"6", b"7"]


async def test_page_in_skips_acked_messages_whose_delete_is_not_committed(rig: Rig) -> None:
    """A stored message acked from memory is still in the store until its delete
    commits; a page-in in between must not deliver it again."""
    engine, q = rig.engine, rig.q
    rig.nursery.start_soon(engine.flush_loop)
    await rig.put(b"1", b"2", b"3", b"4")
    await rig.put(b"5", b"6")
    await rig.settle()  # all six stored; 5 and 6 only on disk
    assert q.spilled and q.resident == 4 and q.unstored_spilled == 0
    engine.add_consumer(q, rig.c)
    await rig.settle()
    assert rig.bodies()[:4] == [b"1", b"2", b"3", b"4"]
    first = rig.delivered[:4]
    # Acks without letting the commit run: then a page-in while the deletes wait.
    engine._wake = trio.Event()  # the flush loop sleeps on this: hold it there
    for m in first:
        engine.ack(m)
    assert q.deleting == {m.seq for m in first}
    await rig.settle()
    assert rig.bodies() == [b"1", b"2", b"3", b"4", b"5", b"6"]


class ReadsHeldBack:
    """The engine's store thread, except that a ``read_range`` result reaches its caller
    only once ``release`` is set: as when trio runs the commit that followed the read on
    the thread before the reader's wake-up (it may run them in either order)."""

    def __init__(self, thread: Any) -> None:
        self.thread = thread
        self.release = trio.Event()
        self.read = trio.Event()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        out = await self.thread.run(fn, *args)
        if getattr(fn, "__name__", "") == "read_range":
            self.read.set()
            await self.release.wait()
        return out


async def test_page_read_before_a_delete_committed_is_not_used_after_it(rig: Rig) -> None:
    """A page-in reads a stored message that memory holds in flight; before the page is
    used, the consumer acks that message and the delete's commit is applied. The page
    shows it as stored and no longer being deleted: used as it is, it would be
    delivered a second time (seen with four test workers: eight messages twice)."""
    engine, q = rig.engine, rig.q
    rig.nursery.start_soon(engine.flush_loop)
    await rig.put(b"1", b"2", b"3", b"4")
    await rig.put(b"5", b"6")
    await rig.settle()  # all six stored; 5 and 6 only on disk
    assert q.spilled and q.resident == 4
    engine.add_consumer(q, rig.c)
    await rig.settle()
    m1, _m2, _m3, m4 = rig.delivered
    held = ReadsHeldBack(engine.thread)
    engine.thread = held  # type: ignore[assignment]
    engine.ack(m4)  # room for one: a page-in reads from the start of the store
    with trio.fail_after(10):
        await held.read.wait()
    engine.ack(m1)  # the page (1 and more, in flight then) is now out of date
    await rig.settle()  # 1's delete committed and applied
    assert m1.seq not in q.deleting
    held.release.set()
    await rig.settle()
    assert rig.bodies() == [b"1", b"2", b"3", b"4", b"5", b"6"]


async def test_mark_of_a_consumed_message_never_passes_an_unwritten_earlier_one(rig: Rig) -> None:
    """A message consumed before it was written raises its producer's durable mark, but
    not past an earlier message of that producer still waiting for its commit: the
    store would take that one for a resend and drop it."""
    engine, q, store = rig.engine, rig.q, rig.engine.store
    await rig.put(b"1", b"2")
    engine.add_consumer(q, rig.c)
    await rig.settle()
    m1, m2 = rig.delivered
    engine.ack(m2)  # consumed, never written
    assert engine._take_marks(engine.pending) == {}  # 1 still waits for its commit
    engine.nack(m1)  # redelivered, still unwritten
    rig.nursery.start_soon(engine.flush_loop)
    await rig.settle()
    assert [m.producer_seq for m in store.read_range("q", 0, 10)] == [1]
    assert store.producer_state("q", "p") == 2
    assert engine._consumed == {}


async def test_young_deliveries_hold_back_only_their_own_producer() -> None:
    """While a consumer holds a producer's message within its grace, that producer's
    later messages wait for it, and the mark of one of its messages consumed unwritten
    goes to the store with the next commit (its ack 1 waits for it), up to below the
    message still in flight; another producer's message that no consumer holds is
    committed at once."""
    async with engine_on_memory_store(ack_grace=30) as (engine, nursery):
        q, store = engine.queues["q"], engine.store
        rig = Rig(engine, q, nursery)
        rig.c = Consumer("c", "push", 2, 30.0)
        engine.add_consumer(q, rig.c)
        await rig.put(b"1", b"2", b"3")  # 1 and 2 in flight (window 2), 3 behind them
        nursery.start_soon(engine.flush_loop)
        await rig.settle()
        m1, m2 = rig.delivered
        engine.ack(m1)  # consumed before any commit: its mark goes at once
        await rig.settle()
        assert engine.counters["commits"] == 1
        assert store.producer_state("q", "p") == 1  # the mark, below 2 (in flight)
        assert store.read_range("q", 0, 10) == []
        w = Waiter(1, lambda _w: None)
        engine.put(q, "r", [(1, b"Bx")], w)  # nothing of r's in flight: commit now
        await rig.settle()
        assert w.stored == 1
        assert [m.producer for m in store.read_range("q", 0, 10)] == ["r"]
        assert engine._pending_keys == {(q, "p"): 2}  # 2 (in flight) and 3 still wait
        engine.ack(m2)
        await rig.settle()
        assert rig.delivered[2].data == b"B3"
        assert engine._pending_keys == {(q, "p"): 1}  # 3: in flight now, within its grace


async def test_a_message_acked_while_waiting_for_redelivery_is_not_redelivered(
    rig: Rig,
) -> None:
    """A message given back (its consumer left) waits for redelivery; a late ack (as a
    bound-group member's answer arriving after all) makes it done there, and the next
    consumer gets only the other message."""
    engine, q = rig.engine, rig.q
    engine.add_consumer(q, rig.c)
    await rig.put(b"1")
    m1 = rig.delivered[0]
    engine.remove_consumer("c")  # 1 waits for redelivery
    engine.ack(m1)
    await rig.put(b"2")
    rig.delivered.clear()
    engine.add_consumer(q, Consumer("c2", "push", 10, 30.0))
    await rig.settle()
    assert rig.bodies() == [b"2"]


async def test_final_commit_writes_what_waits_for_the_grace() -> None:
    """On a graceful stop the final commit writes at once what the grace held back:
    messages in flight and unacked are stored, one consumed before it was written
    leaves only its mark (the store's high-water mark covers the producer's last seq).
    Given twice, the store keeps each message once (its producer dedup)."""
    async with engine_on_memory_store(ack_grace=600) as (engine, nursery):
        rig = Rig(engine, engine.queues["q"], nursery)
        store = engine.store
        async with trio.open_nursery() as loop:
            loop.start_soon(engine.flush_loop)
            engine.add_consumer(rig.q, rig.c)
            await rig.put(b"1", b"2", b"3")  # delivered, young: held back by the grace
            _m1, _m2, m3 = rig.delivered
            engine.ack(m3)  # consumed, never written: a mark
            await rig.settle()
            assert store.read_range("q", 0, 10) == []
            assert store.producer_state("q", "p") == 0
            loop.cancel_scope.cancel()
        assert await engine.final_commit() == {"messages": 2, "marks": 1, "deletes": 0}
        assert [m.producer_seq for m in store.read_range("q", 0, 10)] == [1, 2]
        assert store.producer_state("q", "p") == 3  # 3's mark, above what was written
        assert await engine.final_commit() == {"messages": 2, "marks": 0, "deletes": 0}
        assert [m.producer_seq for m in store.read_range("q", 0, 10)] == [1, 2]
