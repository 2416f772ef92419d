"""msgq_trio benchmark clients: ``python -m msgq_trio.bench.worker_msgq SPEC_JSON``.

Roles (see :mod:`msgq_trio.bench.common` for the spec and the READY/GO/RESULT lines):

* ``sub``: subscribe to the group, count ``n`` messages (``async for msg in bus``);
* ``pub``: ``bus.send(group, body)`` ``n`` times, then ``bus.flush()``;
* ``responder``: ``@bus.command("echo")`` returning its params, member of the echo group;
* ``requester``: ``conc`` tasks each doing ``calls`` sequential ``bus.call`` on one bus.

Bodies are ``bytes``, so they travel as CBOR byte strings.
"""

from __future__ import annotations

import sys
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import trio

from .. import Bus, connect
from .common import Deadline, Spec, payloads, ready, wait_go, worker_main

GROUP = "bench.data"
ECHO = "bench.echo"


def _connect(spec: Spec, name: str) -> AbstractAsyncContextManager[Bus]:
    """connect() to the run's broker: a Unix socket, or (msgq_trio-tcp / -tls) a URL with
    the run's token and, for TLS, the CA file that signed the broker's certificate."""
    addr = spec["addr"]
    ctx = None
    if addr.get("cafile"):
        import ssl

        ctx = ssl.create_default_context(cafile=addr["cafile"])
    return connect(addr["socket"], name=name, token=addr.get("token"), ssl_context=ctx)


def _run(fn: Any, spec: Spec) -> dict[str, Any]:
    result: dict[str, Any] = trio.run(fn, spec)
    return result


async def _sub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n, size = spec["n"], spec["size"]
    count = bad = 0
    first = last = 0.0
    async with _connect(spec, name=f"bench-sub-{spec.get('index', 0)}") as bus:
        await bus.subscribe(GROUP)
        ready()
        with trio.move_on_after(deadline.left()):
            async for msg in bus:
                if len(msg.body) != size:
                    bad += 1
                count += 1
                if count == 1:
                    first = time.monotonic()
                if count >= n:
                    break
        last = time.monotonic()
    return {"count": count, "bad": bad, "first": first, "last": last, "timeout": count < n}


async def _pub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n = spec["n"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    async with _connect(spec, name="bench-pub") as bus:
        ready()
        await trio.to_thread.run_sync(wait_go, deadline.left())
        start = time.monotonic()
        sent = 0
        with trio.move_on_after(deadline.left()):
            send = bus.send
            for i in range(n):
                await send(GROUP, bodies[i & mask])
                sent += 1
            await bus.flush()
        end = time.monotonic()
    return {"sent": sent, "start": start, "end": end, "timeout": sent < n}


async def _responder(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    served = 0
    async with _connect(spec, name="bench-echo") as bus:

        @bus.command("echo")
        def echo(params: Any) -> Any:
            nonlocal served
            served += 1
            return params

        await bus.subscribe(ECHO)
        ready()
        # Serves until the parent ends this process (or the deadline).
        await trio.sleep(deadline.left())
    return {"served": served}


async def _requester(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    conc, calls, size = spec["conc"], spec["calls"], spec["size"]
    bodies = payloads(size, spec.get("seed", 0))
    mask = len(bodies) - 1
    lat: list[int] = []
    done = 0
    errors = 0
    async with _connect(spec, name=f"bench-req-{spec.get('index', 0)}") as bus:
        for i in range(spec.get("warmup", 0)):
            await bus.call(ECHO, "echo", bodies[i & mask])
        ready()
        await trio.to_thread.run_sync(wait_go, deadline.left())

        async def requester(slot: int) -> None:
            nonlocal done, errors
            call, clock = bus.call, time.perf_counter_ns
            for i in range(calls):
                body = bodies[(i + slot) & mask]
                t0 = clock()
                reply = await call(ECHO, "echo", body)
                lat.append(clock() - t0)
                if reply != body:
                    errors += 1
                done += 1

        start = time.monotonic()
        with trio.move_on_after(deadline.left()):
            async with trio.open_nursery() as nursery:
                for slot in range(conc):
                    nursery.start_soon(requester, slot)
        end = time.monotonic()
    out: dict[str, Any] = {
        "calls": done,
        "bad": errors,
        "start": start,
        "end": end,
        "timeout": done < conc * calls,
    }
    if spec.get("latencies"):
        out["lat_ns"] = lat
    return out


ROLES = {
    "sub": lambda spec: _run(_sub, spec),
    "pub": lambda spec: _run(_pub, spec),
    "responder": lambda spec: _run(_responder, spec),
    "requester": lambda spec: _run(_requester, spec),
}

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
