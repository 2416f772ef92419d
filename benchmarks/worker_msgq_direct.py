"""msgq_trio benchmark clients on the direct (blocking) client:
``python -m benchmarks.worker_msgq_direct SPEC_JSON``.

The ``msgq_trio-direct`` system: the same broker as ``msgq_trio``, with
:func:`msgq_trio.connect_direct` clients (no event loop; the calling thread does the
socket I/O), as redis-py's blocking clients are on the Redis side. Roles:

* ``responder``: ``@bus.command("echo")`` returning its params, member of the echo group,
  ``bus.serve()`` until the deadline;
* ``requester``: ``conc`` threads, each with its own connection, each doing ``calls``
  sequential ``bus.call`` (a direct connection belongs to one thread).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from msgq_trio import DirectBus, connect_direct

from .common import Deadline, Spec, calls_result, payloads, ready, wait_go, worker_main
from .worker_msgq import ECHO


def _connect(spec: Spec, name: str) -> DirectBus:
    return connect_direct(spec["addr"]["socket"], name=name)


def _responder(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    served = 0
    with _connect(spec, "bench-echo") as bus:

        @bus.command("echo")
        def echo(params: Any) -> Any:
            nonlocal served
            served += 1
            return params

        bus.subscribe(ECHO)
        ready()
        # Serves until the parent ends this process (or the deadline).
        bus.serve(deadline.left())
    return {"served": served}


def _requester(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    conc, calls, size = spec["conc"], spec["calls"], spec["size"]
    bodies = payloads(size, spec.get("seed", 0))
    mask = len(bodies) - 1
    lat: list[int] = []
    done = [0] * conc
    errors = [0] * conc
    buses = [_connect(spec, f"bench-req-{spec.get('index', 0)}-{slot}") for slot in range(conc)]
    try:
        for bus in buses:
            for i in range(spec.get("warmup", 0)):
                bus.call(ECHO, "echo", bodies[i & mask])
        ready()
        wait_go(deadline.left())

        def requester(slot: int) -> None:
            call, clock = buses[slot].call, time.perf_counter_ns
            mine = lat if conc == 1 else []
            for i in range(calls):
                if deadline.expired():
                    break
                body = bodies[(i + slot) & mask]
                t0 = clock()
                reply = call(ECHO, "echo", body)
                mine.append(clock() - t0)
                if reply != body:
                    errors[slot] += 1
                done[slot] += 1
            if mine is not lat:
                lat.extend(mine)

        start = time.monotonic()
        if conc == 1:
            requester(0)
        else:
            threads = [threading.Thread(target=requester, args=(s,)) for s in range(conc)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(max(0.0, deadline.left()))
        end = time.monotonic()
    finally:
        for bus in buses:
            bus.close()
    return calls_result(spec, sum(done), sum(errors), start, end, lat)


ROLES = {"responder": _responder, "requester": _requester}

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
