"""The queue client on every asynchronous driver: the same client code (one ``Queue``,
one ``Consumer``) runs on the trio ``Bus`` and on the asyncio ``AioBus`` against a real
broker running the queue plugin, and must behave the same (tests/driver_harness.py)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
from driver_harness import ASYNC_DRIVERS, open_driver
from plugin_helpers import eventually, put_until_stored, ready_plugin_pid, ready_plugin_pids

import msgq_trio

Start = Callable[..., Any]


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
async def test_put_consume_ack(driver: str, queue_broker: Start) -> None:
    """Puts (one by one and a batch) come out of a push consumer in order, each once;
    once acked, the queue holds nothing: a fetch finds no message and the stats count
    every one acked."""
    b = queue_broker({"q": {}})
    async with open_driver(driver, b.path, "d") as d:

        async def produce_and_consume(bus: Any) -> list[Any]:
            q = bus.queue("q", producer="p1")
            assert await q.put("a") in ("stored", "consumed")
            counts = await q.put_many(["b", "c", "d"])
            assert counts["duplicates"] == 0
            assert counts["stored"] + counts["consumed"] == 3
            got = []
            async with q.consume(window=2) as consumer:
                async for m in consumer:
                    got.append(m.body)
                    await m.ack()
                    if len(got) == 4:
                        break
            return got

        assert await d.run(produce_and_consume) == ["a", "b", "c", "d"]

        async def left(bus: Any) -> tuple[list[Any], dict[str, Any]]:
            q = bus.queue("q")
            return await q.fetch(10), await q.stats()

        rest, stats = await d.run(left)
    assert rest == []
    assert stats["acked"] == 4 and stats["depth"] == 0


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
async def test_a_nacked_message_is_redelivered(driver: str, queue_broker: Start) -> None:
    """A message the consumer nacks comes back to it, its delivery count raised; the
    one acked does not."""
    b = queue_broker({"n": {}})
    async with open_driver(driver, b.path, "d") as d:

        async def nack_first(bus: Any) -> list[tuple[Any, int]]:
            q = bus.queue("n")
            await q.put_many(["x", "y"])
            seen: list[tuple[Any, int]] = []
            async with q.consume(window=1) as consumer:
                async for m in consumer:
                    seen.append((m.body, m.deliveries))
                    if len(seen) == 1:
                        await m.nack()
                    else:
                        await m.ack()
                    if len(seen) == 3:
                        break
            return seen

        seen = await d.run(nack_first)
    assert seen[0] == ("x", 1)
    assert ("x", 2) in seen[1:] and ("y", 1) in seen[1:]


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
async def test_fetch_and_ack(driver: str, queue_broker: Start) -> None:
    """fetch pulls what is ready (no more than asked), ack says how many were owed, and
    an acked message is not fetched again."""
    b = queue_broker({"f": {}})
    async with open_driver(driver, b.path, "d") as d:

        async def pull(bus: Any) -> tuple[list[Any], list[Any], int, list[Any]]:
            q = bus.queue("f")
            await q.put_many([1, 2, 3])
            first = await q.fetch(2)
            second = await q.fetch(5)
            owed = await q.ack(first + second)
            return [m.body for m in first], [m.body for m in second], owed, await q.fetch(5)

        first, second, owed, after = await d.run(pull)
    assert (first, second, owed, after) == ([1, 2], [3], 3, [])


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
async def test_push_consumer_goes_on_after_the_plugin_is_killed(
    driver: str, queue_broker: Start
) -> None:
    """A push consumer (a task of its bus, on either driver) whose queue plugin is
    SIGKILLed and restarted by the supervisor consumes again from the new process:
    every message put before and after the kill arrives, and it counts one re-attach."""
    b = queue_broker({"r": {}})
    got: set[int] = set()
    async with (
        msgq_trio.connect(b.path, "p") as p,
        open_driver(driver, b.path, "c") as c,
    ):

        async def start(bus: Any) -> Any:
            consumer = bus.queue("r").consume(window=4)
            await consumer.__aenter__()

            async def consume() -> None:
                async for m in consumer:
                    got.add(m.body)
                    await m.ack()

            bus.start_soon(consume)
            return consumer

        consumer = await c.run(start)
        q = p.queue("r", producer="p1")
        for i in range(20):
            await put_until_stored(q, i, i + 1)
        await eventually(lambda: len(got) == 20)
        os.kill(ready_plugin_pid(b), signal.SIGKILL)
        await eventually(lambda: len(ready_plugin_pids(b.log())) == 2)
        for i in range(20, 40):
            await put_until_stored(q, i, i + 1)
        await eventually(lambda: len(got) == 40)

        async def stop(bus: Any) -> int:
            await consumer.aclose()
            return int(consumer.reattached)

        assert await c.run(stop) == 1
    assert got == set(range(40))
