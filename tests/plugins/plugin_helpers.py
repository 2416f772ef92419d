"""Helpers of the plugin tests: waiting on state held in other processes."""

from __future__ import annotations

import inspect
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio
from msgq_trio.plugins.queue.settings import QueueSettings
from msgq_trio.plugins.queue.tasks import Engine
from msgq_trio.plugins.queue.writer import StoreThread
from msgq_trio.storage.memory import MemoryQueueStore

from msgq_trio.errors import RpcError


async def eventually(cond: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Poll ``cond`` (sync or async) until truthy and return its value: the state is in
    another process, so there is nothing to wait on. Fails after ``timeout`` s."""
    with trio.fail_after(timeout):
        while True:
            value = cond()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await trio.sleep(0.02)


async def put_until_stored(q: Any, body: Any, seq: int) -> None:
    """Put with a fixed seq, resending after a failure (the plugin is restarting), as a
    producer that must not lose a message does; dedup makes the resend harmless."""
    with trio.fail_after(30):
        while True:
            try:
                assert await q.put(body, seq=seq) in ("stored", "consumed", "duplicate")
                return
            except RpcError:
                await trio.sleep(0.05)


def ready_plugin_pids(log: str, plugin: str = "queue") -> list[int]:
    """Pids of the ``plugin`` processes a broker's log says became ready, oldest first."""
    return [int(p) for p in re.findall(rf"plugin {plugin} ready \(pid (\d+)\)", log)]


def ready_plugin_pid(broker: Any, plugin: str = "queue") -> int:
    """The pid of the newest ``plugin`` process the broker's log says is ready, waiting
    for that line: the broker writes its log from a thread, so the line can land after
    the plugin already answers clients."""
    return ready_plugin_pids(broker.log_with(f"plugin {plugin} ready"), plugin)[-1]


@asynccontextmanager
async def engine_on_memory_store(**settings: Any) -> AsyncIterator[tuple[Engine, trio.Nursery]]:
    """A queue engine in this process on the memory store, with queue ``q`` declared and
    no flush loop running (a test starts it when it wants commits): for driving the
    engine's races step by step. Defaults: 4 messages resident, no ack grace."""
    cfg = QueueSettings(
        **{
            "dir": "unused",
            "resident_messages": 4,
            "resident_bytes": 1 << 20,
            "ack_grace": 0,
            **settings,
        }
    )
    with MemoryQueueStore() as store, StoreThread() as thread:
        engine = Engine(store, thread, cfg)
        async with trio.open_nursery() as nursery:
            engine.nursery = nursery
            await engine.declare("q", None)
            try:
                yield engine, nursery
            finally:
                nursery.cancel_scope.cancel()
