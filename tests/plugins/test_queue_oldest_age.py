"""``stats`` reports the age of a queue's oldest live message (``oldest_age``), without
the metrics endpoint being enabled: what the web console's queue table shows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
from plugin_helpers import eventually

import msgq_trio


async def test_stats_oldest_age_grows_with_a_backlog_and_resets_when_drained(
    queue_broker: Callable[..., Any],
) -> None:
    """An empty queue is 0 old; with messages waiting it ages (at least a second after a
    second), counted from their put, not from the plugin's start (the tracker samples
    while the plugin runs: the bound is one period plus slack for a busy machine); once
    every message is acked it is 0 again. No ``metrics`` setting."""
    b = queue_broker({"q": {}})
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("q", producer="p1")
        assert (await q.stats())["oldest_age"] == 0
        # Five seconds after the start, so an age counted from the start would show.
        await trio.sleep(5.0)
        put_at = trio.current_time()
        await q.put_many([{"n": i} for i in range(3)])

        async def aged() -> bool:
            return bool((await q.stats())["oldest_age"] >= 1.0)

        await eventually(aged)
        age = (await q.stats())["oldest_age"]
        assert age <= trio.current_time() - put_at + 3.0, age
        got = await q.fetch(3, ack_timeout=600)
        assert await q.ack(got) == 3
        assert (await q.stats())["oldest_age"] == 0
