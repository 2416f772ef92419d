"""Redis pub/sub benchmark clients (redis-py, synchronous; hiredis parser when installed):
``python -m benchmarks.worker_redis SPEC_JSON``.

* ``sub``: ``SUBSCRIBE`` (confirmed before READY), then ``pubsub.listen()``;
* ``pub``: ``PUBLISH`` in non-transactional pipelines of 128 (a lone ``publish`` is a
  round trip each); the first batch must report a receiver;
* ``responder``: subscribed to ``bench.echo``; each request's first 2 bytes name the
  requester process; the replies to whatever arrived together are published in one
  pipeline to ``bench.reply.<process>``;
* ``requester``: subscribed to its own reply channel, keeps ``conc`` requests in flight
  (each tagged with a sequence number) and matches replies by it.

All connections use the broker's Unix socket; ``socket_timeout`` is the worker deadline.
The ``redis-asyncio`` system's clients (:mod:`benchmarks.worker_redis_aio`) share the
options, channels, pipelines and request tags defined here.
"""

from __future__ import annotations

import struct
import sys
import time
from collections.abc import Iterator
from typing import Any

import redis

from .common import Deadline, Spec, Tally, calls_result, payloads, ready, wait_go, worker_main

CHANNEL = "bench.data"
ECHO = "bench.echo"
PIPELINE = 128
#: ... and at most about this many bytes per pipeline (large messages go one by one).
PIPELINE_BYTES = 1024 * 1024
TAG = struct.Struct(">HI")  # requester process, sequence number


def reply_channel(process: int) -> str:
    """Where the responder publishes the replies to requester process ``process``."""
    return f"bench.reply.{process}"


def client_options(spec: Spec, deadline: Deadline) -> dict[str, Any]:
    """``redis.Redis`` (and ``redis.asyncio.Redis``) arguments for the run's server."""
    # Reads of up to 1 MiB (default 64 KiB) when messages are large: fewer recv calls.
    read_size = min(1024 * 1024, max(65536, spec.get("size", 0)))
    # RESP2: with RESP3 (redis-py 8's default) + hiredis, every pub/sub message goes
    # through a push handler that builds str(message) for a debug log line, even with
    # logging off: 95 % of a 4 MiB subscriber's time (py-spy). RESP2 is the classic path.
    return {
        "unix_socket_path": spec["addr"]["socket"],
        "protocol": 2,
        "socket_timeout": max(1.0, deadline.left()),
        "socket_read_size": read_size,
    }


def publish_batches(n: int, size: int, deadline: Deadline) -> Iterator[range]:
    """The message indexes of each PUBLISH pipeline: up to :data:`PIPELINE` messages or
    about :data:`PIPELINE_BYTES`, until ``n`` or the deadline."""
    per_pipeline = max(1, min(PIPELINE, PIPELINE_BYTES // size))
    sent = 0
    while sent < n and not deadline.expired():
        k = min(per_pipeline, n - sent)
        yield range(sent, sent + k)
        sent += k


def check_first_batch(batch: range, receivers: list[int]) -> None:
    """A first PUBLISH that reached nobody means the subscriber is not there: fail."""
    if not batch.start and not receivers[0]:
        raise RuntimeError("PUBLISH reached no subscriber")


def _client(spec: Spec, deadline: Deadline) -> Any:
    return redis.Redis(**client_options(spec, deadline))


def _subscribe(r: Any, channel: str, deadline: Deadline) -> Any:
    ps = r.pubsub()
    ps.subscribe(channel)
    while not deadline.expired():
        m = ps.get_message(timeout=1.0)
        if m is not None and m["type"] == "subscribe":
            return ps
    raise TimeoutError(f"no confirmation of SUBSCRIBE {channel}")


def _sub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    tally = Tally(spec)
    r = _client(spec, deadline)
    ps = _subscribe(r, CHANNEL, deadline)
    ready()
    timed_out = False
    try:
        for m in ps.listen():
            if m["type"] == "message" and tally.add(len(m["data"])):
                break
    except redis.TimeoutError:
        timed_out = True
    result = tally.result(timed_out=timed_out)
    ps.close()
    r.close()
    return result


def _pub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n = spec["n"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    r = _client(spec, deadline)
    r.ping()
    ready()
    wait_go(deadline.left())
    start = time.monotonic()
    sent = 0
    pipe = r.pipeline(transaction=False)
    for batch in publish_batches(n, spec["size"], deadline):
        for i in batch:
            pipe.publish(CHANNEL, bodies[i & mask])
        check_first_batch(batch, pipe.execute())
        sent = batch.stop
    end = time.monotonic()
    r.close()
    return {"sent": sent, "start": start, "end": end, "timeout": sent < n}


def _responder(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    r = _client(spec, deadline)
    ps = _subscribe(r, ECHO, deadline)  # a connection of its own, from r's pool
    ready()
    served = 0
    pipe = r.pipeline(transaction=False)
    while not deadline.expired():
        m = ps.get_message(timeout=min(1.0, deadline.left()))
        while m is not None:
            if m["type"] == "message":
                data = m["data"]
                pipe.publish(reply_channel(TAG.unpack_from(data)[0]), data)
                served += 1
            m = ps.get_message(timeout=0.0)
        if len(pipe):
            pipe.execute()
    return {"served": served}


def _requester(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    conc, calls, size = spec["conc"], spec["calls"], spec["size"]
    index = spec.get("index", 0)
    bodies = payloads(size, spec.get("seed", 0))
    mask = len(bodies) - 1
    r = _client(spec, deadline)
    ps = _subscribe(r, reply_channel(index), deadline)
    clock = time.perf_counter_ns
    replies = ps.listen()
    seq = 0

    def run(total: int, outstanding: int, lat: list[int] | None) -> tuple[int, int]:
        nonlocal seq
        t0s: dict[int, tuple[int, bytes]] = {}
        sent = done = bad = 0

        def send_one() -> None:
            nonlocal seq, sent
            seq += 1
            body = TAG.pack(index, seq) + bodies[sent & mask]
            t0s[seq] = (clock(), body)
            if not r.publish(ECHO, body):
                raise RuntimeError("PUBLISH reached no responder")
            sent += 1

        if not total:
            return 0, 0
        for _ in range(min(outstanding, total)):
            send_one()
        for m in replies:
            if m["type"] != "message":
                continue
            data = m["data"]
            t0, body = t0s.pop(TAG.unpack_from(data)[1])
            if lat is not None:
                lat.append(clock() - t0)
            if data != body:
                bad += 1
            done += 1
            if done >= total:
                break
            if sent < total:
                send_one()
        return done, bad

    run(spec.get("warmup", 0), 1, None)
    ready()
    wait_go(deadline.left())
    lat: list[int] = []
    start = time.monotonic()
    timed_out = False
    done = bad = 0
    try:
        done, bad = run(conc * calls, conc, lat)
    except redis.TimeoutError:
        timed_out = True
        done = len(lat)
    end = time.monotonic()
    return calls_result(spec, done, bad, start, end, lat, timed_out=timed_out)


ROLES = {"sub": _sub, "pub": _pub, "responder": _responder, "requester": _requester}

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
