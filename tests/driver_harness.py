"""Run the same client code on the trio and on the asyncio driver, from a trio test.

The asyncio driver runs under ``asyncio.run`` in a thread of its own (no trio context
there, as in an asyncio program): :func:`asyncio_bus` connects it there and
:func:`run_on_loop` submits a coroutine to its loop and brings the outcome back. The
client behaviour suite (tests/client/test_behaviour.py) builds on these.

``open_driver(driver, path, name)`` connects with ``driver`` and yields a :class:`Driven`
whose ``run(fn)`` runs ``await fn(bus)`` where that bus lives: in the test's own trio
run for the trio ``Bus``, on the asyncio thread's loop for the ``AioBus``. ``fn`` is
written once against the API both buses share (``bus.queue``, ``bus.pipe``,
``bus.start_soon``...), so a difference between the drivers is a failing test.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

import msgq_trio
import msgq_trio.aio

ASYNC_DRIVERS = ["trio", "asyncio"]
#: A bound for waits that only a broken driver reaches (never a figure under test).
HANG = 30.0


async def run_on_loop(
    loop: asyncio.AbstractEventLoop, pending: set[asyncio.Task[Any]], coro: Coroutine[Any, Any, Any]
) -> Any:
    """Run ``coro`` on ``loop`` (another thread's) and return its result or raise its
    exception here; fails the test if it takes over ``HANG`` s. While it runs its task
    is in ``pending``, so that the loop outlives it (see :func:`asyncio_bus`)."""

    async def tracked() -> Any:
        task = asyncio.current_task()
        assert task is not None
        pending.add(task)
        try:
            return await coro
        finally:
            pending.discard(task)

    fut = asyncio.run_coroutine_threadsafe(tracked(), loop)

    def wait() -> Any:
        done, _ = concurrent.futures.wait([fut], HANG)
        if not done:
            fut.cancel()
            raise AssertionError(f"the asyncio client did not finish within {HANG} s")
        return fut.result()

    return await trio.to_thread.run_sync(wait)


@asynccontextmanager
async def asyncio_bus(
    path: Path | str,
    name: str,
    setup: Callable[[msgq_trio.aio.AioBus], Awaitable[None]] | None = None,
    **connect_kw: Any,
) -> AsyncIterator[tuple[asyncio.AbstractEventLoop, msgq_trio.aio.AioBus, set[asyncio.Task[Any]]]]:
    """An ``AioBus`` named ``name`` connected under ``asyncio.run`` in a thread of its
    own, after ``await setup(bus)`` there; yields its loop, the bus and the set of
    coroutines under way (:func:`run_on_loop`). Leaving the block closes the bus (its
    tasks are cancelled) once those coroutines finished; what the thread raised fails
    the test, and connect()'s error is raised here as the other drivers raise it."""
    ready = threading.Event()
    started: list[tuple[asyncio.AbstractEventLoop, msgq_trio.aio.AioBus, asyncio.Event]] = []
    pending: set[asyncio.Task[Any]] = set()
    errors: list[BaseException] = []

    async def main() -> None:
        async with msgq_trio.aio.connect(path, name, **connect_kw) as bus:
            if setup is not None:
                await setup(bus)
            stop = asyncio.Event()
            started.append((asyncio.get_running_loop(), bus, stop))
            ready.set()
            await stop.wait()
        # Methods still under way (a call the close fails) finish before asyncio.run
        # would cancel them: the test sees their outcome.
        if pending:
            await asyncio.wait(pending, timeout=HANG)

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
        if not started:  # connect() failed: its error, as the other drivers raise it
            assert len(errors) == 1, errors
            raise errors.pop()
        loop, bus, _stop = started[0]
        yield loop, bus, pending
    finally:
        if started:
            started[0][0].call_soon_threadsafe(started[0][2].set)
        await trio.to_thread.run_sync(thread.join, HANG)
    assert not thread.is_alive()
    assert errors == []


class Driven:
    """A connected bus of one driver; ``run(fn)`` runs ``fn(bus)`` on its event loop
    and returns its result or raises its exception here."""

    def __init__(
        self,
        bus: Any,
        loop: asyncio.AbstractEventLoop | None = None,
        pending: set[asyncio.Task[Any]] | None = None,
    ) -> None:
        self.bus = bus
        self.lname: str = bus.lname
        self._loop = loop
        self._pending = pending if pending is not None else set()

    async def run(self, fn: Callable[[Any], Awaitable[Any]]) -> Any:
        if self._loop is None:
            with trio.fail_after(HANG):
                return await fn(self.bus)

        async def coro() -> Any:
            return await fn(self.bus)

        return await run_on_loop(self._loop, self._pending, coro())


@asynccontextmanager
async def open_driver(driver: str, path: Path | str, name: str) -> AsyncIterator[Driven]:
    """A connection named ``name`` on ``driver`` (``trio`` or ``asyncio``); leaving the
    block closes it (tasks the bus started are cancelled)."""
    if driver == "trio":
        async with msgq_trio.connect(path, name) as bus:
            yield Driven(bus)
        return
    assert driver == "asyncio"
    async with asyncio_bus(path, name) as (loop, aio_bus, pending):
        yield Driven(aio_bus, loop, pending)
