"""A zone transfer worker of the example DNS system: ``python -m
msgq_trio.scenario.examples.xfrin [--work S] [--swallow]``.

A member of group ``Xfrin``. ``transfer {"zone", "serial"}`` transfers the zone (here:
sleeps S seconds, as a real transfer waits on the network) and answers ``{"zone",
"serial"}``; transfers run concurrently, one task each. Records a ``joined`` event once
it is a member, and per transfer an ``invoke`` when it starts and ``ok`` when it
answers: a worker killed mid-transfer leaves them open (its callers must hear
``recipient-gone`` from the broker). Prints ``NAME has N pending`` (NAME its history
name) as each transfer starts, so a scenario can strike while transfers are pending on
it. Runs until SIGTERM.

Deliberately broken variant, for scenarios that must catch it: ``--swallow`` starts
every transfer and never answers it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import trio

import msgq_trio

from ._history import History


async def main(work: float, swallow: bool) -> None:
    h = History()
    me = os.environ.get("MSGQ_TRIO_CLIENT", "xfrin")
    pending = 0
    async with msgq_trio.connect(name="xfrin") as bus:

        @bus.command("transfer")
        async def transfer(params: Any) -> dict[str, Any]:
            nonlocal pending
            # A malformed request fails here (KeyError, ValueError: answered bad-request),
            # before it is recorded: it never was a transfer.
            zone, serial = str(params["zone"]), int(params["serial"])
            key = f"{zone}/{serial}"
            op = h.invoke("transfer", key=key)
            pending += 1
            print(f"{me} has {pending} pending", flush=True)
            try:
                if swallow:
                    await trio.sleep_forever()
                await trio.sleep(work)
            finally:
                pending -= 1
            h.complete(op, "ok", "transfer", key=key)
            return {"zone": zone, "serial": serial}

        await bus.subscribe("Xfrin")
        h.event("joined")
        print("ready", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=float, default=0.2, help="seconds one transfer takes")
    p.add_argument("--swallow", action="store_true")
    a = p.parse_args()
    trio.run(main, a.work, a.swallow)
