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
never written; EOF on it (the broker exited, even by SIGKILL) cancels the plugin's
``run``, and the process exits within ``BROKER_GONE_EXIT`` (1 s) whatever the plugin
still does: a restarted broker's plugin may be waiting for its resources. SIGTERM (the
supervisor's stop) cancels ``run`` too. Either way a plugin can finish what it holds
(the queue plugin's final commit) before the process exits.

Access: a plugin whose commands act on objects of its own (the queue plugin's queues)
declares the verb each command needs in an optional ``access`` attribute, a
:class:`CommandAccess` (group, params key, command -> verb). The broker reads it when it
starts (``plugins/loader.py``: for every enabled plugin, and for the ``queue`` plugin
always) and checks a restricted client's request to that group for the declared verb on
the object ``params[param]`` names, besides ``call`` on the group (docs/SECURITY.md). A
declaration naming a verb the broker does not know stops the broker's start with an
error naming the plugin. The broker's core knows no plugin's command names.

What a plugin may import (``tests/test_layering.py``): this API and the rest of
``msgq_trio.plugins``, the clients (``msgq_trio.client``), the protocol, the errors,
the configuration's value types, the storage backends and the shared metrics endpoint
(``msgq_trio.exposition``); never the broker's core (``msgq_trio.core``), its daemon
(``msgq_trio.io``) or its operations layer (``msgq_trio.ops``). A plugin is a client
of the broker, not a part of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import trio

from msgq_trio.config import ACCESS_VERBS, CommandAccess

__all__ = ["ACCESS_VERBS", "ENTRY_POINT_GROUP", "CommandAccess", "Plugin"]

#: The entry-point group plugins register under.
ENTRY_POINT_GROUP = "msgq_trio.plugins"


@runtime_checkable
class Plugin(Protocol):
    """What an entry point of group ``msgq_trio.plugins`` must load to.

    Attributes:
        name: the plugin's name (the entry point's name by convention).
        access: optional (not part of the runtime check, so a plugin may leave it out):
            a :class:`CommandAccess`, the verbs its commands need on the objects their
            params name; see the module docstring.
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
