"""The durable store-and-forward queue plugin (docs/QUEUE.md), on LMDB.

Registered as entry point ``queue`` of group ``msgq_trio.plugins``; enable it with a
``[plugins.queue]`` table (``dir`` is required) or ``serve --plugin queue``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio
from msgq_trio.storage.lmdb_store import LmdbQueueStore

from msgq_trio.client.bus import connect

from .engine import Engine
from .service import Service
from .settings import QueueSettings, parse_settings
from .writer import StoreThread

__all__ = ["PLUGIN", "QueuePlugin"]

log = logging.getLogger("msgq_trio.plugins.queue")

#: How long a new plugin process waits for the previous one to release the store (it
#: exits as soon as it sees the broker gone; 30 s covers a slow final commit).
LOCK_TIMEOUT = 30.0


async def _lock_dir(path: Path) -> int:
    """Take an exclusive lock on ``path/plugin.lock``; returns the fd (closing releases).

    One process owns a store directory at a time (LMDB map growth is not coordinated
    between processes). A previous plugin process of a killed broker may still be
    exiting: wait for it.

    Raises:
        RuntimeError: the lock was not free within LOCK_TIMEOUT (names the file).
    """
    fd = os.open(path / "plugin.lock", os.O_RDWR | os.O_CREAT, 0o600)
    with trio.move_on_after(LOCK_TIMEOUT):
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            await trio.sleep(0.05)
    os.close(fd)
    raise RuntimeError(f"{path / 'plugin.lock'} is held by another process for "
                       f"{LOCK_TIMEOUT} s: is another queue plugin using this directory?")


class QueuePlugin:
    """The plugin object the entry point loads (see ``msgq_trio.plugins.api.Plugin``)."""

    name = "queue"

    def check_config(self, table: Mapping[str, Any]) -> QueueSettings:
        return parse_settings(table)

    async def run(
        self, socket: Path, settings: QueueSettings, *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Open the store, recover, connect, serve until the bus connection ends.

        Resource handling: the store, its thread and the directory lock are released on
        every exit; nothing acked is lost by an exit at any point (it is committed).
        """
        path = Path(settings.dir)
        await trio.Path(path).mkdir(parents=True, exist_ok=True)
        lock = await _lock_dir(path)
        try:
            store = LmdbQueueStore(path, map_size=settings.map_size,
                                   max_map_size=settings.max_map_size, sync=settings.sync)
            with store, StoreThread() as thread:
                engine = Engine(store, thread, settings)
                await engine.recover()
                for name, opts in settings.queues.items():
                    await engine.declare(name, opts)
                async with connect(socket, "msgq-queue") as bus, \
                        connect(socket, "msgq-queue-binder") as binder, \
                        trio.open_nursery() as nursery:
                    service = Service(engine, bus, binder, nursery)
                    nursery.start_soon(engine.flush_loop)
                    nursery.start_soon(engine.reaper)
                    nursery.start_soon(service.forwarder)
                    await service.setup()
                    task_status.started()
                    await service.serve()
                    log.info("queue plugin: the bus connection ended")
                    nursery.cancel_scope.cancel()
        finally:
            os.close(lock)


PLUGIN = QueuePlugin()
