"""NATS benchmark clients (nats-py, asyncio): ``python -m benchmarks.worker_nats SPEC``.

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

from .common import (
    Calls,
    Deadline,
    Spec,
    Tally,
    asyncio_roles,
    payloads,
    ready,
    wait_go,
    worker_main,
)

SUBJECT = "bench.data"
ECHO = "bench.echo"


async def _connect(spec: Spec) -> Any:
    return await nats.connect(
        spec["addr"]["url"], allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5
    )


async def _sub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    tally = Tally(spec)
    done = asyncio.Event()
    timed_out = False

    async def on_msg(msg: Any) -> None:
        if tally.add(len(msg.data)):
            done.set()

    nc = await _connect(spec)
    try:
        await nc.subscribe(SUBJECT, cb=on_msg, pending_msgs_limit=0, pending_bytes_limit=0)
        await nc.flush()
        ready()
        try:
            await asyncio.wait_for(done.wait(), deadline.left())
        except TimeoutError:
            timed_out = True
        result = tally.result(timed_out=timed_out)
    finally:
        await nc.close()
    return result


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
    calls = Calls(spec)
    nc = await _connect(spec)

    async def call(body: bytes) -> bytes:
        reply = await nc.request(ECHO, body, timeout=max(0.1, deadline.left()))
        data: bytes = reply.data
        return data

    try:
        await calls.warm_up(call)
        ready()
        await asyncio.to_thread(wait_go, deadline.left())
        start = time.monotonic()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(calls.loop(call, s) for s in range(spec["conc"]))),
                deadline.left(),
            )
        except (TimeoutError, nats.errors.TimeoutError):
            pass
        end = time.monotonic()
    finally:
        await nc.close()
    return calls.result(start, end)


ROLES = asyncio_roles(_sub, _pub, _responder, _requester)

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
