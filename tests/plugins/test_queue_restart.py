"""Consumers and producers across a restart of the queue plugin: never silence."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import trio
from plugin_helpers import eventually, put_until_stored, ready_plugin_pid, ready_plugin_pids

import msgq_trio
from msgq_trio.errors import RpcError

Start = Callable[..., Any]


async def test_pending_put_fails_when_the_plugin_dies(queue_broker: Start) -> None:
    """A put the plugin holds when it is killed fails at once with an error (the broker
    fails calls pending on a client that is gone), never waits in silence."""
    b = queue_broker({"k": {}})
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("k")
        await q.declare()
        pid = ready_plugin_pid(b)
        os.kill(pid, signal.SIGSTOP)  # SIGKILL below ends it stopped or not
        failed: list[RpcError] = []

        async def put() -> None:
            try:
                await q.put("lost?")
            except RpcError as exc:
                failed.append(exc)

        async def held_by_plugin() -> bool:
            rows = await p.call("msgq", "clients")
            return any(r["name"] == "msgq-queue" and r["pending_in"] for r in rows)

        with trio.fail_after(20):
            async with trio.open_nursery() as n:
                n.start_soon(put)
                while True:
                    if await held_by_plugin():
                        break
                    await trio.sleep(0.02)
                os.kill(pid, signal.SIGKILL)
        assert len(failed) == 1, failed
        assert failed[0].code == "recipient-gone", failed[0]


async def test_consumed_unwritten_messages_stay_duplicates_after_a_kill(
    queue_broker: Start,
) -> None:
    """Messages a consumer acked before they were written are never stored, but their
    producer seqs are: after a SIGKILL of the broker, resending them is answered
    "duplicate" and the consumer does not get them again."""
    b = queue_broker({"d": {}})
    async with msgq_trio.connect(b.path, "p") as p, msgq_trio.connect(b.path, "c") as c:
        q = p.queue("d", producer="billing")
        got: list[int] = []
        async with c.queue("d").consume(window=8) as consumer, trio.open_nursery() as n:

            async def consume() -> None:
                async for m in consumer:
                    got.append(m.body)
                    await m.ack()

            n.start_soon(consume)
            answers = [await q.put(i, seq=i + 1) for i in range(20)]
            assert answers.count("consumed") >= 15, answers  # the skip path was taken
            await eventually(lambda: len(got) == 20)
            n.cancel_scope.cancel()
        # the marks of the skipped ones reach the store with the next commit
        with trio.fail_after(20):
            while True:
                if not (await q.stats())["marks_pending"]:
                    break
                await trio.sleep(0.02)
    b.kill()
    b2 = queue_broker({"d": {}}, path=b.path)
    async with msgq_trio.connect(b2.path, "p2") as p2:
        q2 = p2.queue("d", producer="billing")
        assert await q2.producer_state() == 20
        assert [await q2.put(i, seq=i + 1) for i in range(20)] == ["duplicate"] * 20
        assert await q2.fetch(5) == []


async def _consume_twenty_unwritten_then(b: Any, stop: Callable[[], Any]) -> None:
    """Producer ``billing`` puts seqs 1..20 on ``d``; a consumer holds seq 1 without
    acking it and acks 2..20 before they are written. The broker runs with a long
    ``ack_grace``, so 1 waits for a commit, and the marks of 2..20 wait too (a mark never
    passes an earlier message of its producer still waiting: checked), and with them
    their acks 1. ``await stop()`` runs then, the consumer still attached."""
    async with msgq_trio.connect(b.path, "p") as p, msgq_trio.connect(b.path, "c") as c:
        q = p.queue("d", producer="billing")
        got: list[int] = []
        async with c.queue("d").consume(window=32) as consumer:
            async with trio.open_nursery() as n:

                async def consume() -> None:
                    async for m in consumer:
                        got.append(m.body)
                        if m.body != 0:
                            await m.ack()

                n.start_soon(consume)
                for i in range(20):
                    q.start_put(i, seq=i + 1)  # answered only at the final commit
                await eventually(lambda: len(got) == 20)
                n.cancel_scope.cancel()
            assert (await q.stats())["marks_pending"] > 0
            await stop()


async def _resends_are_duplicates(path: Any) -> None:
    """Resends of 1..20 are duplicates; only 1 (stored at the stop) is delivered."""
    async with msgq_trio.connect(path, "p2") as p2:
        q2 = p2.queue("d", producer="billing")
        assert await q2.producer_state() == 20
        assert [await q2.put(i, seq=i + 1) for i in range(20)] == ["duplicate"] * 20
        assert [m.body for m in await q2.fetch(5)] == [0]


async def test_a_graceful_broker_stop_commits_the_waiting_marks(queue_broker: Start) -> None:
    """Marks of consumed, never written messages that still wait for a commit (a long
    ``ack_grace``) are committed when the broker stops gracefully (SIGTERM): after the
    restart, resending those messages is answered "duplicate"."""
    b = queue_broker({"d": {}}, ack_grace=600)
    status: list[int] = []

    async def stop() -> None:
        status.append(await trio.to_thread.run_sync(b.stop))

    await _consume_twenty_unwritten_then(b, stop)
    assert status == [0]
    assert "final commit: 1 messages, 1 marks" in b.log()
    b2 = queue_broker({"d": {}}, path=b.path, ack_grace=600)
    await _resends_are_duplicates(b2.path)


async def test_sigterm_to_the_plugin_commits_the_waiting_marks(queue_broker: Start) -> None:
    """The same when only the plugin process gets SIGTERM (as from its supervisor): it
    commits before it exits, and the restarted plugin has the marks."""
    b = queue_broker({"d": {}}, ack_grace=600)

    async def stop() -> None:
        os.kill(ready_plugin_pid(b), signal.SIGTERM)
        await eventually(lambda: len(ready_plugin_pids(b.log())) == 2, timeout=60)

    await _consume_twenty_unwritten_then(b, stop)
    await _resends_are_duplicates(b.path)


async def test_a_broker_sigkill_lets_the_plugin_commit_the_waiting_marks(
    queue_broker: Start,
) -> None:
    """The broker is SIGKILLed while marks wait for a commit: its plugin sees the broker
    gone, makes its final commit and exits; the restarted broker's plugin (which waits
    for the store's lock) has the marks, so resends are answered "duplicate"."""
    b = queue_broker({"d": {}}, ack_grace=600)

    async def stop() -> None:
        b.kill()

    await _consume_twenty_unwritten_then(b, stop)
    b2 = queue_broker({"d": {}}, path=b.path, ack_grace=600)
    await _resends_are_duplicates(b2.path)


