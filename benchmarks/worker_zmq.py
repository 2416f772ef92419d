"""ZeroMQ benchmark processes (pyzmq, synchronous): ``python -m benchmarks.worker_zmq SPEC``.

The broker is a ``zmq.proxy`` process (role ``proxy``), over ``ipc://`` endpoints in the
run's temporary directory:

* ``mode: pubsub``: XSUB (publishers connect) -> XPUB (subscribers connect);
* ``mode: reqrep``: ROUTER (requesters connect) -> DEALER (the responder connects).

High-water marks are 0 (unbounded) on every socket: a PUB socket drops at its HWM, and a
benchmark that loses messages would only time out.

Subscriptions reach a publisher asynchronously, so each subscriber also subscribes to a
marker topic ``\\xffready-<i>``; the publisher is an XPUB socket and sends nothing until it
has seen every subscriber's marker (which follows its real subscription on the same pipe).

Requesters are DEALER sockets that send ``["", seq, body]`` (a REQ envelope) and keep
``conc`` requests in flight; the responder is a REP socket echoing ``[seq, body]``.
"""

from __future__ import annotations

import struct
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from .common import Deadline, Spec, calls_result, payloads, ready, wait_go, worker_main

_SEQ = struct.Struct(">I")
_POLL_MS = 500
#: Messages at least this large are received without a copy into ``bytes``.
_ZERO_COPY = 64 * 1024


def _endpoint(spec: Spec, name: str) -> str:
    return f"ipc://{Path(spec['addr']['dir']) / name}"


def _socket(ctx: Any, kind: int) -> Any:
    s = ctx.socket(kind)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.RCVTIMEO, _POLL_MS)
    return s


def _recv(sock: Any, deadline: Deadline, copy: bool = True) -> Any:
    """``sock.recv`` that gives up at the deadline (TimeoutError)."""
    while True:
        try:
            return sock.recv(copy=copy)
        except zmq.Again:
            if deadline.expired():
                raise TimeoutError("deadline") from None


def _proxy(spec: Spec) -> dict[str, Any]:
    ctx = zmq.Context()
    if spec["mode"] == "pubsub":
        front, back = _socket(ctx, zmq.XSUB), _socket(ctx, zmq.XPUB)
        front.bind(_endpoint(spec, "pub.ipc"))
        back.bind(_endpoint(spec, "sub.ipc"))
    else:
        front, back = _socket(ctx, zmq.ROUTER), _socket(ctx, zmq.DEALER)
        front.bind(_endpoint(spec, "req.ipc"))
        back.bind(_endpoint(spec, "rep.ipc"))
    for s in (front, back):
        s.setsockopt(zmq.RCVTIMEO, -1)
    ready()
    zmq.proxy(front, back)  # runs until the parent ends this process (or SIGALRM)
    return {}


def _sub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n, size = spec["n"], spec["size"]
    ctx = zmq.Context()
    s = _socket(ctx, zmq.SUB)
    s.connect(_endpoint(spec, "sub.ipc"))
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.SUBSCRIBE, b"\xffready-%d" % spec.get("index", 0))
    ready()
    copy = size < _ZERO_COPY
    count = bad = 0
    first = 0.0
    timed_out = False
    try:
        while count < n:
            msg = _recv(s, deadline, copy)
            if len(msg) != size:
                bad += 1
            count += 1
            if count == 1:
                first = time.monotonic()
    except TimeoutError:
        timed_out = True
    last = time.monotonic()
    s.close(linger=0)
    ctx.term()
    return {
        "count": count,
        "bad": bad,
        "first": first,
        "last": last,
        "timeout": timed_out or count < n,
    }


def _pub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    n = spec["n"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    ctx = zmq.Context()
    s = _socket(ctx, zmq.XPUB)
    s.connect(_endpoint(spec, "pub.ipc"))
    markers = {b"\x01\xffready-%d" % i for i in range(spec["subs"])}
    while markers:
        markers.discard(_recv(s, deadline))
    ready()
    wait_go(deadline.left())
    start = time.monotonic()
    sent = 0
    send = s.send
    while sent < n and not deadline.expired():
        for i in range(sent, min(n, sent + 1000)):
            send(bodies[i & mask])
        sent = min(n, sent + 1000)
    end = time.monotonic()
    s.close(linger=int(deadline.left() * 1000))  # flush what is queued, within the deadline
    ctx.term()
    return {"sent": sent, "start": start, "end": end, "timeout": sent < n}


def _responder(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    ctx = zmq.Context()
    s = _socket(ctx, zmq.REP)
    s.connect(_endpoint(spec, "rep.ipc"))
    ready()
    served = 0
    while not deadline.expired():
        try:
            parts = s.recv_multipart()
        except zmq.Again:
            continue
        s.send_multipart(parts)
        served += 1
    return {"served": served}


def _requester(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    conc, calls = spec["conc"], spec["calls"]
    bodies = payloads(spec["size"], spec.get("seed", 0))
    mask = len(bodies) - 1
    ctx = zmq.Context()
    s = _socket(ctx, zmq.DEALER)
    s.connect(_endpoint(spec, "req.ipc"))
    clock = time.perf_counter_ns
    seq = 0

    def run(total: int, outstanding: int, lat: list[int] | None) -> tuple[int, int]:
        nonlocal seq
        t0s: dict[bytes, tuple[int, bytes]] = {}
        sent = done = bad = 0

        def send_one() -> None:
            nonlocal seq, sent
            seq += 1
            tag, body = _SEQ.pack(seq), bodies[sent & mask]
            t0s[tag] = (clock(), body)
            s.send_multipart((b"", tag, body))
            sent += 1

        for _ in range(min(outstanding, total)):
            send_one()
        while done < total:
            try:
                _empty, tag, body = s.recv_multipart()
            except zmq.Again:
                if deadline.expired():
                    raise TimeoutError("deadline") from None
                continue
            t0, sent_body = t0s.pop(tag)
            if lat is not None:
                lat.append(clock() - t0)
            if body != sent_body:
                bad += 1
            done += 1
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
    except TimeoutError:
        timed_out = True
        done = len(lat)
    end = time.monotonic()
    s.close(linger=0)
    ctx.term()
    return calls_result(spec, done, bad, start, end, lat, timed_out=timed_out)


ROLES = {
    "proxy": _proxy,
    "sub": _sub,
    "pub": _pub,
    "responder": _responder,
    "requester": _requester,
}

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
