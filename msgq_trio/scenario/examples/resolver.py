"""A resolver of the example DNS system, on the blocking client: ``python -m
msgq_trio.scenario.examples.resolver N [--rate R] [--timeout S]``.

Asks any ``Auth`` member (``Auth[?]``) N queries at R per second, each with a deadline
of S seconds; records each ``call`` with its outcome (``fail`` with the error code, e.g.
``recipient-gone`` when the member it reached crashed). Exits 0 after N.
"""

from __future__ import annotations

import argparse
import time

from msgq_trio import sync
from msgq_trio.errors import RpcError

from ._history import History


def main(n: int, rate: float, timeout: float) -> None:
    h = History()
    with sync.connect(name="resolver") as bus:
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
