"""The zone manager of the example DNS system: ``python -m
msgq_trio.scenario.examples.zonemgr N [--rate R] [--timeout S] [--members M]``.

Waits until ``Xfrin`` has M members, prints ``ready``, then asks any worker
(``Xfrin[?]``) to transfer zones ``zone0.example`` .. ``zone{N-1}.example``, starting
R per second without waiting for earlier ones (several are pending on each worker at
once). Each ``call`` is recorded with its outcome: ``ok``, or ``fail`` with the error
code (``recipient-gone`` when the worker it reached died). The deadline S is long on
purpose (default 30 s): a caller the broker leaves waiting shows as silence in the
history, not as a quick timeout. Exits 0 once every transfer has an outcome.
"""

from __future__ import annotations

import argparse

import trio

import msgq_trio
from msgq_trio.errors import RpcError

from ._history import History
from ._members import wait_for_members


async def transfer(bus: msgq_trio.Bus, h: History, zone: str, timeout: float) -> None:
    op = h.invoke("call", key=zone)
    try:
        await bus.call("Xfrin[?]", "transfer", {"zone": zone, "serial": 1}, timeout=timeout)
    except RpcError as exc:
        h.complete(op, "fail", "call", key=zone, error=str(exc.code))
    else:
        h.complete(op, "ok", "call", key=zone)


async def main(n: int, rate: float, timeout: float, members: int) -> None:
    h = History()
    async with msgq_trio.connect(name="zonemgr") as bus:
        await wait_for_members(bus, "Xfrin", members)
        print("ready", flush=True)
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(transfer, bus, h, f"zone{i}.example", timeout)
                await trio.sleep(1 / rate)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("n", type=int)
    p.add_argument("--rate", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of one transfer")
    p.add_argument("--members", type=int, default=1)
    a = p.parse_args()
    trio.run(main, a.n, a.rate, a.timeout, a.members)
