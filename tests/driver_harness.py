"""Run the same client code on the trio and on the asyncio driver, from a trio test.

``open_driver(driver, path, name)`` connects with ``driver`` and yields a :class:`Driven`
whose ``run(fn)`` runs ``await fn(bus)`` where that bus lives: in the test's own trio
run for the trio ``Bus``, on the loop of an ``asyncio.run`` in a thread of its own for
the ``AioBus`` (no trio context there, as in an asyncio program; the same way as
tests/client/test_behaviour.py drives it). ``fn`` is written once against the API both
buses share (``bus.queue``, ``bus.pipe``, ``bus.sleep``, ``bus.start_soon``...), so a
difference between the drivers is a failing test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

import msgq_trio
import msgq_trio.aio

ASYNC_DRIVERS = ["trio", "asyncio"]
#: A bound for waits that only a broken driver reaches (never a figure under test).
HANG = 30.0


class Driven:
    """A connected bus of one driver; ``run(fn)`` runs ``fn(bus)`` on its event loop
    and returns its result or raises its exception here."""

    def __init__(self, bus: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        self.bus = bus
        self.lname: str = bus.lname
        self._loop = loop

    async def run(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        if self._loop is None:
            with trio.fail_after(HANG):
                return await fn(self.bus)

        async def coro() -> Any:
            return await fn(self.bus)

        fut = asyncio.run_coroutine_threadsafe(coro(), self._loop)

        def wait() -> Any:
            done, _ = concurrent.futures.wait([fut], HANG)
            if not done:
                fut.cancel()
                raise AssertionError(f"the asyncio client did not finish within {HANG} s")
            return fut.result()

        return await trio.to_thread.run_sync(wait)


@asynccontextmanager
async def open_driver(driver: str, path: Path | str, name: str) -> AsyncIterator[Driven]:
    """A connection named ``name`` on ``driver`` (``trio`` or ``asyncio``); leaving the
    block closes it (tasks the bus started are cancelled); what the asyncio thread
    raised fails the test."""
    if driver == "trio":
        async with msgq_trio.connect(path, name) as bus:
            yield Driven(bus, None)
        return
    assert driver == "asyncio"
    ready = threading.Event()
    started: list[tuple[asyncio.AbstractEventLoop, msgq_trio.aio.AioBus, asyncio.Event]] = []
    errors: list[BaseException] = []

    async def main() -> None:
        async with msgq_trio.aio.connect(path, name) as bus:
            stop = asyncio.Event()
            started.append((asyncio.get_running_loop(), bus, stop))
            ready.set()
            await stop.wait()

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        await trio.to_thread.run_sync(ready.wait, HANG)
        if not started:
            assert len(errors) == 1, errors
            raise errors.pop()
        loop, bus, _stop = started[0]
        yield Driven(bus, loop)
    finally:
        if started:
            started[0][0].call_soon_threadsafe(started[0][2].set)
        await trio.to_thread.run_sync(thread.join, HANG)
    assert not thread.is_alive()
    assert errors == []
