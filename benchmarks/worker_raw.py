"""Ceiling clients over plain AF_UNIX stream sockets and ``u32 BE length | payload`` frames:
``python -m benchmarks.worker_raw SPEC_JSON``.

Two modes, chosen by ``spec["addr"]["mode"]``:

* ``direct`` (the ``raw-unix`` system): no broker at all. Each subscriber listens on
  ``DIR/sub<i>.sock`` and the publisher connects to every one and writes batched frames;
  the ``responder`` is an echo server on ``DIR/echo.sock``. This is what the kernel and a
  Python process can move process-to-process: the ceiling for any broker.
* ``relay`` (the ``py-relay`` system): every client connects to the relay of
  :mod:`benchmarks.relay` and says its role in a first 1-byte frame (``P``, ``S``,
  ``R`` or ``C``), answered by ``K``. Request frames carry a 4-byte caller id that the
  relay stamps and routes the echo back by.

Requesters run a closed loop with ``conc`` calls outstanding on one connection, which is
``conc`` sequential requesters multiplexed (replies come back in order).
"""

from __future__ import annotations

import selectors
import socket
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from .common import (
    LEN,
    Deadline,
    FrameReader,
    Spec,
    calls_result,
    payloads,
    ready,
    wait_go,
    worker_main,
)

#: Frames of small messages are written in batches of about this many bytes.
BATCH_BYTES = 64 * 1024
_POLL = 0.5  # socket timeout: loops re-check their deadline at least this often
ACK = LEN.pack(1) + b"K"
CALLER_ID = b"\0\0\0\0"


def _fill(reader: FrameReader, deadline: Deadline) -> int:
    """``reader.fill()`` that gives up at the deadline (TimeoutError)."""
    while True:
        try:
            return reader.fill()
        except TimeoutError:
            if deadline.expired():
                raise


def _connect(path: str | Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(path))
    s.settimeout(_POLL)
    return s


def _hello(sock: socket.socket, role: bytes, deadline: Deadline) -> FrameReader:
    """Relay mode: announce ``role`` and wait for the relay's ack."""
    sock.sendall(LEN.pack(1) + role)
    reader = FrameReader(sock)
    while True:
        if not _fill(reader, deadline):
            raise ConnectionError("relay closed the connection during the hello")
        start, stop, count, _ = reader.complete()
        if count:
            if count != 1 or bytes(reader.buf[start:stop]) != ACK:
                raise ConnectionError("relay answered the hello with something else")
            return reader