async def test_a_reconnecting_consumer_goes_on_after_the_broker_is_killed(
    queue_broker: Start,
) -> None:
    """The broker (and with it the queue plugin) is SIGKILLed and restarted on the same
    socket and store under a push consumer whose bus reconnects: the consumer consumes
    again by itself and every message whose put was answered, before the kill or after
    the restart, is delivered (one delivered but not acked at the kill comes again: the
    consumer sees duplicates, never gaps)."""
    b = queue_broker({"r": {}})
    got: list[int] = []
    policy = msgq_trio.Reconnect(initial_delay=0.05, max_delay=0.5, give_up_after=60)
    async with (
        msgq_trio.connect(b.path, "c", reconnect=policy) as c,
        c.queue("r").consume(window=4) as consumer,
        trio.open_nursery() as n,
    ):

        async def consume() -> None:
            async for m in consumer:
                got.append(m.body)
                await m.ack()

        n.start_soon(consume)
        async with msgq_trio.connect(b.path, "p") as p:
            q = p.queue("r", producer="p1")
            for i in range(50):
                await put_until_stored(q, i, i + 1)
        b.kill()
        # The new broker listens elsewhere until its queue plugin is ready, then its
        # socket is renamed onto the old path: the consumer reconnects only after the
        # plugin announced itself, so consuming again is the reconnect's doing.
        b2 = queue_broker({"r": {}}, path=b.path.with_name("b2.sock"))
        await eventually(lambda: ready_plugin_pids(b2.log()))
        os.rename(b2.path, b.path)
        async with msgq_trio.connect(b.path, "p") as p:
            q = p.queue("r", producer="p1")
            for i in range(50, 100):
                await put_until_stored(q, i, i + 1)
        await eventually(lambda: set(got) == set(range(100)))
        assert c.reconnects == 1
        n.cancel_scope.cancel()


async def test_sigterm_again_and_again_while_the_plugin_stops(queue_broker: Start) -> None:
    """SIGTERMs that keep coming while the plugin stops (a supervisor's stop racing the
    plugin's own end) neither kill it before its final commit nor make it print a
    traceback: it exits 0 after committing, and the supervisor restarts it."""
    b = queue_broker({"d": {}})
    pid = ready_plugin_pid(b)
    done = threading.Event()

    def flood() -> int:
        sent = 0
        # Until the supervisor has reaped it and logged its status: the pid stays the
        # exited plugin's (a zombie) until then, so no other process gets these.
        while not done.is_set():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                break
            sent += 1
            time.sleep(0.0005)
        return sent

    async with trio.open_nursery() as nursery:
        sent: list[int] = []

        async def run_flood() -> None:
            sent.append(await trio.to_thread.run_sync(flood))

        nursery.start_soon(run_flood)
        try:
            log = await trio.to_thread.run_sync(
                lambda: b.log_with("plugin queue exited with status", timeout=60)
            )
        finally:
            done.set()
    assert sent[0] > 1
    assert "plugin queue exited with status 0;" in log, log
    assert f"[{pid}] msgq_trio.plugins.queue: queue plugin: final commit" in log, log
    assert "race condition" not in log and "Traceback" not in log, log
    await eventually(lambda: len(ready_plugin_pids(b.log())) == 2, timeout=60)
