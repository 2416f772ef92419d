"""The named-pipe plugin (docs/PIPES.md): reliable, bounded byte streams between processes.

Registered as entry point ``pipe`` of group ``msgq_trio.plugins``; enable it with a
``[plugins.pipe]`` table (every key optional) or ``serve --plugin pipe``. Plain pipes
live in the plugin's memory and do not survive a plugin or broker restart; persistent
pipes (``persistent=True``, or configured) are stored in the LMDB directory ``dir`` and
do (docs/PIPES.md, "Persistent pipes").
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from .settings import PipeSettings, parse_settings

__all__ = ["PLUGIN", "PipePlugin"]


class PipePlugin:
    """The plugin object the entry point loads (see ``msgq_trio.plugins.api.Plugin``)."""

    name = "pipe"

    def check_config(self, table: Mapping[str, Any]) -> PipeSettings:
        return parse_settings(table)

    async def run(
        self,
        socket: Path,
        settings: PipeSettings,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Open the store (if ``dir`` is set), connect, serve the pipe commands until the
        bus connection ends."""
        from .service import serve

        await serve(socket, settings, task_status=task_status)


PLUGIN = PipePlugin()
