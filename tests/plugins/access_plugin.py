"""Plugins for tests/plugins/test_plugin_access.py, registered by that test through a
``.dist-info`` directory of its own (an ordinary entry point, as an installed
distribution has): ``tally`` declares the access verbs of its commands, ``badverb``
declares a verb the broker does not know.

``tally`` answers every request on the group ``tally`` with ``[command, params]``; its
commands ``bump`` and ``read`` act on the counter ``params["counter"]`` names. The
command ``gc-threshold`` answers its process's ``gc.get_threshold()`` instead.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio
from msgq_trio.plugins.api import CommandAccess

from msgq_trio.client.bus import Message, connect


class Tally:
    """A plugin whose command names appear nowhere in the broker."""

    name = "tally"
    access = CommandAccess(
        group="tally", param="counter", verbs={"bump": "produce", "read": "consume"}
    )

    def check_config(self, table: Mapping[str, Any]) -> dict[str, Any]:
        return dict(table)

    async def run(self, socket: Path, settings: Any, *, task_status: trio.TaskStatus[None]) -> None:
        async with connect(socket, "tally") as bus:

            def answer(params: Any, request: Message) -> list[Any]:
                if request.command == "gc-threshold":
                    return list(gc.get_threshold())
                return [request.command, params]

            bus.set_default_handler(answer)
            await bus.subscribe(self.access.group)
            task_status.started()
            await trio.sleep_forever()


class BadVerb(Tally):
    """Declares ``obliterate``, which is no access verb."""

    name = "badverb"
    access = CommandAccess(group="badverb", param="thing", verbs={"zap": "obliterate"})


PLUGIN = Tally()
BAD = BadVerb()
