"""The link plugin (docs/QUEUE.md, "Chained queues / links"): forwards durable queues of
this broker to queues of other brokers, storing a message only at the last hop that has
not been acked from further down.

Registered as entry point ``link`` of group ``msgq_trio.plugins``; enable it with a
``[plugins.link]`` table with at least one ``[plugins.link.links.<name>]`` (``address``
and ``from_queue`` required). It needs the queue plugin on this broker (the upstream
queue) and on the downstream one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from .settings import LinkSettings, parse_settings

__all__ = ["PLUGIN", "LinkPlugin"]


class LinkPlugin:
    """The plugin object the entry point loads (see ``msgq_trio.plugins.api.Plugin``)."""

    name = "link"

    def check_config(self, table: Mapping[str, Any]) -> LinkSettings:
        return parse_settings(table)

    async def run(
        self,
        socket: Path,
        settings: LinkSettings,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the links until the connection to this broker ends. Ready at once: a
        link's downstream broker being unreachable is its normal "down" state, not a
        start failure (the upstream queue stores meanwhile)."""
        from .service import serve

        await serve(socket, settings, task_status=task_status)


PLUGIN = LinkPlugin()
