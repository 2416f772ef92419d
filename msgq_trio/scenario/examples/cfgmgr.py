"""The config manager of the example DNS system: ``python -m
msgq_trio.scenario.examples.cfgmgr N [--interval S] [--members M]``.

Waits until ``Auth`` has M members (the system's servers came up), prints ``ready``,
then pushes configuration versions 1..N, one every S seconds, to every member of ``Auth``
(``call_all``). A version is acked (history ``send`` ok) once every member it reached
applied it; a member that left meanwhile (``recipient-gone``) does not hold it up. Any
other error fails the version (history ``fail`` with the code). Exits 0 after N.
"""

from __future__ import annotations

import argparse

import trio

import msgq_trio
from msgq_trio.errors import NoRecipient

from ._history import History
from ._members import wait_for_members

#: A member that does not apply a version within this long fails it.
PUSH_TIMEOUT = 5.0


async def main(n: int, interval: float, members: int) -> None:
    h = History()
    async with msgq_trio.connect(name="cfgmgr") as bus:
        await wait_for_members(bus, "Auth", members)
        print("ready", flush=True)
        for v in range(1, n + 1):
            key = f"config:{v}"
            op = h.invoke("send", key=key, producer="cfgmgr", seq=v)
            try:
                results = await bus.call_all("Auth", "config", {"version": v}, timeout=PUSH_TIMEOUT)
            except NoRecipient:
                h.complete(op, "fail", "send", key=key, error="no-recipient")
            else:
                bad = [
                    r
                    for r in results
                    if not r.ok and getattr(r.error, "code", None) != "recipient-gone"
                ]
                if bad:
                    h.complete(
                        op,
                        "fail",
                        "send",
                        key=key,
                        error=str(getattr(bad[0].error, "code", bad[0].error)),
                    )
                else:
                    h.complete(op, "ok", "send", key=key)
            await trio.sleep(interval)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("n", type=int)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--members", type=int, default=1)
    a = p.parse_args()
    trio.run(main, a.n, a.interval, a.members)