def _listen(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(64)
    s.settimeout(_POLL)
    return s


def _accept(listener: socket.socket, deadline: Deadline) -> socket.socket:
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if deadline.expired():
                raise
            continue
        conn.settimeout(_POLL)
        return conn


def _sub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    addr, n, size = spec["addr"], spec["n"], spec["size"]
    if addr["mode"] == "relay":
        sock = _connect(addr["socket"])
        reader = _hello(sock, b"S", deadline)
        ready()
    else:
        listener = _listen(Path(addr["dir"]) / f"sub{spec.get('index', 0)}.sock")
        ready()
        sock = _accept(listener, deadline)
        listener.close()
        reader = FrameReader(sock, max(1 << 20, 2 * (size + 4)))
    count = bad = 0
    first = 0.0
    timed_out = False
    try:
        while count < n:
            if not _fill(reader, deadline):
                break
            _, _, c, b = reader.complete(size)
            if c:
                if not count:
                    first = time.monotonic()
                count += c
                bad += b
    except TimeoutError:
        timed_out = True
    last = time.monotonic()
    sock.close()
    return {
        "count": count,
        "bad": bad,
        "first": first,
        "last": last,
        "timeout": timed_out or count < n,
    }


def _pub(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    addr, n, size = spec["addr"], spec["n"], spec["size"]
    if addr["mode"] == "relay":
        sock = _connect(addr["socket"])
        _hello(sock, b"P", deadline)
        socks = [sock]
    else:
        socks = [_connect(Path(addr["dir"]) / f"sub{i}.sock") for i in range(spec["subs"])]
    for s in socks:
        s.settimeout(max(1.0, deadline.left()))
    bodies = payloads(size, spec.get("seed", 0))
    mask = len(bodies) - 1
    prefix = LEN.pack(size)
    ready()
    wait_go(deadline.left())
    start = time.monotonic()
    sent = 0
    if size + 4 <= BATCH_BYTES:
        per_batch = max(1, BATCH_BYTES // (size + 4))
        frames = [prefix + b for b in bodies]
        batch = b"".join(frames[i & mask] for i in range(per_batch))
        while sent < n and not deadline.expired():
            k = min(per_batch, n - sent)
            data = batch if k == per_batch else batch[: k * (size + 4)]
            for s in socks:
                s.sendall(data)
            sent += k
    else:
        while sent < n and not deadline.expired():
            body = bodies[sent & mask]
            for s in socks:
                s.sendall(prefix)
                s.sendall(body)
            sent += 1
    end = time.monotonic()
    for s in socks:
        s.close()
    return {"sent": sent, "start": start, "end": end, "timeout": sent < n}


def _echo_server(spec: Spec) -> dict[str, Any]:
    """``raw-unix`` responder: echo every frame back on the connection it came from."""
    deadline = Deadline(spec["deadline"])
    listener = _listen(Path(spec["addr"]["dir"]) / "echo.sock")
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    ready()
    served = 0
    accepted = 0
    open_conns = 0
    clients = spec.get("clients", 1)
    while not deadline.expired() and (accepted < clients or open_conns):
        for key, _ in sel.select(timeout=_POLL):
            if key.data is None:
                conn, _ = listener.accept()
                conn.setblocking(True)
                sel.register(conn, selectors.EVENT_READ, FrameReader(conn))
                accepted += 1
                open_conns += 1
                continue
            reader: FrameReader = key.data
            if not reader.fill():
                sel.unregister(reader.sock)
                reader.sock.close()
                open_conns -= 1
                continue
            start, stop, count, _ = reader.complete()
            if count:
                reader.sock.sendall(memoryview(reader.buf)[start:stop])
                served += count
    return {"served": served}


def _relay_responder(spec: Spec) -> dict[str, Any]:
    """``py-relay`` responder: echo each request (caller id included) back to the relay."""
    deadline = Deadline(spec["deadline"])
    sock = _connect(spec["addr"]["socket"])
    reader = _hello(sock, b"R", deadline)
    ready()
    served = 0
    try:
        while _fill(reader, deadline):
            start, stop, count, _ = reader.complete()
            if count:
                sock.sendall(memoryview(reader.buf)[start:stop])
                served += count
    except TimeoutError:
        pass
    return {"served": served}


def _responder(spec: Spec) -> dict[str, Any]:
    if spec["addr"]["mode"] == "relay":
        return _relay_responder(spec)
    return _echo_server(spec)


def _requester(spec: Spec) -> dict[str, Any]:
    deadline = Deadline(spec["deadline"])
    addr, conc, size = spec["addr"], spec["conc"], spec["size"]
    total = conc * spec["calls"]
    bodies = payloads(size, spec.get("seed", 0))
    mask = len(bodies) - 1
    if addr["mode"] == "relay":
        sock = _connect(addr["socket"])
        reader = _hello(sock, b"C", deadline)
        frames = [LEN.pack(4 + size) + CALLER_ID + b for b in bodies]
        expect = 4 + size
    else:
        sock = _connect(Path(addr["dir"]) / "echo.sock")
        reader = FrameReader(sock)
        frames = [LEN.pack(size) + b for b in bodies]
        expect = size
    clock = time.perf_counter_ns

    def run(calls: int, outstanding: int, lat: list[int] | None) -> tuple[int, int]:
        """Closed loop: keep ``outstanding`` calls in flight until ``calls`` are answered."""
        sent = done = bad = 0
        t0s: deque[int] = deque()
        first = min(outstanding, calls)
        for i in range(first):
            t0s.append(clock())
            sock.sendall(frames[i & mask])
        sent = first
        while done < calls:
            if not _fill(reader, deadline):
                raise ConnectionError("the server closed the connection")
            _, _, count, b = reader.complete(expect)
            if not count:
                continue
            now = clock()
            bad += b
            done += count
            out = []
            for _ in range(count):
                t0 = t0s.popleft()
                if lat is not None:
                    lat.append(now - t0)
                if sent < calls:
                    out.append(frames[sent & mask])
                    t0s.append(now)
                    sent += 1
            if out:
                sock.sendall(b"".join(out))
        return done, bad

    run(spec.get("warmup", 0), 1, None)
    ready()
    wait_go(deadline.left())
    lat: list[int] = []
    start = time.monotonic()
    done, bad = 0, 0
    timed_out = False
    try:
        done, bad = run(total, conc, lat)
    except TimeoutError:
        timed_out = True
        done = len(lat)
    end = time.monotonic()
    sock.close()
    return calls_result(spec, done, bad, start, end, lat, timed_out=timed_out)


ROLES = {"sub": _sub, "pub": _pub, "responder": _responder, "requester": _requester}

if __name__ == "__main__":
    sys.exit(worker_main(ROLES))
