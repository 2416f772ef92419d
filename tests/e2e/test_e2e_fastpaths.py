"""The hot paths of client and broker keep their contracts: clients write their own stamp
and an older client that does not is still stamped; sync command handlers are answered in
the reader without a task per request, async ones in a task of their own."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import encode_cbor


async def test_library_and_unstamped_raw_clients_mix(broker, raw_peer) -> None:
    """Messages from a library client (self-stamped) and from a raw client that sends no
    source (the encoding before self-stamping) arrive interleaved in order, each with its
    sender's true lname and name; bytes bodies survive the receiver's fast decode."""
    async with (
        msgq_trio.connect(broker.path, name="rx") as rx,
        msgq_trio.connect(broker.path, name="lib") as lib,
    ):
        await rx.subscribe("G")
        async with raw_peer(broker.path) as raw:
            await raw.hello("old")
            for i in range(300):
                await lib.send("G", bytes([i % 256]) * (i % 40))
                await raw.send_frame(FrameType.MESSAGE, target="G", body=encode_cbor(i))
            await lib.flush()
            got: dict[str, list[object]] = {"lib": [], "old": []}
            for _ in range(600):
                m = await rx.receive(timeout=5)
                assert m.sender == {"lib": lib.lname, "old": raw.lname}[m.sender_name]
                got[m.sender_name].append(m.body)
        assert got["lib"] == [bytes([i % 256]) * (i % 40) for i in range(300)]
        assert got["old"] == list(range(300))


async def test_sync_handler_runs_in_the_reader_async_in_a_task(broker) -> None:
    """A plain function handler is called in the bus' reader task, in arrival order; an
    async handler (or a plain function returning an awaitable) runs in a task of its own
    and may wait; errors from either map to codes as before."""
    async with (
        msgq_trio.connect(broker.path, name="svc") as svc,
        msgq_trio.connect(broker.path, name="caller") as caller,
    ):
        await svc.subscribe("Svc")
        tasks: dict[str, set[str]] = {"sync": set(), "async": set()}
        order: list[int] = []

        @svc.command("sync")
        def sync_handler(params: int) -> int:
            tasks["sync"].add(trio.lowlevel.current_task().name)
            order.append(params)
            return params * 2

        @svc.command("slow")
        async def slow_handler(params: int) -> int:
            tasks["async"].add(trio.lowlevel.current_task().name)
            await trio.sleep(0.01)
            return params + 1

        async def later(params: int) -> int:
            await trio.lowlevel.checkpoint()
            return -params

        def lazy(params: int) -> Coroutine[Any, Any, int]:
            return later(params)  # a plain function returning an awaitable

        svc.add_command("lazy", lazy)

        @svc.command("bad")
        def bad(_params: object) -> None:
            raise ValueError("nope")

        results: dict[int, object] = {}

        async def one(i: int) -> None:
            results[i] = await caller.call("Svc", "sync", i)

        async with trio.open_nursery() as n:
            for i in range(50):
                n.start_soon(one, i)
        assert results == {i: 2 * i for i in range(50)}
        assert sorted(order) == list(range(50))
        assert len(tasks["sync"]) == 1 and "_reader" in next(iter(tasks["sync"]))
        assert await caller.call("Svc", "slow", 1) == 2
        assert "_reader" not in next(iter(tasks["async"]))
        assert await caller.call("Svc", "lazy", 5) == -5
        with pytest.raises(msgq_trio.RemoteError) as ei:
            await caller.call("Svc", "bad")
        assert ei.value.code == "bad-request"


async def test_iteration_over_a_backlog_lets_other_tasks_run(broker) -> None:
    """``async for`` over messages already received takes them without waiting, but still
    yields to the other tasks of the program every 256 messages (the bus's fairness
    bound), so a long backlog cannot starve them; every message arrives, in
    order."""
    async with (
        msgq_trio.connect(broker.path, name="rx") as rx,
        msgq_trio.connect(broker.path, name="tx") as tx,
    ):
        await rx.subscribe("Backlog")
        n = 3000
        for i in range(n):
            await tx.send("Backlog", i)
        await tx.flush()
        # Let the receiver's reader take the whole backlog before anyone iterates.
        await trio.sleep(1.0)
        ticks = 0
        longest = run = 0

        async def other_task() -> None:
            nonlocal ticks, run
            while True:
                await trio.lowlevel.checkpoint()
                ticks += 1
                run = 0

        got = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_task)
            await trio.lowlevel.checkpoint()
            async for msg in rx:
                got.append(msg.body)
                run += 1
                longest = max(longest, run)
                if len(got) == n:
                    break
            nursery.cancel_scope.cancel()
        assert got == list(range(n))
        assert ticks >= n // 256 - 1
        # 256 per checkpoint; trio may run this task before the other one in the batch
        # after a checkpoint, so the other task can see up to two stretches in a row.
        assert longest <= 2 * 256, longest
