"""Redis pub/sub benchmark clients on redis.asyncio (hiredis parser when installed):
``python -m msgq_trio.bench.worker_redis_aio SPEC_JSON``.

The ``redis-asyncio`` system: the server, options, channels, pipelines and request tags
of :mod:`msgq_trio.bench.worker_redis`, the client code written as an asyncio program
writes it:

* ``sub``: ``SUBSCRIBE`` (confirmed before READY), then ``async for`` over
  ``pubsub.listen()``;
* ``pub``: ``PUBLISH`` in non-transactional pipelines (as the sync client's);
* ``responder``: answers whatever arrived together in one pipeline (as the sync one);
* ``requester``: ``conc`` tasks each publishing a tagged request and awaiting its reply;
  one task reads the process's reply channel and hands each reply to its caller by its
  sequence number.

Every role runs under ``asyncio.timeout`` of the worker's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any

import redis.asyncio

from .common import Deadline, Spec, asyncio_role, payloads, ready, wait_go, worker_main
from .worker_redis import (
    CHANNEL,
    ECHO,
    TAG,
    check_first_batch,
    client_options,
    publish_batches,
    reply_channel,
)


async def _subscribe(r: Any, channel: str) -> Any:
    """A pubsub subscribed to ``channel``, once the server confirmed it."""
    ps = r.pubsub()
    await ps.subscribe(channel)
    async for m in ps.listen():
        if m["type"] == "subscribe":
            break
    return ps


async def _sub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n, size = spec["n"], spec["size"]
    count = bad = 0
    first = 0.0
    async with redis.asyncio.Redis(**client_options(spec, deadline)) as r:
        ps = await _subscribe(r, CHANNEL)
        ready()
        try:
            async with asyncio.timeout(deadline.left()):
                async for m in ps.listen():
                    if m["type"] != "message":
                        continue
                    if len(m["data"]) != size:
                        bad += 1
                    count += 1
                    if count == 1:
                        first = time.monotonic()
                    if count >= n:
                        break
        except TimeoutError:
            pass
        last = time.monotonic()
        await ps.aclose()
    return {"count": count, "bad": bad, "first": first, "last": last, "timeout": count < n}


async def _pub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n = spec["n"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    async with redis.asyncio.Redis(**client_options(spec, deadline)) as r:
        await r.ping()
        ready()
        await asyncio.to_thread(wait_go, deadline.left())
        start = time.monotonic()
        sent = 0
        pipe = r.pipeline(transaction=False)
        for batch in publish_batches(n, spec["size"], deadline):
            for i in batch:
                pipe.publish(CHANNEL, bodies[i & mask])
            check_first_batch(batch, await pipe.execute())
            sent = batch.stop
        end = time.monotonic()
    return {"sent": sent, "start": start, "end": end, "timeout": sent < n}


async def _responder(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    served = 0
    async with redis.asyncio.Redis(**client_options(spec, deadline)) as r:
        ps = await _subscribe(r, ECHO)
        ready()
        pipe = r.pipeline(transaction=False)
        # Serves until the parent ends this process (or the deadline).
        try:
            async with asyncio.timeout(deadline.left()):
                while True:
                    m = await ps.get_message(timeout=None)  # wait for one...
                    while m is not None:  # ... then take what else is there
                        if m["type"] == "message":
                            data = m["data"]
                            pipe.publish(reply_channel(TAG.unpack_from(data)[0]), data)
                            served += 1
                        m = await ps.get_message(timeout=0.0)
                    if len(pipe):
                        await pipe.execute()
        except TimeoutError:
            pass
    return {"served": served}


async def _requester(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    conc, calls = spec["conc"], spec["calls"]
    index = spec.get("index", 0)
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    lat: list[int] = []
    done = bad = 0
    waiting: dict[int, asyncio.Future[bytes]] = {}
    seq = 0

    async with redis.asyncio.Redis(**client_options(spec, deadline)) as r:
        ps = await _subscribe(r, reply_channel(index))

        async def replies() -> None:
            async for m in ps.listen():
                if m["type"] == "message":
                    data = m["data"]
                    waiting.pop(TAG.unpack_from(data)[1]).set_result(data)

        async def call(body: bytes) -> bytes:
            """Publish ``body`` tagged with a new sequence number; its reply."""
            nonlocal seq
            seq += 1
            request = TAG.pack(index, seq) + body
            reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            waiting[seq] = reply
            if not await r.publish(ECHO, request):
                raise RuntimeError("PUBLISH reached no responder")
            return (await reply)[TAG.size :]

        async def requester(slot: int) -> None:
            nonlocal done, bad
            clock = time.perf_counter_ns
            for i in range(calls):
                body = bodies[(i + slot) & mask]
                t0 = clock()
                reply = await call(body)
                lat.append(clock() - t0)
                if reply != body:
                    bad += 1
                done += 1

        reader = asyncio.create_task(replies())
        start = end = 0.0
        try:
            async with asyncio.timeout(deadline.left()):
                for i in range(spec.get("warmup", 0)):
                    await call(bodies[i & mask])
                ready()
                await asyncio.to_thread(wait_go, deadline.left())
                start = time.monotonic()
                await asyncio.gather(*(requester(s) for s in range(conc)))
        except TimeoutError:
            pass
        end = time.monotonic()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await ps.aclose()
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
