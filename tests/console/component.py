"""A component for the console's tests, run as its own process: joins group ARGV[2] as
client ARGV[3], declares ``get_zone_count(*, zone_class: str = "IN", verbose: bool =
False) -> int`` and prints its lname once ready; runs until killed."""

from __future__ import annotations

import sys

import trio

import msgq_trio


async def main(socket: str, group: str, name: str) -> None:
    async with msgq_trio.connect(socket, name=name) as bus:

        @bus.command("get_zone_count", raises=["not-found"])
        async def get_zone_count(*, zone_class: str = "IN", verbose: bool = False) -> int:
            """Count the zones of a class."""
            if zone_class not in ("IN", "CH"):
                raise msgq_trio.CommandFailed("not-found", f"no class {zone_class!r}")
            return 42 if zone_class == "IN" else 0

        await bus.subscribe(group)
        print(bus.lname, flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], sys.argv[3])
