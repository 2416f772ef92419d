"""What the queue plugin runs: open the store, recover, connect and serve.

Apart from the plugin object (``__init__.py``) because the broker loads that object at
every start to read the plugin's access declaration (plugins/loader.py), while only the
host of an enabled queue plugin runs this: the store, the engine, the bus client and the
metrics endpoint are imported here, not at that load.
"""

from __future__ import annotations

import logging
from pathlib import Path

import trio
from msgq_trio.storage.api import StorageError

from msgq_trio.client.bus import connect
from msgq_trio.exposition import MetricsServer, open_plugin_listeners

from .metrics import AgeTracker, render_metrics
from .service import Service
from .settings import QueueSettings, max_store_size_for
from .tasks import Engine
from .writer import open_store_dir

log = logging.getLogger("msgq_trio.plugins.queue")


async def run_queue(
    socket: Path,
    settings: QueueSettings,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """``QueuePlugin.run`` (its docstring states the contract)."""
    await trio.Path(settings.dir).mkdir(parents=True, exist_ok=True)
    bound = max_store_size_for(settings.dir, settings.max_store_size, settings.map_size)
    async with open_store_dir(
        Path(settings.dir),
        map_size=min(settings.map_size, bound),
        max_map_size=bound,
        sync=settings.sync,
        thread_name="msgq-queue-store",
    ) as (store, thread):
        log.info(
            "queue plugin: store %s, at most %d MiB%s",
            settings.dir,
            bound >> 20,
            "" if settings.max_store_size else " (90 % of the free space)",
        )
        engine = Engine(store, thread, settings)
        await engine.recover()
        for name, opts in settings.queues.items():
            await engine.declare(name, opts)
        listeners, shown = await open_plugin_listeners("queue", settings.metrics)
        # Always on: `stats` reports the oldest message's age too (the operators' first
        # question about a backlog), at one read-only probe of the store per period.
        ages = AgeTracker(engine)
        try:
            await ages.sample()  # before any commit: what is stored now is "recovered"
            async with (
                connect(socket, "msgq-queue") as bus,
                connect(socket, "msgq-queue-binder") as binder,
                trio.open_nursery() as nursery,
            ):
                service = Service(engine, bus, binder, nursery, ages)
                nursery.start_soon(engine.flush_loop)
                nursery.start_soon(engine.reaper)
                nursery.start_soon(service.forwarder)
                nursery.start_soon(ages.run)
                if listeners:
                    nursery.start_soon(
                        MetricsServer(listeners, lambda: render_metrics(engine, ages)).serve
                    )
                    log.info("queue plugin: metrics on http://%s/metrics", shown)
                await service.setup()
                task_status.started()
                await service.serve()
                log.info("queue plugin: the bus connection ended")
                nursery.cancel_scope.cancel()
        except BaseException as exc:
            if _only_cancelled(exc):  # a graceful stop (the host's SIGTERM)
                await _final_commit(engine)
            raise
        else:
            await _final_commit(engine)
        finally:
            for listener in listeners:  # closed already if the server ran
                await trio.aclose_forcefully(listener)


def _only_cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is trio's Cancelled, alone or in (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


async def _final_commit(engine: Engine) -> None:
    """The engine's final commit on a graceful stop (``Engine.final_commit``), shielded
    from the cancellation that stops the plugin. A failure is logged: what it left out
    behaves as after a crash (redelivered, at least once)."""
    with trio.CancelScope(shield=True):
        try:
            counts = await engine.final_commit()
        except StorageError as exc:
            log.error("queue plugin: the final commit failed: %s", exc)
            return
    log.info(
        "queue plugin: final commit: %d messages, %d marks, %d deletes",
        counts["messages"],
        counts["marks"],
        counts["deletes"],
    )
