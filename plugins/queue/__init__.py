"""The durable store-and-forward queue plugin (docs/QUEUE.md), on LMDB.

Registered as entry point ``queue`` of group ``msgq_trio.plugins``; enable it with a
``[plugins.queue]`` table (``dir`` is required) or ``serve --plugin queue``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from ..api import CommandAccess
from .settings import QueueSettings, parse_settings

__all__ = ["ACCESS", "PLUGIN", "QueuePlugin"]

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
        from .runner import run_queue

        await run_queue(socket, settings, task_status=task_status)


PLUGIN = QueuePlugin()
