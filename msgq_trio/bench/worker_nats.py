"""NATS benchmark clients (nats-py, asyncio): ``python -m msgq_trio.bench.worker_nats SPEC``.

* ``sub``: ``nc.subscribe(subject, cb=...)`` with unbounded client-side pending limits
  (so the client never drops as a slow consumer), ``nc.flush()`` before READY so the
  server has the subscription;
* ``pub``: ``nc.publish`` ``n`` times (nats-py buffers and flushes in batches), ``flush``;
* ``responder``: a subscription whose callback ``msg.respond(msg.data)``;
* ``requester``: ``conc`` tasks doing ``nc.request`` on one connection (its mux inbox).
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import nats
import nats.errors

from .common import Deadline, Spec, asyncio_role, payloads, ready, wait_go, worker_main

SUBJECT = "bench.data"
ECHO = "bench.echo"


async def _connect(spec: Spec) -> Any:
    return await nats.connect(
        spec["addr"]["url"], allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5
    )


async def _sub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n, size = spec["n"], spec["size"]
    count = bad = 0
    first = 0.0
    done = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        nonlocal count, bad, first
        if len(msg.data) != size:
            bad += 1
        count += 1
        if count == 1:
            first = time.monotonic()
        if count >= n:
            done.set()

    nc = await _connect(spec)
    try:
        await nc.subscribe(SUBJECT, cb=on_msg, pending_msgs_limit=0, pending_bytes_limit=0)
        await nc.flush()
        ready()
        try:
            await asyncio.wait_for(done.wait(), deadline.left())
        except TimeoutError:
            pass
        last = time.monotonic()
    finally:
        await nc.close()
    return {"count": count, "bad": bad, "first": first, "last": last, "timeout": count < n}


async def _pub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n = spec["n"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    nc = await _connect(spec)
    try:
        ready()
        await asyncio.to_thread(wait_go, deadline.left())
        start = time.monotonic()
        sent = 0
        publish = nc.publish
        while sent < n and not deadline.expired():
            for i in range(sent, min(n, sent + 1000)):
                await publish(SUBJECT, bodies[i & mask])
            sent = min(n, sent + 1000)
        await nc.flush(timeout=max(1, int(deadline.left())))
        end = time.monotonic()
    finally:
        await nc.close()
    return {"sent": sent, "start": start, "end": end, "timeout": sent < n}


async def _responder(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    served = 0

    async def on_request(msg: Any) -> None:
        nonlocal served
        served += 1
        await msg.respond(msg.data)

    nc = await _connect(spec)
    try:
        await nc.subscribe(ECHO, cb=on_request, pending_msgs_limit=0, pending_bytes_limit=0)
        await nc.flush()
        ready()
        await asyncio.sleep(deadline.left())
    finally:
        await nc.close()
    return {"served": served}


async def _requester(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    conc, calls = spec["conc"], spec["calls"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    lat: list[int] = []
    done = bad = 0
    nc = await _connect(spec)
    try:
        for i in range(spec.get("warmup", 0)):
            await nc.request(ECHO, bodies[i & mask], timeout=max(1.0, deadline.left()))
        ready()
        await asyncio.to_thread(wait_go, deadline.left())

        async def requester(slot: int) -> None:
            nonlocal done, bad
            request, clock = nc.request, time.perf_counter_ns
            for i in range(calls):
                body = bodies[(i + slot) & mask]
                t0 = clock()
                reply = await request(ECHO, body, timeout=max(0.1, deadline.left()))
                lat.append(clock() - t0)
                if reply.data != body:
                    bad += 1
                done += 1

        start = time.monotonic()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(requester(s) for s in range(conc))), deadline.left()
            )
        except (TimeoutError, nats.errors.TimeoutError):
            pass
        end = time.monotonic()
    finally:
        await nc.close()
    out: dict[str, Any] = {
        "calls": done,
        "bad": bad,
        "start": start,
        "end": end,
        "timeout": done < conc * calls,
    }
    if spec.get("latencies"):
        out["lat_ns"] = lat
    return out


ROLES = {
    "sub": asyncio_role(_sub),
    "pub": asyncio_role(_pub),
    "responder": asyncio_role(_responder),
    "requester": asyncio_role(_requester),
}

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
