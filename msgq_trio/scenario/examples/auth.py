"""An authoritative server of the example DNS system: ``python -m
msgq_trio.scenario.examples.auth [--swallow] [--drop-config]``.

A member of group ``Auth``. ``config {"version"}`` applies a configuration version (the
config manager pushes each one to every member) and answers it; ``query {"name"}``
answers with the version in force; ``stats`` answers its counters ``{"version",
"queries", "configs"}`` (the stats collector asks every member). Records a ``joined``
event once it is a member (it is owed every version pushed from then on), a ``deliver``
event per configuration version applied and a ``stats`` event per stats request (a
server answering only the collector is not silent). Runs until SIGTERM.

Deliberately broken variants, for scenarios that must catch them: ``--swallow`` never
answers a query; ``--drop-config`` answers a configuration push without applying it.
"""

from __future__ import annotations

import argparse
from typing import Any

import trio

import msgq_trio

from ._history import History


async def main(swallow: bool, drop_config: bool) -> None:
    h = History()
    version = 0
    queries = 0
    configs = 0
    async with msgq_trio.connect(name="auth") as bus:

        def config(params: Any) -> int:
            nonlocal version, configs
            v = int(params["version"])
            if not drop_config:
                configs += 1
                version = v
                h.event("deliver", key=f"config:{v}", producer="cfgmgr", seq=v)
            return v

        async def query(params: Any) -> dict[str, Any]:
            nonlocal queries
            if swallow:
                await trio.sleep_forever()
            queries += 1
            return {"name": params["name"], "version": version}

        def stats(params: Any) -> dict[str, int]:
            h.event("stats")
            return {"version": version, "queries": queries, "configs": configs}

        bus.add_command("config", config)
        bus.add_command("query", query)
        bus.add_command("stats", stats)
        await bus.subscribe("Auth")
        h.event("joined")
        print("ready", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--swallow", action="store_true")
    p.add_argument("--drop-config", action="store_true")
    a = p.parse_args()
    trio.run(main, a.swallow, a.drop_config)
