"""The plugin-driver API (what the queue and pipe clients are built on) on both
asynchronous drivers: the same client code runs on the trio ``Bus`` and on the asyncio
``AioBus`` against a real broker (tests/driver_harness.py) and must behave the same."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import trio
from driver_harness import ASYNC_DRIVERS, HANG, open_driver

import msgq_trio
import msgq_trio.aio


async def cancelled_after(bus: Any, seconds: float, fn: Any) -> bool:
    """Run ``fn()`` on ``bus``'s event loop, cancelling it after ``seconds``; whether it
    was cancelled (the one place the tests need each loop's own timeout)."""
    if isinstance(bus, msgq_trio.aio.AioBus):
        try:
            async with asyncio.timeout(seconds):
                await fn()
        except TimeoutError:
            return True
        return False
    with trio.move_on_after(seconds) as scope:
        await fn()
    return scope.cancelled_caught


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
async def test_send_on_behalf_of_from_the_binder(driver: str, broker: Any) -> None:
    """A client holding a group's binding sends on behalf of another sender: the
    member sees that sender, relayed via the binder."""
    async with (
        open_driver(driver, broker.path, "binder") as binder,
        msgq_trio.connect(broker.path, "member") as member,
    ):
        await member.subscribe("G")

        async def relay(bus: Any) -> None:
            assert await bus.call("msgq", "bind", {"group": "G"}) is True
            await bus.send("G", "stored", on_behalf_of=("l.99", "radius"))

        await binder.run(relay)
        with trio.fail_after(HANG):
            msg = await member.receive()
    assert (msg.body, msg.sender, msg.sender_name) == ("stored", "l.99", "radius")
    assert (msg.via, msg.via_name) == (binder.lname, "binder")


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
async def test_started_calls_leave_in_order_and_wait_for_their_answers(
    driver: str, broker: Any
) -> None:
    """Requests started with start_call reach the callee in the order they were
    started, and each wait() gives its own answer."""
    seen: list[int] = []
    async with (
        open_driver(driver, broker.path, "caller") as caller,
        msgq_trio.connect(broker.path, "callee") as callee,
    ):

        def echo(params: int) -> int:
            seen.append(params)
            return params * 10

        callee.add_command("echo", echo)

        async def start_then_wait(bus: Any) -> list[int]:
            waits = [bus.start_call(callee.lname, "echo", i) for i in range(5)]
            return [await wait() for wait in reversed(waits)]

        assert await caller.run(start_then_wait) == [40, 30, 20, 10, 0]
    assert seen == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
async def test_a_cancelled_wait_call_leaves_the_request_waitable(driver: str, broker: Any) -> None:
    """wait_call is cancel-safe: cancelled while the answer is not there, the request
    stays in flight, and a later wait_call gets its answer (the pipe reader relies on
    it: a cancelled read must not lose the bytes the plugin took for it)."""
    async with (
        open_driver(driver, broker.path, "caller") as caller,
        msgq_trio.connect(broker.path, "callee") as callee,
    ):
        release = trio.Event()

        async def slow(params: str) -> str:
            await release.wait()
            return params.upper()

        callee.add_command("slow", slow)

        async def start(bus: Any) -> tuple[Any, bool]:
            call = bus.start_request(callee.lname, "slow", "late")
            return call, await cancelled_after(bus, 0.2, lambda: bus.wait_call(call))

        call, cancelled = await caller.run(start)
        assert cancelled and not call.done
        release.set()

        async def finish(bus: Any) -> Any:
            await bus.wait_call(call)
            bus.forget_call(call)
            return call.error, call.result

        assert await caller.run(finish) == (None, "LATE")


@pytest.mark.parametrize("driver", ASYNC_DRIVERS)
async def test_shielded_cleanup_outlives_the_cancelled_caller(driver: str, broker: Any) -> None:
    """shielded(fn) runs fn to its end although the caller is cancelled meanwhile (a
    consumer's last acks, a pipe handle's close must reach the broker)."""
    async with open_driver(driver, broker.path, "c") as d:

        async def run(bus: Any) -> tuple[bool, bool]:
            finished = bus.new_event()

            async def cleanup() -> None:
                await bus.sleep(0.3)
                finished.set()

            cancelled = await cancelled_after(bus, 0.05, lambda: bus.shielded(cleanup))
            await finished.wait()
            return cancelled, finished.is_set()

        assert await d.run(run) == (True, True)
