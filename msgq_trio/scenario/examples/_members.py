"""Waiting for the other components of the example system to come up."""

from __future__ import annotations

import time

import trio

import msgq_trio
from msgq_trio import sync

#: How long a program waits for the members it needs.
STARTUP_TIMEOUT = 30.0


async def wait_for_members(bus: msgq_trio.Bus, group: str, n: int) -> None:
    """Return once ``group`` has ``n`` members; polled, since the membership is the
    broker's, not ours (the runner starts every program at once).

    Raises:
        trio.TooSlowError: not within :data:`STARTUP_TIMEOUT`.
    """
    with trio.fail_after(STARTUP_TIMEOUT):
        while True:  # polled: no membership event reaches a non-member
            if len(await bus.members(group)) >= n:
                return
            await trio.sleep(0.05)


def wait_for_members_blocking(bus: sync.SyncBus, group: str, n: int) -> None:
    """:func:`wait_for_members` for a program on the blocking client.

    Raises:
        TimeoutError: not within :data:`STARTUP_TIMEOUT`.
    """
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while len(bus.members(group)) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{group} had no {n} members within {STARTUP_TIMEOUT} s")
        time.sleep(0.05)
