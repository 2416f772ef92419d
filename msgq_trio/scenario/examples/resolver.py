"""A resolver of the example DNS system, on the blocking client: ``python -m
msgq_trio.scenario.examples.resolver N [--rate R] [--timeout S]``.

Waits until ``Auth`` has a member (the runner starts every program at once: a query
before any server joined would fail with ``no-recipient``, a startup race and not the
fault under test), prints ``ready``, then asks any ``Auth`` member (``Auth[?]``) N
queries at R per second, each with a deadline of S seconds; records each ``call`` with
its outcome (``fail`` with the error code, e.g. ``recipient-gone`` when the member it
reached crashed). Exits 0 after N.
"""

from __future__ import annotations

import argparse
import time

from msgq_trio import sync
from msgq_trio.errors import RpcError

from ._history import History
from ._members import wait_for_members_blocking


def main(n: int, rate: float, timeout: float) -> None:
    h = History()
    with sync.connect(name="resolver") as bus:
        wait_for_members_blocking(bus, "Auth", 1)
        print("ready", flush=True)
        for i in range(n):
            op = h.invoke("call", key=f"q{i}")
            try:
                bus.call("Auth[?]", "query", {"name": f"host{i}.example"}, timeout=timeout)
            except RpcError as exc:
                h.complete(op, "fail", "call", key=f"q{i}", error=str(exc.code))
            else:
                h.complete(op, "ok", "call", key=f"q{i}")
            time.sleep(1 / rate)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("n", type=int)
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--timeout", type=float, default=2.0)
    a = p.parse_args()
    main(a.n, a.rate, a.timeout)
