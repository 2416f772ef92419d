"""Ack 1 of a message consumed before it was written: sent only once its producer's
durable mark covers it, so a producer that got its ack 1 and resends after a SIGKILL of
the plugin is answered "duplicate" and the consumer does not get the message again."""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio
import trio.testing
from msgq_trio.plugins.queue.model import Consumer, Msg, Waiter
from msgq_trio.storage.api import NewMessage
from msgq_trio.storage.memory import MemoryQueueStore
from plugin_helpers import engine_on_memory_store, eventually, ready_plugin_pid, ready_plugin_pids

import msgq_trio

Start = Callable[..., Any]

N = 200


async def test_consumed_ack1_means_a_resend_after_a_plugin_sigkill_is_a_duplicate(
    queue_broker: Start,
) -> None:
    """A consumer acks every message at once (nothing is written); the producer waits
    for every ack 1 ("consumed"), and at once the plugin is SIGKILLed. The grace is 30 s,
    so nothing but those acks 1 starts a commit: a mark written only with a later commit
    would still be waiting when the kill lands. The restarted plugin answers the resend
    of all of them "duplicate", and the consumer (attached throughout) sees each message
    once: a sentinel put after the resend reaches it with nothing before it."""
    b = queue_broker({"d": {}}, ack_grace=30)
    seen: Counter[int] = Counter()
    async with (
        msgq_trio.connect(b.path, "p") as p,
        msgq_trio.connect(b.path, "c") as c,
        c.queue("d").consume(window=N) as consumer,
        trio.open_nursery() as n,
    ):

        async def consume() -> None:
            async for m in consumer:
                seen[m.body] += 1
                await m.ack()

        n.start_soon(consume)
        q = p.queue("d", producer="billing")
        await q.declare()
        first = await q.put_many(list(range(N)), first_seq=1)
        assert first == {"stored": 0, "consumed": N, "duplicates": 0}, first
        pid = ready_plugin_pid(b)
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda: len(ready_plugin_pids(b.log())) == 2, timeout=60)
        # The producer replays everything (as after a crash of its own): all duplicates.
        again = await q.put_many(list(range(N)), first_seq=1)
        assert again == {"stored": 0, "consumed": 0, "duplicates": N}, again
        assert await q.put(-1, seq=N + 1) in ("stored", "consumed")
        await eventually(lambda: seen[-1] == 1)
        n.cancel_scope.cancel()
    assert sorted(seen) == [-1, *range(N)]
    assert max(seen.values()) == 1, [k for k, v in seen.items() if v > 1][:10]


class _HeldStore(MemoryQueueStore):
    """A memory store whose ``append_batch`` waits until ``release`` is set: the commit
    stays on the store thread while the test acks."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def append_batch(
        self, items: Sequence[NewMessage], marks: Mapping[tuple[str, str], int] | None = None
    ) -> list[int | None]:
        self.entered.set()
        assert self.release.wait(30)
        return super().append_batch(items, marks)


async def test_ack1_of_a_message_acked_while_its_commit_runs_waits_for_that_commit() -> None:
    """A message acked by its consumer while the commit writing it runs is answered
    only when that commit returned (before, a crash would leave the producer with an
    ack 1 for a message neither stored nor marked)."""
    from msgq_trio.plugins.queue.settings import QueueSettings
    from msgq_trio.plugins.queue.tasks import Engine
    from msgq_trio.plugins.queue.writer import StoreThread

    cfg = QueueSettings(dir="unused", ack_grace=0)
    with _HeldStore() as store, StoreThread() as thread:
        engine = Engine(store, thread, cfg)
        delivered: list[Msg] = []
        engine.deliver = lambda _q, _c, msgs: delivered.extend(msgs)
        async with trio.open_nursery() as nursery:
            engine.nursery = nursery
            await engine.declare("q", None)
            q = engine.queues["q"]
            engine.add_consumer(q, Consumer("c", "push", 10, 30.0))
            answered: list[Waiter] = []
            told = trio.Event()

            def done(w: Waiter) -> None:
                answered.append(w)
                told.set()

            w = Waiter(1, done)
            engine.put(q, "p", [(1, b"Bx")], w)
            await trio.sleep(0.05)  # the producer's mark is read from the store
            nursery.start_soon(engine.flush_loop)
            try:
                await trio.to_thread.run_sync(store.entered.wait, 10)
                [m] = delivered
                assert m.in_batch  # its commit is on the store thread
                assert engine.ack_ids(q, "c", [m.mid]) == 1
                await trio.sleep(0.05)
                assert answered == []  # not before its commit returned
            finally:
                store.release.set()
            with trio.fail_after(10):
                await told.wait()
            assert answered == [w] and w.consumed == 1
            assert store.producer_state("q", "p") == 1
            nursery.cancel_scope.cancel()


async def test_ack1_of_consumed_messages_waits_while_an_earlier_one_holds_the_mark() -> None:
    """The mark may not pass an earlier message of the same producer still waiting for
    its commit (held in flight by the grace): a commit writes the mark only below it and
    answers only the messages that mark covers; the acks 1 of later messages consumed
    meanwhile wait (no commit writes the same part again meanwhile), and go out once the
    earlier one is acked and the mark covering all of them is durable."""
    async with engine_on_memory_store(ack_grace=30) as (engine, nursery):
        q, store = engine.queues["q"], engine.store
        delivered: list[Msg] = []
        engine.deliver = lambda _q, _c, msgs: delivered.extend(msgs)
        engine.add_consumer(q, Consumer("c", "push", 10, 30.0))
        answered: list[int] = []
        for seq in (1, 2, 3, 4):
            engine.put(
                q, "p", [(seq, b"B%d" % seq)], Waiter(1, lambda _w, s=seq: answered.append(s))
            )
        nursery.start_soon(engine.flush_loop)
        await trio.testing.wait_all_tasks_blocked(0.05)
        m1, m2, m3, m4 = delivered
        engine.ack_ids(q, "c", [m1.mid, m3.mid, m4.mid])  # 2 still held by the grace
        await trio.testing.wait_all_tasks_blocked(0.05)
        assert store.producer_state("q", "p") == 1  # the mark stops below 2
        assert answered == [1]  # 3 and 4 wait for a mark that covers them
        commits = engine.counters["commits"]
        await trio.sleep(0.2)
        assert engine.counters["commits"] == commits  # that part is not written again
        engine.ack_ids(q, "c", [m2.mid])
        await trio.testing.wait_all_tasks_blocked(0.05)
        assert store.producer_state("q", "p") == 4
        assert sorted(answered) == [1, 2, 3, 4]
        assert store.read_range("q", 0, 10) == []  # nothing but the marks was written
