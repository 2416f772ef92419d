"""RabbitMQ benchmark clients: ``python -m benchmarks.worker_rabbitmq SPEC``.

They use aiormq, the AMQP 0-9-1 layer aio-pika is built on (aio-pika's ``Message`` and
``IncomingMessage`` objects would only add per-message Python work to the clients). All
names carry ``spec["addr"]["ns"]`` (the run's directory name), since one server serves the
whole benchmark; every queue is exclusive or auto-deleted, so a run leaves nothing behind.

* ``sub``: an exclusive server-named queue bound to the fanout exchange ``<ns>``,
  consumed with ``no_ack`` (no per-message acknowledgement, like the other peers);
* ``pub``: ``basic_publish`` to that exchange without waiting for each frame to drain
  (the channel's bounded write queue still pushes back), then one publish that waits
  for the socket, so everything was handed to the kernel when it reports;
* ``responder``: consumes ``<ns>.rpc`` (``no_ack``) and publishes each body back to the
  request's ``reply_to`` with its ``correlation_id``;
* ``requester``: ``conc`` tasks on one channel, replies through RabbitMQ's direct
  reply-to pseudo-queue ``amq.rabbitmq.reply-to`` (no queue per requester), matched by
  ``correlation_id``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from .common import (
    Calls,
    Deadline,
    Spec,
    asyncio_roles,
    payloads,
    ready,
    wait_go,
    worker_main,
)

REPLY_TO = "amq.rabbitmq.reply-to"


async def _connect(spec: Spec) -> Any:
    import aiormq

    return await asyncio.wait_for(aiormq.connect(spec["addr"]["url"]), 15)


async def _sub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n, size, ns = spec["n"], spec["size"], spec["addr"]["ns"]
    count = bad = 0
    first = 0.0
    done = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        nonlocal count, bad, first
        if len(msg.body) != size:
            bad += 1
        count += 1
        if count == 1:
            first = time.monotonic()
        if count >= n:
            done.set()

    conn = await _connect(spec)
    try:
        ch = await conn.channel(publisher_confirms=False)
        await ch.exchange_declare(exchange=ns, exchange_type="fanout", auto_delete=True)
        declared = await ch.queue_declare(exclusive=True, auto_delete=True)
        await ch.queue_bind(declared.queue, ns)
        await ch.basic_consume(declared.queue, on_msg, no_ack=True)
        ready()
        try:
            await asyncio.wait_for(done.wait(), deadline.left())
        except TimeoutError:
            pass
        last = time.monotonic()
    finally:
        await conn.close()
    return {"count": count, "bad": bad, "first": first, "last": last, "timeout": count < n}


async def _pub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n, ns = spec["n"], spec["addr"]["ns"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    conn = await _connect(spec)
    sent = 0
    try:
        ch = await conn.channel(publisher_confirms=False)
        await ch.exchange_declare(exchange=ns, exchange_type="fanout", auto_delete=True)
        ready()
        await asyncio.to_thread(wait_go, deadline.left())
        start = time.monotonic()
        publish = ch.basic_publish
        while sent < n and not deadline.expired():
            last = min(n, sent + 1000)
            for i in range(sent, last):
                # The last one waits until the socket took it: nothing is left in aiormq.
                await publish(bodies[i & mask], exchange=ns, wait=i == n - 1)
            sent = last
        end = time.monotonic()
    finally:
        await conn.close()
    return {"sent": sent, "start": start, "end": end, "timeout": sent < n}


async def _responder(spec: Spec) -> dict[str, Any]:
    from aiormq import spec as amqp

    deadline = Deadline(spec["deadline"])
    queue = spec["addr"]["ns"] + ".rpc"
    served = 0
    conn = await _connect(spec)
    try:
        ch = await conn.channel(publisher_confirms=False)
        props = amqp.Basic.Properties

        async def on_request(msg: Any) -> None:
            nonlocal served
            served += 1
            p = msg.header.properties
            await ch.basic_publish(
                msg.body,
                routing_key=p.reply_to,
                wait=False,
                properties=props(correlation_id=p.correlation_id),
            )

        await ch.queue_declare(queue, auto_delete=True)
        await ch.basic_consume(queue, on_request, no_ack=True)
        ready()
        await asyncio.sleep(deadline.left())
    finally:
        await conn.close()
    return {"served": served}


async def _requester(spec: Spec) -> dict[str, Any]:
    from aiormq import spec as amqp

    deadline = Deadline(spec["deadline"])
    queue = spec["addr"]["ns"] + ".rpc"
    calls = Calls(spec)
    waiting: dict[str, asyncio.Future[bytes]] = {}
    loop = asyncio.get_running_loop()

    async def on_reply(msg: Any) -> None:
        fut = waiting.pop(msg.header.properties.correlation_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg.body)

    conn = await _connect(spec)
    try:
        ch = await conn.channel(publisher_confirms=False)
        await ch.basic_consume(REPLY_TO, on_reply, no_ack=True)
        props = amqp.Basic.Properties
        seq = 0

        async def call(body: bytes) -> bytes:
            nonlocal seq
            seq += 1
            cid = str(seq)
            fut: asyncio.Future[bytes] = loop.create_future()
            waiting[cid] = fut
            await ch.basic_publish(
                body,
                routing_key=queue,
                wait=False,
                properties=props(reply_to=REPLY_TO, correlation_id=cid),
            )
            return await asyncio.wait_for(fut, max(0.1, deadline.left()))

        await calls.warm_up(call)
        ready()
        await asyncio.to_thread(wait_go, deadline.left())

        start = time.monotonic()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(calls.loop(call, s) for s in range(spec["conc"]))),
                deadline.left(),
            )
        except TimeoutError:
            pass
        end = time.monotonic()
    finally:
        await conn.close()
    return calls.result(start, end)


ROLES = asyncio_roles(_sub, _pub, _responder, _requester)

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
