"""The plugin contract: what a broker plugin provides and how the broker runs it.

A plugin is an object registered under the entry-point group ``msgq_trio.plugins``
(``[project.entry-points."msgq_trio.plugins"] name = "module:OBJECT"``) and enabled in the
broker's configuration (``[plugins.<name>]`` table, or ``serve --plugin NAME``).

How it runs (``plugins/supervisor.py``, ``plugins/host.py``): the broker starts one child
process per plugin, ``python -m msgq_trio.plugins.host NAME SOCKET SETTINGS-JSON``. The
child calls :meth:`Plugin.run`, which connects to the broker's socket as an ordinary
client. Why a child process and not tasks inside the broker:

* it can never corrupt routing: it only speaks the wire protocol, like any client;
* it uses another CPU core (the queue plugin's codec and storage work would otherwise
  compete with routing on the broker's single trio thread);
* a crash, a leak or a blocking call in a plugin cannot take the broker down.

Lifetime: the child dies with the broker. Its stdin is a pipe from the broker that is
never written; EOF on it (the broker exited, even by SIGKILL) ends the child at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import trio

__all__ = ["ENTRY_POINT_GROUP", "Plugin"]

#: The entry-point group plugins register under.
ENTRY_POINT_GROUP = "msgq_trio.plugins"


@runtime_checkable
class Plugin(Protocol):
    """What an entry point of group ``msgq_trio.plugins`` must load to.

    Attributes:
        name: the plugin's name (the entry point's name by convention).
    """

    name: str

    def check_config(self, table: Mapping[str, Any]) -> object:
        """Validate the plugin's ``[plugins.<name>]`` table; return its settings object.

        Called in the broker when the configuration is loaded (so a bad table stops the
        broker's start with exit status 2) and again in the plugin process.

        Raises:
            ValueError: naming the offending key and value.
        """
        ...

    async def run(self, socket: Path, settings: Any, *, task_status: trio.TaskStatus[None]) -> None:
        """Serve until cancelled or the bus connection is lost, in the plugin process.

        Call ``task_status.started()`` once the plugin is ready (connected, subscribed,
        recovered): the broker reports "listening" only when every plugin is ready.
        Returning or raising ends the plugin process; the supervisor restarts it.
        """
        ...
