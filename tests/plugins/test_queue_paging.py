"""A queue's backlog lives in the store, not in the plugin: memory stays within the
``resident_*`` bounds, a restart does not read the backlog, consumers get it in order."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from msgq_trio.plugins.queue.settings import max_store_size_for, parse_settings
from plugin_helpers import eventually

import msgq_trio

Start = Callable[..., Any]

#: Small bounds, so a few thousand messages exercise paging.
PAGING = {"resident_messages": 100, "resident_bytes": 1 << 20}


async def consume_all(
    bus: msgq_trio.Bus, queue: str, n: int, window: int, watch: Callable[[], Any] | None = None
) -> list[Any]:
    """Receive and ack ``n`` messages of ``queue`` by push; fail after 60 s."""
    got: list[Any] = []
    with trio.fail_after(60):
        async with bus.queue(queue).consume(window=window) as msgs:
            async for m in msgs:
                got.append(m.body)
                await m.ack()
                if watch is not None and len(got) % 250 == 0:
                    await watch()
                if len(got) == n:
                    break
    return got


async def test_backlog_stays_on_disk_and_survives_restart(queue_broker: Start) -> None:
    """5,000 messages with no consumer: at most the bound in memory (a put that crosses
    it is split there); after
    a SIGKILL the restarted plugin holds none of them in memory until a consumer comes,
    which then gets all of them in order, with memory bounded while it drains."""
    b = queue_broker({"big": {}}, **PAGING)
    n, body = 5000, b"x" * 200
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("big", producer="p1")
        for lo in range(0, n, 50):
            assert await q.put_many([[i, body] for i in range(lo, lo + 50)]) == {
                "stored": 50,
                "consumed": 0,
                "duplicates": 0,
            }
        st = await q.stats()
        assert st["depth"] == n and st["paging"] is True
        assert st["resident"] == PAGING["resident_messages"], st  # exactly the bound
    b.kill()
    b2 = queue_broker({"big": {}}, path=b.path, **PAGING)
    async with msgq_trio.connect(b2.path, "c") as c:
        st = await c.queue("big").stats()
        assert (st["depth"], st["resident"], st["paging"]) == (n, 0, True), st
        peak = [0]

        async def watch() -> None:
            s = await c.queue("big").stats()
            peak[0] = max(peak[0], s["resident"])

        got = await consume_all(c, "big", n, window=16, watch=watch)
        assert [g[0] for g in got] == list(range(n))
        assert 0 < peak[0] <= PAGING["resident_messages"], peak
        st = await c.queue("big").stats()
        assert st["paged_in"] == n and st["depth"] == 0, st
        assert st["paging"] is False, st


async def test_producer_and_consumer_keep_order_across_paging(queue_broker: Start) -> None:
    """A producer runs ahead of a slow consumer past the bound, then the consumer catches
    up while puts go on: every message arrives once, in producer order, and once the
    backlog is drained new messages stay in memory again."""
    b = queue_broker({"mix": {}}, **PAGING)
    n = 3000
    async with msgq_trio.connect(b.path, "p") as p, msgq_trio.connect(b.path, "c") as c:
        q = p.queue("mix", producer="p1")
        got: list[int] = []
        async with trio.open_nursery() as nursery:

            async def produce() -> None:
                # A window of puts in flight: spilled messages are nearly always waiting
                # for their commit while the consumer reads the store.
                await q.prepare()
                waits: deque[Callable[[], Any]] = deque()
                for lo in range(0, n, 20):
                    if len(waits) == 4:
                        await waits.popleft()()
                    waits.append(q.start_put_many(list(range(lo, lo + 20))))
                    if lo == 1000:
                        nursery.start_soon(consume)
                while waits:
                    await waits.popleft()()

            async def consume() -> None:
                got.extend(await consume_all(c, "mix", n, window=4))

            nursery.start_soon(produce)
        assert got == list(range(n))
        st = await q.stats()
        assert st["paged_in"] > 0 and st["depth"] == 0, st

        async def paging_ended() -> dict[str, Any] | None:
            # Spilling ends with a read that finds the store's end, made after the last
            # ack: a moment after the queue is empty, not with it.
            now = await q.stats()
            return now if now["paging"] is False else None

        st = await eventually(paging_ended)
        # back in memory: a new message goes straight to a consumer
        async with trio.open_nursery() as nursery:
            nursery.start_soon(q.put, "after")
            assert await consume_all(c, "mix", 1, window=4) == ["after"]
        assert (await q.stats())["paged_in"] == st["paged_in"]


async def test_fetch_pages_in(queue_broker: Start) -> None:
    """``fetch`` on a queue whose messages are all on disk reads them in, in order."""
    b = queue_broker({"f": {}}, resident_messages=10, resident_bytes=1 << 20)
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("f")
        for lo in range(0, 200, 5):
            await q.put_many(list(range(lo, lo + 5)))
        seen: list[int] = []
        with trio.fail_after(30):
            while len(seen) < 200:
                batch = await q.fetch(30)
                assert batch, f"fetch returned nothing after {len(seen)} messages"
                seen += [m.body for m in batch]
                await q.ack(batch)
        assert seen == list(range(200))
        assert await q.fetch(5) == []


def test_store_size_settings(tmp_path: Path) -> None:
    """``max_store_size`` 0 derives the bound from the free space; ``max_map_size`` is
    its former name; giving both is refused."""
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    bound = max_store_size_for(str(tmp_path), 0, 1 << 20)
    assert 0.8 * free <= bound <= 0.9 * free
    assert max_store_size_for(str(tmp_path), 5 << 20, 1 << 20) == 5 << 20
    assert parse_settings({"dir": "d", "max_map_size": 8 << 20}).max_store_size == 8 << 20
    with pytest.raises(ValueError, match="not both"):
        parse_settings({"dir": "d", "max_map_size": 8 << 20, "max_store_size": 8 << 20})
    with pytest.raises(ValueError, match="resident_bytes"):
        parse_settings({"dir": "d", "resident_bytes": 1000})
