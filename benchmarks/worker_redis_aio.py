"""Redis pub/sub benchmark clients on redis.asyncio (hiredis parser when installed):
``python -m benchmarks.worker_redis_aio SPEC_JSON``.

The ``redis-asyncio`` system: the server, options, channels, pipelines and request tags
of :mod:`benchmarks.worker_redis`, the client code written as an asyncio program
writes it:

* ``sub``: ``SUBSCRIBE`` (confirmed before READY), then ``async for`` over
  ``pubsub.listen()``;
* ``pub``: ``PUBLISH`` in non-transactional pipelines (as the sync client's);
* ``responder``: answers whatever arrived together in one pipeline (as the sync one);
* ``requester``: ``conc`` tasks each publishing a tagged request and awaiting its reply;
  one task reads the process's reply channel and hands each reply to its caller by its
  sequence number.

Every wait is bounded by the worker's deadline: ``asyncio.timeout``, or for the
publisher the deadline checked before each pipeline and the socket timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any

import redis.asyncio

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
from .worker_redis import (
    CHANNEL,
    ECHO,
    TAG,
    check_first_batch,
    client_options,
    publish_batches,
    reply_channel,
)


async def _subscribe(r: Any, channel: str, deadline: Deadline) -> Any:
    """A pubsub subscribed to ``channel``, once the server confirmed it."""
    ps = r.pubsub()
    async with asyncio.timeout(deadline.left()):
        await ps.subscribe(channel)
        async for m in ps.listen():
            if m["type"] == "subscribe":
                break
    return ps


async def _sub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    tally = Tally(spec)
    timed_out = False
    async with redis.asyncio.Redis(**client_options(spec, deadline)) as r:
        ps = await _subscribe(r, CHANNEL, deadline)
        ready()
        try:
            async with asyncio.timeout(deadline.left()):
                async for m in ps.listen():
                    if m["type"] == "message" and tally.add(len(m["data"])):
                        break
        except TimeoutError:
            timed_out = True
        result = tally.result(timed_out=timed_out)
        await ps.aclose()
    return result


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
        ps = await _subscribe(r, ECHO, deadline)
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
    index = spec.get("index", 0)
    calls = Calls(spec)
    waiting: dict[int, asyncio.Future[bytes]] = {}
    seq = 0

    async with redis.asyncio.Redis(**client_options(spec, deadline)) as r:
        ps = await _subscribe(r, reply_channel(index), deadline)

        async def replies() -> None:
            async for m in ps.listen():
                if m["type"] == "message":
                    data = m["data"]
                    waiting.pop(TAG.unpack_from(data)[1]).set_result(data)

        async def call(body: bytes) -> bytes:
            """Publish ``body`` tagged with a new sequence number; its reply, untagged."""
            nonlocal seq
            seq += 1
            request = TAG.pack(index, seq) + body
            reply: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            waiting[seq] = reply
            if not await r.publish(ECHO, request):
                raise RuntimeError("PUBLISH reached no responder")
            return (await reply)[TAG.size :]

        reader = asyncio.create_task(replies())
        start = 0.0
        try:
            async with asyncio.timeout(deadline.left()):
                await calls.warm_up(call)
                ready()
                await asyncio.to_thread(wait_go, deadline.left())
                start = time.monotonic()
                await asyncio.gather(*(calls.loop(call, s) for s in range(spec["conc"])))
        except TimeoutError:
            pass
        end = time.monotonic()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        await ps.aclose()
    return calls.result(start, end)


ROLES = asyncio_roles(_sub, _pub, _responder, _requester)

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
