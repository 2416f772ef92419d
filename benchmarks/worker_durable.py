"""Durable acked publish producers: ``python -m benchmarks.worker_durable SPEC_JSON``.

Every role publishes ``n`` bodies of ``size`` bytes to a durable store, keeping at most
``window`` messages unacknowledged, and reports ``msgs_per_s`` (``n`` over the time from
the first publish to the last ack), ``lat_ns`` percentiles of each message's ack latency
(publish call to ack), and ``acked``. The READY/GO/RESULT lines are those of
:mod:`benchmarks.common`.

* ``nats-js``: a JetStream stream with file storage; asynchronous publishes (a PUB with
  a reply subject per message, acks counted on one wildcard subscription); an ack is the
  server's PubAck (NATS acks once the message is in its file store's write buffer,
  before any fsync);
* ``redis-streams``: ``XADD`` in pipelines of ``window`` commands (redis-py, hiredis,
  RESP2) to a server with ``appendonly yes``, ``appendfsync everysec``; an ack is the
  pipeline's reply (before the once-a-second fsync); all messages of a pipeline get its
  round-trip time as their latency;
* ``rabbitmq``: aio-pika, a durable classic queue, persistent messages, a channel with
  publisher confirms and ``window`` publishers in flight; an ack is the broker's confirm
  (sent after the message is fsynced, or consumed);
* ``msgq-durable``: calls :func:`benchmarks.durable_msgq.run_durable` (the queue
  plugin's own harness) in this process, so the parent's deadline bounds it too.
"""

from __future__ import annotations

import asyncio
import importlib
import sys
import time
from pathlib import Path
from typing import Any

from .common import Deadline, Spec, payloads, percentiles, ready, wait_go, worker_main


def _figures(n: int, acked: int, start: float, end: float, lat: list[int]) -> dict[str, Any]:
    pct = percentiles(lat)
    return {
        "acked": acked,
        "start": start,
        "end": end,
        "timeout": acked < n,
        "msgs_per_s": acked / (end - start) if end > start else 0.0,
        "percentiles_us": {k: v / 1000 for k, v in pct.items()},
    }


async def _nats_js(spec: Spec) -> dict[str, Any]:
    import nats
    from nats.js.api import StorageType, StreamConfig

    deadline = Deadline(spec["deadline"])
    n, window = spec["n"], spec["window"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    nc = await nats.connect(
        spec["addr"]["url"], allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5
    )
    clock = time.perf_counter_ns
    sent_at = [0] * n
    lat: list[int] = []
    acked = 0
    room = asyncio.Event()
    room.set()
    all_acked = asyncio.Event()

    # JetStream's async publish on the wire: a plain PUB with a reply subject, the PubAck
    # arriving there. One wildcard subscription takes every ack; nats-py's publish_async
    # makes a future and an inbox per message, which costs it 3x the client CPU here.
    async def on_ack(msg: Any) -> None:
        nonlocal acked
        lat.append(clock() - sent_at[int(msg.subject.rsplit(".", 1)[1])])
        acked += 1
        if acked >= n:
            all_acked.set()
        room.set()

    start = time.monotonic()  # replaced at GO; set here so a failed wait_go leaves a value
    try:
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(name="BENCH", subjects=["bench.durable"], storage=StorageType.FILE)
        )
        inbox = nc.new_inbox()
        await nc.subscribe(inbox + ".*", cb=on_ack, pending_msgs_limit=0, pending_bytes_limit=0)
        await nc.flush()
        ready()
        await asyncio.to_thread(wait_go, deadline.left())
        start = time.monotonic()
        publish = nc.publish
        for i in range(n):
            while i - acked >= window:
                room.clear()
                await asyncio.wait_for(room.wait(), max(0.1, deadline.left()))
            sent_at[i] = clock()
            await publish("bench.durable", bodies[i & mask], reply=f"{inbox}.{i}")
        await asyncio.wait_for(all_acked.wait(), max(0.1, deadline.left()))
        end = time.monotonic()
    except TimeoutError:
        end = time.monotonic()
    finally:
        await nc.close()
    return _figures(n, acked, start, end, lat)


def _redis_streams(spec: Spec) -> dict[str, Any]:
    import redis

    deadline = Deadline(spec["deadline"])
    n, window = spec["n"], spec["window"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    r = redis.Redis(unix_socket_path=spec["addr"]["socket"], protocol=2)
    lat: list[int] = []
    acked = 0
    try:
        r.ping()
        ready()
        wait_go(deadline.left())
        clock = time.perf_counter_ns
        start = time.monotonic()
        while acked < n and not deadline.expired():
            batch = min(window, n - acked)
            pipe = r.pipeline(transaction=False)
            command = pipe.execute_command  # xadd() would only rebuild these arguments
            for i in range(acked, acked + batch):
                command("XADD", "bench-durable", "*", "b", bodies[i & mask])  # type: ignore[no-untyped-call]
            t0 = clock()
            ids = pipe.execute()
            took = clock() - t0
            lat.extend([took] * len(ids))
            acked += len(ids)
        end = time.monotonic()
    finally:
        r.close()
    return _figures(n, acked, start, end, lat)


async def _rabbitmq(spec: Spec) -> dict[str, Any]:
    import aio_pika

    deadline = Deadline(spec["deadline"])
    n, window = spec["n"], spec["window"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    queue_name = f"bench-durable-{spec.get('seed', 0)}"
    conn = await aio_pika.connect(spec["addr"]["url"], timeout=10)
    lat: list[int] = []
    acked = 0
    try:
        channel = await conn.channel(publisher_confirms=True)
        queue = await channel.declare_queue(queue_name, durable=True)
        await queue.purge()
        exchange = channel.default_exchange
        ready()
        await asyncio.to_thread(wait_go, deadline.left())
        clock = time.perf_counter_ns
        next_i = 0

        async def publisher() -> None:
            nonlocal next_i, acked
            while next_i < n:
                i = next_i
                next_i += 1
                msg = aio_pika.Message(
                    bodies[i & mask], delivery_mode=aio_pika.DeliveryMode.PERSISTENT
                )
                t0 = clock()
                await exchange.publish(msg, routing_key=queue_name)
                lat.append(clock() - t0)
                acked += 1

        start = time.monotonic()
        try:
            await asyncio.wait_for(
                asyncio.gather(*(publisher() for _ in range(window))), max(0.1, deadline.left())
            )
        except TimeoutError:
            pass
        end = time.monotonic()
        await queue.delete(if_unused=False, if_empty=False)
    finally:
        await conn.close()
    return _figures(n, acked, start, end, lat)


def _msgq_durable(spec: Spec) -> dict[str, Any]:
    ready()
    wait_go(spec["deadline"])
    try:
        # Imported lazily and by name: written with the queue plugin, absent until it lands.
        run_durable = importlib.import_module(".durable_msgq", __package__).run_durable
    except (ImportError, AttributeError) as exc:
        return {"na": "queue plugin not available", "why": f"{type(exc).__name__}: {exc}"}
    # A failure of the harness is an error (worker_main reports it), not n/a: the smoke
    # test must notice when the durable workload breaks.
    res = run_durable(
        spec["n"],
        spec["size"],
        spec["producers"],
        spec["consumer"],
        Path(spec["workdir"]),
        spec["timeout"],
    )
    return {"result": dict(res)}


ROLES = {
    "nats-js": lambda spec: asyncio.run(_nats_js(spec)),
    "redis-streams": _redis_streams,
    "rabbitmq": lambda spec: asyncio.run(_rabbitmq(spec)),
    "msgq-durable": _msgq_durable,
}

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
