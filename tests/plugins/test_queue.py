"""The queue plugin end to end: real broker processes running the plugin on real LMDB."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from plugin_helpers import eventually, ready_plugin_pid, ready_plugin_pids

import msgq_trio
from msgq_trio import sync
from msgq_trio.errors import MalformedMessage, QueueFull, RemoteError

Start = Callable[..., Any]


async def test_put_fetch_ack_and_survives_kill(queue_broker: Start, short_tmp: Path) -> None:
    """put returns "stored" once durable; a SIGKILLed broker restarted on the same store
    delivers every stored message, acked ones are gone."""
    b = queue_broker({"jobs": {}})
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("jobs")
        assert await q.put({"n": 0}) == "stored"
        assert await q.put_many([{"n": i} for i in range(1, 10)]) == {
            "stored": 9,
            "consumed": 0,
            "duplicates": 0,
        }
        got = await q.fetch(3)
        assert [m.body for m in got] == [{"n": 0}, {"n": 1}, {"n": 2}]
        assert await q.ack(got) == 3
        st = await q.stats()
        assert st["depth"] == 7 and st["stored"] == 10 and st["fsyncs"] >= 2
        # An ack is answered at once and its delete is made durable by the next group
        # commit; a put answered "stored" was committed with or after it (one commit
        # takes the deletes, then the appends). Without this, a SIGKILL on a busy
        # machine can come first and the acked messages are delivered again.
        assert await q.put({"n": 10}) == "stored"
    b.kill()
    b2 = queue_broker({"jobs": {}}, path=b.path)
    async with msgq_trio.connect(b2.path, "c") as c:
        got = await c.queue("jobs").fetch(100)
        assert [m.body["n"] for m in got] == list(range(3, 11))


async def test_push_round_robin_window_one(queue_broker: Start) -> None:
    """Two consumers with window 1 each hold at most one unacked message and share the
    messages round robin."""
    b = queue_broker({"rr": {}})
    async with (
        msgq_trio.connect(b.path, "p") as p,
        msgq_trio.connect(b.path, "c1") as c1,
        msgq_trio.connect(b.path, "c2") as c2,
    ):
        await p.queue("rr").put_many(list(range(20)))
        seen: dict[str, list[int]] = {"c1": [], "c2": []}
        holding = {"c1": 0, "c2": 0}
        async with c1.queue("rr").consume(window=1) as k1, c2.queue("rr").consume(window=1) as k2:

            async def run(name: str, k: msgq_trio.client.queue.Consumer) -> None:
                async for m in k:
                    holding[name] += 1
                    assert holding[name] == 1, "window 1 exceeded"
                    seen[name].append(m.body)
                    await trio.sleep(0.005)
                    holding[name] -= 1
                    await m.ack()
                    if len(seen["c1"]) + len(seen["c2"]) == 20:
                        nursery.cancel_scope.cancel()

            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(run, "c1", k1)
                    nursery.start_soon(run, "c2", k2)
        assert sorted(seen["c1"] + seen["c2"]) == list(range(20))
        assert abs(len(seen["c1"]) - len(seen["c2"])) <= 2, seen


async def test_redelivery_on_disconnect_and_deadline(queue_broker: Start) -> None:
    """A consumer that disconnects without acking, or misses its ack deadline, gets its
    message redelivered to another consumer with the delivery count raised."""
    b = queue_broker({"rd": {}})
    async with msgq_trio.connect(b.path, "p") as p:
        await p.queue("rd").put("a")
        async with msgq_trio.connect(b.path, "dies") as c, c.queue("rd").consume(window=1) as k:
            m = await k.__anext__()
            assert (m.body, m.deliveries) == ("a", 1)
            # leaves without ack (aclose nacks nothing it already handed out)
        async with msgq_trio.connect(b.path, "c2") as c2:
            with trio.fail_after(10):
                got = []
                while not got:
                    got = await c2.queue("rd").fetch(1, ack_timeout=0.3)
                    await trio.sleep(0.05)
            assert got[0].body == "a" and got[0].deliveries == 2
            # no ack: after the deadline it comes back
            with trio.fail_after(10):
                again = []
                while not again:
                    await trio.sleep(0.1)
                    again = await c2.queue("rd").fetch(1)
            assert again[0].body == "a" and again[0].deliveries == 3
            await again[0].ack()
            assert (await c2.queue("rd").stats())["depth"] == 0


async def test_dead_letter_after_max_deliveries(queue_broker: Start) -> None:
    """With max_deliveries 2, a message nacked twice moves to <queue>.dlq, durably."""
    b = queue_broker({"dl": {"max_deliveries": 2}})
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("dl")
        await q.put("poison")
        for expected in (1, 2):
            [m] = await q.fetch(1)
            assert m.deliveries == expected
            await m.nack()
        with trio.fail_after(10):
            dead = []
            while not dead:
                dead = await p.queue("dl.dlq").fetch(1)
                await trio.sleep(0.02)
        # the count goes on: 2 deliveries from "dl", this is the third
        assert dead[0].body == "poison" and dead[0].deliveries == 3
        assert await q.fetch(1) == []
        st = await q.stats()
        assert st["dead_lettered"] == 1 and st["depth"] == 0


async def test_dedup_across_crash(queue_broker: Start) -> None:
    """A producer that resends with the same producer name and seqs, in this run or after
    the broker was SIGKILLed, creates no duplicate."""
    b = queue_broker({"dd": {}})
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("dd", producer="prod-1")
        assert (await q.put_many(list(range(10)), first_seq=1))["stored"] == 10
        r = await q.put_many(list(range(5, 15)), first_seq=6)
        assert r == {"stored": 5, "consumed": 0, "duplicates": 5}
        assert await q.put(3, seq=4) == "duplicate"
    b.kill()
    b2 = queue_broker({"dd": {}}, path=b.path)
    async with msgq_trio.connect(b2.path, "p") as p:
        q = p.queue("dd", producer="prod-1")
        assert await q.producer_state() == 15
        r = await q.put_many(list(range(10, 20)), first_seq=11)
        assert r == {"stored": 5, "consumed": 0, "duplicates": 5}
        got = await q.fetch(100)
        assert [m.body for m in got] == list(range(20))


async def test_put_after_refuses_a_put_that_overtook_a_missing_one(queue_broker: Start) -> None:
    """``after`` (what a link sends with pipelined puts): a put whose producer's previous
    seq has not arrived is refused ``out-of-order`` and accepts nothing, so resending the
    missing messages later stores them instead of calling them duplicates."""
    b = queue_broker({"oo": {}})
    enc = [msgq_trio.protocol.framing.encode_cbor(i) for i in range(1, 7)]
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("oo", producer="up/x")
        await q.declare()
        first = q.start_put_encoded(enc[:2], [1, 2], producer="up/x")
        assert (await first())["stored"] == 2
        # seqs 3-4 were "lost"; 5-6 claim to follow 4: refused, nothing accepted.
        overtaking = q.start_put_encoded(enc[4:], [5, 6], producer="up/x", after=4)
        with pytest.raises(RemoteError) as ei:
            await overtaking()
        assert ei.value.code == "out-of-order"
        assert await q.producer_state() == 2
        # The resend in order is stored, not taken for duplicates.
        again = q.start_put_encoded(enc[2:], [3, 4, 5, 6], producer="up/x", after=2)
        assert await again() == {"stored": 4, "consumed": 0, "duplicates": 0}
        assert [m.body for m in await q.fetch(10)] == [1, 2, 3, 4, 5, 6]
        assert (await q.stats())["out_of_order"] == 1


async def test_redelivery_keeps_original_order_whatever_the_nack_order(queue_broker: Start) -> None:
    """Messages given back in several nacks (a link's give-back comes in chunks, refused
    delivery batches one by one) are redelivered in their original order, before the
    never-delivered ones, not the last nack first: a link forwards them in the order
    received and the next queue drops an earlier seq arriving after a later one as a
    resend (messages would be lost in a chain of queues)."""
    b = queue_broker({"ro": {}})
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("ro")
        await q.put_many(list(range(300)))

        async def nack(ids: list[int]) -> None:
            assert await p.call(q.group, "nack", {"queue": "ro", "ids": ids}) == len(ids)

        got = await q.fetch(300)
        assert [m.body for m in got] == list(range(300))
        ids = [m.id for m in got]
        for lo, hi in ((0, 100), (100, 200), (200, 300)):  # in order, one nack each
            await nack(ids[lo:hi])
        await q.put_many(list(range(300, 400)))  # never delivered: after the redeliveries
        got = await q.fetch(400)
        assert [m.body for m in got] == list(range(400))
        ids = [m.id for m in got]
        for lo, hi in ((200, 400), (0, 100), (100, 200)):  # out of order
            await nack(ids[lo:hi])
        got = await q.fetch(400)
        assert [m.body for m in got] == list(range(400))
        assert await q.ack(got) == 400
        assert (await q.stats())["depth"] == 0


async def test_forwarder_consuming_again_gets_what_it_held_first(queue_broker: Start) -> None:
    """A forwarder (``consume(ids=True)``, a link) that consumes again on the same
    connection first gets back what its previous consumer still held, in order (a
    link's deliveries in transit at the end of a session), not later messages first."""
    b = queue_broker({"fw": {}})
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("fw", producer="prod")
        await q.put_many(list(range(30)), first_seq=1)
        async with p.queue("fw").consume(10, ids=True, ack_timeout=60.0) as k:
            first = [await k.__anext__() for _ in range(10)]
        assert [m.producer_seq for m in first] == list(range(1, 11))
        # the first consumer is gone without acking (its client refuses nothing it
        # already took): consuming again starts from those, in order
        got = []
        with trio.fail_after(20):  # (well before the first consumer's ack deadline)
            async with p.queue("fw").consume(10, ids=True) as k:
                async for m in k:
                    got.append(m)
                    await m.ack()
                    if len(got) == 30:
                        break
        assert [m.producer_seq for m in got] == list(range(1, 31))
        assert [m.deliveries for m in got[:10]] == [2] * 10


async def test_full_map_refuses_then_recovers(queue_broker: Start) -> None:
    """A full map (growth disabled) answers queue-full, loses nothing that was acked, and
    accepts puts again once consumers drained the queue."""
    mib = 1 << 20
    b = queue_broker({"full": {}}, map_size=mib, max_store_size=mib)
    body = b"x" * 4000
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("full")
        acked = 0
        with pytest.raises(QueueFull) as info:
            for i in range(1000):
                await q.put([i, body])
                acked += 1
        assert "cannot store" in str(info.value)
        assert 50 < acked < 1000
        got = []
        while batch := await q.fetch(100):
            got += batch
            await q.ack(batch)
        assert [m.body[0] for m in got] == list(range(acked))
        assert await q.put(["again", body]) == "stored"
        assert (await q.stats())["storage_full"] >= 1


async def test_fast_consumer_skips_writes(queue_broker: Start) -> None:
    """With a consumer online that acks at once, at least 90 % of the messages are never
    written (from the statistics)."""
    b = queue_broker({"fast": {}})
    n = 3000
    async with msgq_trio.connect(b.path, "p") as p, msgq_trio.connect(b.path, "c") as c:
        q = p.queue("fast")
        done = trio.Event()

        async def consume() -> None:
            k = 0
            async with c.queue("fast").consume(window=256) as msgs:
                async for m in msgs:
                    await m.ack()
                    k += 1
                    if k == n:
                        done.set()
                        return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await trio.sleep(0.2)
            results: list[str] = []

            async def produce(lo: int) -> None:
                for i in range(lo, n, 16):
                    results.append(await q.put(i))

            with trio.fail_after(60):
                async with trio.open_nursery() as prod:
                    for lo in range(16):
                        prod.start_soon(produce, lo)
                await done.wait()
        st = await q.stats()
        assert len(results) == n and st["acked"] == n
        assert st["writes_skipped"] >= 0.9 * n, st
        assert results.count("consumed") >= 0.9 * n


async def test_producer_order_kept_with_consumer_online(queue_broker: Start) -> None:
    """A windowed producer outruns a slow consumer's window: the messages it cannot take
    yet are committed while earlier messages of the same producer are still in flight to
    it, some longer than ack_grace. None of them is taken for a resend (the store
    deduplicates by producer order), every one is answered stored or consumed, and the
    consumer gets each exactly once."""
    b = queue_broker({"ord": {}})
    n = 1000
    async with msgq_trio.connect(b.path, "p") as p, msgq_trio.connect(b.path, "c") as c:
        q = p.queue("ord")
        await q.prepare()
        seen: list[int] = []

        async def consume() -> None:
            async with c.queue("ord").consume(window=100) as msgs:
                async for m in msgs:
                    seen.append(m.body)
                    await trio.sleep(0.001)  # a window takes > 100 ms: beyond ack_grace
                    await m.ack()
                    if len(seen) == n:
                        return

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                await trio.sleep(0.2)
                waits = [q.start_put_many(list(range(i, i + 500))) for i in range(0, n, 500)]
                results = [await w() for w in waits]
        assert sum(r["duplicates"] for r in results) == 0, results
        assert sum(r["stored"] + r["consumed"] for r in results) == n
        assert sorted(seen) == list(range(n))
        st = await q.stats()
        assert st["depth"] == 0 and st["duplicates"] == 0 and st["redelivered"] == 0, st


async def test_a_consumers_acks_are_applied_before_its_next_request(queue_broker: Start) -> None:
    """A consumer acks what it holds, then asks for the queue's statistics: its acks
    (one-way messages) and its request reach the plugin together (stopped meanwhile, so
    they wait in one socket buffer). The plugin takes them in arrival order: the answer
    already counts the acks (taken by iteration, the acks waited behind the requests
    the reader answers), and so does a ``cancel`` or any later request."""
    b = queue_broker({"last": {}})
    pid = ready_plugin_pid(b)
    async with msgq_trio.connect(b.path, "p") as p, msgq_trio.connect(b.path, "c") as c:
        await p.queue("last").put_many(list(range(50)))
        held = []
        with trio.fail_after(60):
            async with c.queue("last").consume(window=50) as msgs:
                async for m in msgs:
                    held.append(m)
                    if len(held) == 50:
                        break
                os.kill(pid, signal.SIGSTOP)
                try:
                    for m in held:
                        await m.ack()
                    await msgs._flush()  # what the consumer does at its next wait

                    async def resume() -> None:
                        await trio.sleep(0.5)  # acks and the request in the plugin's socket
                        os.kill(pid, signal.SIGCONT)

                    async with trio.open_nursery() as n:
                        n.start_soon(resume)
                        st = await c.queue("last").stats()
                finally:
                    os.kill(pid, signal.SIGCONT)
    assert sorted(m.body for m in held) == list(range(50))
    assert st["depth"] == 0 and st["acked"] == 50 and st["redelivered"] == 0, st


async def test_transparent_insertion(queue_broker: Start) -> None:
    """A queue bound to a group takes the producer's bus.call/send unchanged: with the
    member offline the call returns once stored, the member gets it later through its
    ordinary handler; online, the member's own answer comes back."""
    b = queue_broker({"sqlq": {"bind": "SQLWriter", "window": 1}})
    async with msgq_trio.connect(b.path, "radius") as radius:
        answer = await radius.call("SQLWriter", "write", {"acct": 1})
        assert answer == {"queued": "sqlq"}
        await radius.send("SQLWriter", {"note": "one-way"})
        got: list[object] = []
        async with msgq_trio.connect(b.path, "sqlwriter") as writer:

            @writer.command("write")
            async def write(params: dict[str, int]) -> dict[str, int]:
                got.append(params)
                return {"ok": params["acct"]}

            await writer.subscribe("SQLWriter")
            await eventually(lambda: len(got) >= 1)
            msg = await writer.receive(timeout=10)
            assert got == [{"acct": 1}]
            assert (msg.body, msg.sender_name, msg.via_name) == (
                {"note": "one-way"},
                "radius",
                "msgq-queue-binder",
            )
            # online: the member's own answer comes back, every time
            answers = [await radius.call("SQLWriter", "write", {"acct": i}) for i in range(2, 12)]
            assert answers == [{"ok": i} for i in range(2, 12)]
            await eventually(lambda: len(got) >= 11)
            assert got == [{"acct": i} for i in range(1, 12)]
        q = radius.queue("sqlq")
        assert (await q.stats())["depth"] == 0


async def test_binding_rules(queue_broker: Start) -> None:
    """Only one client may bind a group; the binder reaches the real members; the binding
    ends with the binder's connection."""
    b = queue_broker({})
    async with (
        msgq_trio.connect(b.path, "binder") as binder,
        msgq_trio.connect(b.path, "member") as member,
        msgq_trio.connect(b.path, "other") as other,
    ):
        await member.subscribe("G")
        assert await binder.call("msgq", "bind", {"group": "G"}) is True
        with pytest.raises(RemoteError) as info:
            await other.call("msgq", "bind", {"group": "G"})
        assert info.value.code == "forbidden" and binder.lname in str(info.value)
        await other.send("G", "to-binder")
        assert (await binder.receive(timeout=5)).body == "to-binder"
        await binder.send("G", "to-member")
        assert (await member.receive(timeout=5)).body == "to-member"
        assert await binder.call("msgq", "unbind", {"group": "G"}) is True
        await other.send("G", "direct")
        assert (await member.receive(timeout=5)).body == "direct"


def test_sync_client(queue_broker: Start) -> None:
    """The blocking client: put, consume with ack, fetch, stats, and send through a
    bound queue (the member sees the producer via the queue)."""
    b = queue_broker({"s": {}, "sb": {"bind": "SG"}})
    with sync.connect(b.path, "sp") as p, sync.connect(b.path, "sc") as c:
        q = p.queue("s")
        assert q.put("one") == "stored"
        assert q.put_many(["two", "three"])["stored"] == 2
        bodies = []
        for m in c.queue("s").consume(window=2, timeout=10):
            bodies.append(m.body)
            m.ack()
            if len(bodies) == 3:
                break
        assert bodies == ["one", "two", "three"]
        assert q.fetch(5) == []
        assert q.stats()["depth"] == 0
        assert p.queue("sb").send({"n": 1}, [b"blob"]) == "stored"  # no member yet
        c.subscribe("SG")
        msg = c.receive(timeout=10)
        assert (msg.body, [bytes(a) for a in msg.attachments]) == ({"n": 1}, [b"blob"])
        assert (msg.sender, msg.via_name) == (p.lname, "msgq-queue-binder")


async def test_plugin_restarted_after_crash(queue_broker: Start) -> None:
    """A plugin process that dies is logged and restarted; its queues keep their data."""
    b = queue_broker({"pc": {}})
    async with msgq_trio.connect(b.path, "p") as p:
        assert await p.queue("pc").put("kept") == "stored"
    os.kill(ready_plugin_pid(b), signal.SIGKILL)
    await eventually(lambda: len(ready_plugin_pids(b.log())) >= 2, 20)
    assert "plugin queue exited with status -9; restarting" in b.log()
    async with msgq_trio.connect(b.path, "c") as c:
        assert [m.body for m in await c.queue("pc").fetch(5)] == ["kept"]


def test_bad_plugin_configuration_stops_start(short_tmp: Path, broker_argv: Any) -> None:
    """An unknown plugin or a bad plugin setting is an invalid configuration: exit 2,
    one line naming it."""
    argv = broker_argv(short_tmp / "x.sock", "--plugin", "nosuch")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 2
    # other installed plugins (entry points of this or other packages) may be listed too
    assert re.search(r"unknown plugin 'nosuch' \(installed: [^)]*\bqueue\b", r.stderr), r.stderr
    cfg = short_tmp / "bad.toml"
    cfg.write_text('[plugins.queue]\ndir = "/tmp/x"\nmax_batch = 0\n')
    argv = broker_argv(short_tmp / "x.sock", "--config", str(cfg))
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 2 and "max_batch = 0" in r.stderr, r.stderr


def test_plugin_that_cannot_start_fails_broker_start(short_tmp: Path, broker_argv: Any) -> None:
    """A plugin that fails its first start (store directory unusable) makes the broker's
    start fail with exit status 1 and a message naming the plugin."""
    blocker = short_tmp / "file"
    blocker.write_text("not a directory")
    cfg = short_tmp / "q.toml"
    cfg.write_text(f'[plugins.queue]\ndir = "{blocker}/store"\n')
    argv = broker_argv(short_tmp / "y.sock", "--config", str(cfg))
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "plugin 'queue' failed to start" in r.stderr
    # The cause in one line, not a traceback, and no made-up "not ready after 30 s".
    assert "plugin queue: cannot start: NotADirectoryError" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "not ready after" not in r.stderr, r.stderr[-3000:]
    assert not (short_tmp / "y.sock").exists()
    assert sys.executable  # the child used the same interpreter (see supervisor argv)


async def test_a_malformed_or_oversized_delivery_is_refused_whole(broker: Any) -> None:
    """The consumer's side of ``queue.deliver`` (columns ``ids``, ``bodies``,
    ``deliveries``) against a stand-in plugin on a real broker: a batch whose columns
    disagree or whose bodies are not byte strings is refused ``bad-request``, one beyond
    the window ``nack``; neither hands the consumer anything. A good batch then comes
    out in order, with ids and delivery counts; a body that is not one CBOR value raises
    MalformedMessage when read, naming the message."""
    from msgq_trio.client.queue import Queue

    async with msgq_trio.connect(broker.path, "fake-plugin") as plugin:
        await plugin.subscribe("fakeq")
        consumers: list[str] = []
        consuming = trio.Event()

        def handle(params: Any, request: msgq_trio.Message) -> Any:
            if request.command == "consume":
                consumers.append(request.sender)
                consuming.set()
                return {"instance": "fake"}
            return True  # declare

        plugin.set_default_handler(handle)
        async with msgq_trio.connect(broker.path, "c") as bus:
            q = Queue(bus, "q", group="fakeq")
            async with q.consume(window=3) as consumer, trio.open_nursery() as nursery:
                got: list[tuple[int, Any, int]] = []
                done = trio.Event()

                async def take() -> None:
                    async for m in consumer:
                        try:
                            body = m.body
                        except MalformedMessage as exc:
                            body = f"{exc} ({exc.sender})"
                        got.append((m.id, body, m.deliveries))
                        if len(got) == 3:
                            done.set()
                            return

                nursery.start_soon(take)
                with trio.fail_after(10):
                    await consuming.wait()
                to = consumers[0]

                def cols(ids: list[Any], bodies: list[Any], counts: list[Any]) -> Any:
                    return {"queue": "q", "ids": ids, "bodies": bodies, "deliveries": counts}

                bad = [
                    cols([1, 2], [b"\x01"], [1, 1]),  # a column short
                    cols([1], ["not bytes"], [1]),
                    {"queue": "q", "msgs": [[1, b"\x01", 1]]},  # rows: not this protocol
                ]
                for params in bad:
                    with pytest.raises(RemoteError) as ei:
                        await plugin.call(to, "queue.deliver", params)
                    assert ei.value.code == "bad-request"
                four = cols([1, 2, 3, 4], [b"\x01"] * 4, [1] * 4)
                with pytest.raises(RemoteError) as ei:
                    await plugin.call(to, "queue.deliver", four)
                assert ei.value.code == "nack" and "beyond the window" in str(ei.value)
                assert got == []
                ok = cols([7, 8, 9], [b"\x01", b"\x02", b"\x01\x01"], [1, 3, 1])
                assert await plugin.call(to, "queue.deliver", ok) is True
                with trio.fail_after(10):
                    await done.wait()
    assert got[:2] == [(7, 1, 1), (8, 2, 3)]  # CBOR 1 and 2
    assert got[2][0] == 9 and "message 9" in got[2][1] and "after its CBOR value" in got[2][1]
