"""The Mailbox (client/mailbox.py), the hand-over from a bus's reader to a consumer's
iteration, on each event loop's events: order, the bound, the end, cancel-safety."""

from __future__ import annotations

import asyncio

import pytest
import trio
import trio.testing

from msgq_trio.client.mailbox import Mailbox
from msgq_trio.errors import UsageError


def test_items_come_out_in_order_within_the_bound() -> None:
    """put keeps order and refuses an item over the capacity (the caller checks room);
    get_nowait gives None when empty."""
    box: Mailbox[int] = Mailbox(2, trio.Event)
    assert box.room == 2 and box.get_nowait() is None
    box.put(1)
    box.put(2)
    assert box.room == 0
    with pytest.raises(UsageError):
        box.put(3)
    assert [box.get_nowait(), box.get_nowait(), box.get_nowait()] == [1, 2, None]


def test_close_ends_after_what_is_in() -> None:
    """After close nothing goes in, what was in still comes out, then the end."""
    box: Mailbox[str] = Mailbox(4, trio.Event)
    box.put("a")
    box.close()
    assert box.room == 0 and not box.ended
    with pytest.raises(UsageError):
        box.put("b")
    assert box.get_nowait() == "a"
    assert box.ended


async def test_get_waits_for_a_put_and_a_cancelled_get_takes_nothing() -> None:
    """On trio: a waiting get is woken by put; a get cancelled while waiting takes
    nothing (the next get gets the item); a waiting get sees the close as the end."""
    box: Mailbox[int] = Mailbox(4, trio.Event)
    with trio.move_on_after(0.05) as scope:
        await box.get()
    assert scope.cancelled_caught
    got: list[int | None] = []
    # fail_after: only a broken mailbox (a get that never wakes) reaches it
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def take() -> None:
                got.append(await box.get())
                got.append(await box.get())

            nursery.start_soon(take)
            await trio.testing.wait_all_tasks_blocked()
            box.put(7)
            await trio.testing.wait_all_tasks_blocked()
            box.close()
    assert got == [7, None]


def test_the_same_on_asyncio() -> None:
    """On asyncio's events: a waiting get is woken by put, and by close (the end)."""

    async def main() -> list[int | None]:
        box: Mailbox[int] = Mailbox(4, asyncio.Event)
        try:
            async with asyncio.timeout(0.05):
                await box.get()
        except TimeoutError:
            pass
        taker = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        box.put(5)
        first = await taker
        taker = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        box.close()
        return [first, await taker]

    async def bounded() -> list[int | None]:
        async with asyncio.timeout(10):  # only a broken mailbox reaches it
            return await main()

    assert asyncio.run(bounded()) == [5, None]
