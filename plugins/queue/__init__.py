"""The durable store-and-forward queue plugin (docs/QUEUE.md), on LMDB.

Registered as entry point ``queue`` of group ``msgq_trio.plugins``; enable it with a
``[plugins.queue]`` table (``dir`` is required) or ``serve --plugin queue``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio
from msgq_trio.storage.api import StorageError

from msgq_trio.client.bus import connect
from msgq_trio.exposition import MetricsServer, open_plugin_listeners

from ..api import CommandAccess
from .metrics import AgeTracker, render_metrics
from .service import Service
from .settings import QueueSettings, max_store_size_for, parse_settings
from .tasks import Engine
from .writer import open_store_dir

__all__ = ["ACCESS", "PLUGIN", "QueuePlugin"]

log = logging.getLogger("msgq_trio.plugins.queue")

#: What each queue command needs from the access policy on the queue ``params["queue"]``
#: names (docs/SECURITY.md); the broker enforces it on ``[access] queue_group``.
#: Commands not listed (``stats``, ``queues``, ``producer_state``) need ``call`` only.
ACCESS = CommandAccess(
    group="msgq-queue",
    param="queue",
    verbs={
        "consume": "consume",
        "fetch": "consume",
        "ack": "consume",
        "nack": "consume",
        "cancel": "consume",
        "put": "produce",
        "put_many": "produce",
        "send": "produce",
        "declare": "produce",
        # peek reads messages without taking them; purge removes them all, as consuming
        # every one would.
        "peek": "consume",
        "purge": "consume",
    },
)


class QueuePlugin:
    """The plugin object the entry point loads (see ``msgq_trio.plugins.api.Plugin``)."""

    name = "queue"
    access = ACCESS

    def check_config(self, table: Mapping[str, Any]) -> QueueSettings:
        return parse_settings(table)

    async def run(
        self,
        socket: Path,
        settings: QueueSettings,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Open the store, recover, connect, serve until the bus connection ends; with
        ``settings.metrics``, serve ``/metrics`` too (plugins/queue/metrics.py).

        Resource handling: the store, its thread, the directory lock and the metrics
        listeners are released on every exit; nothing acked is lost by an exit at any
        point (it is committed).

        Raises:
            OSError: the store directory is unusable, or the ``metrics`` address cannot
                be bound (both before ready, so the broker's start fails; the message
                names the key).
        """
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


PLUGIN = QueuePlugin()
