"""What every benchmark worker process shares: its spec, the READY/GO/RESULT handshake
with the parent, payloads, and a parser for 4-byte length-prefixed frames.

A worker is started as ``python -m benchmarks.worker_<system> SPEC_JSON``. The spec
is a JSON object with at least ``role`` and ``deadline`` (seconds the worker may live).
The worker talks to the parent over its standard streams, one line each:

* ``READY`` on stdout once it is connected (a subscriber: once subscribed);
* a sender then waits for ``GO`` on stdin, so every sender starts at the same moment and
  no process start-up time is measured;
* ``RESULT {json}`` on stdout as its last line (``{"error": ...}`` on failure). Every
  result carries ``cpu``: the worker's CPU seconds (user + system, all threads) since
  its READY, or since GO for a sender.

Every loop in a worker is bounded by a count and by the deadline; ``SIGALRM`` at the
deadline plus a few seconds ends a worker that is stuck anyway.
"""

from __future__ import annotations

import gc
import json
import math
import random
import select
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

Spec = dict[str, Any]
RoleFn = Callable[[Spec], dict[str, Any]]

READY = "READY"
GO = "GO"
RESULT = "RESULT"
#: Extra seconds a worker gets past its deadline before SIGALRM ends it.
ALARM_GRACE = 5
LEN = struct.Struct(">I")
#: FrameReader keeps at least this much free room for each receive.
_MIN_ROOM = 64 * 1024


class Deadline:
    """A point in ``time.monotonic()`` time (comparable across processes on Linux)."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (never negative)."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at


def payloads(size: int, seed: int = 0) -> list[bytes]:
    """Distinct random bodies of ``size`` bytes to cycle through (16, or 2 when large).

    The count is a power of two so ``bodies[i & (len - 1)]`` picks one.
    """
    rnd = random.Random(seed)
    count = 16 if size <= 64 * 1024 else 2
    return [rnd.randbytes(size) for _ in range(count)]


_cpu_mark = 0.0


def _mark_cpu() -> None:
    global _cpu_mark
    _cpu_mark = time.process_time()


def ready() -> None:
    """Tell the parent this worker is connected (and subscribed).

    Every worker, whatever system it measures, runs a full garbage collection first: a
    fresh process owes one for the objects its imports left, and in a short run it
    would fall inside the measured window of whichever client allocates, as a one-off
    of a few milliseconds that a long-running process paid long ago.
    """
    gc.collect()
    _mark_cpu()
    sys.stdout.write(READY + "\n")
    sys.stdout.flush()


def wait_go(timeout: float) -> None:
    """Block until the parent writes ``GO`` on stdin.

    Raises:
        TimeoutError: no GO within ``timeout`` seconds.
        EOFError: the parent closed stdin (it gave up on this run).
    """
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError("no GO from the parent")
        r, _, _ = select.select([sys.stdin], [], [], left)
        if r:
            line = sys.stdin.readline()
            if not line:
                raise EOFError("the parent closed stdin before GO")
            if line.strip() == GO:
                _mark_cpu()
                return


def emit(result: Mapping[str, Any]) -> None:
    sys.stdout.write(RESULT + " " + json.dumps(result, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def asyncio_role(fn: Callable[[Spec], Any]) -> RoleFn:
    """A worker role from ``async fn(spec)`` (the asyncio peers' clients): runs it in a
    fresh event loop and returns its result."""

    def role(spec: Spec) -> dict[str, Any]:
        import asyncio  # only the asyncio workers need it

        result: dict[str, Any] = asyncio.run(fn(spec))
        return result

    return role


def asyncio_roles(
    sub: Callable[[Spec], Any],
    pub: Callable[[Spec], Any],
    responder: Callable[[Spec], Any],
    requester: Callable[[Spec], Any],
) -> dict[str, RoleFn]:
    """The four roles of an asyncio worker, each ``async fn(spec)``, for :func:`worker_main`."""
    return {
        "sub": asyncio_role(sub),
        "pub": asyncio_role(pub),
        "responder": asyncio_role(responder),
        "requester": asyncio_role(requester),
    }


class Tally:
    """A subscriber's count of the spec's ``n`` messages of ``size`` bytes: how many came,
    how many had another size, when the first came; :meth:`result` is its RESULT."""

    __slots__ = ("bad", "count", "first", "n", "size")

    def __init__(self, spec: Spec) -> None:
        self.n: int = spec["n"]
        self.size: int = spec["size"]
        self.count = self.bad = 0
        self.first = 0.0

    def add(self, length: int) -> bool:
        """Count a message of ``length`` bytes; true once ``n`` came."""
        if length != self.size:
            self.bad += 1
        self.count += 1
        if self.count == 1:
            self.first = time.monotonic()
        return self.count >= self.n

    def result(self, *, timed_out: bool = False) -> dict[str, Any]:
        """The RESULT, ``last`` being now: call it as the last message is counted."""
        return {
            "count": self.count,
            "bad": self.bad,
            "first": self.first,
            "last": time.monotonic(),
            "timeout": timed_out or self.count < self.n,
        }


def calls_result(
    spec: Spec,
    done: int,
    bad: int,
    start: float,
    end: float,
    lat: list[int],
    *,
    timed_out: bool = False,
) -> dict[str, Any]:
    """A requester's RESULT: ``done`` calls answered (``bad`` of them with a reply other
    than the request) between ``start`` and ``end``; it timed out when told so or when
    fewer than the spec's ``conc * calls`` were answered; the latencies (ns) when the
    spec asks for them."""
    out: dict[str, Any] = {
        "calls": done,
        "bad": bad,
        "start": start,
        "end": end,
        "timeout": timed_out or done < spec["conc"] * spec["calls"],
    }
    if spec.get("latencies"):
        out["lat_ns"] = lat
    return out


class Calls:
    """An asyncio requester's calls over its concurrent loops: the bodies it sends, calls
    answered, replies other than their request, round-trip latencies (ns)."""

    __slots__ = ("bad", "bodies", "done", "lat", "spec")

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.bodies = payloads(spec["size"], spec.get("seed", 0))
        self.done = self.bad = 0
        self.lat: list[int] = []

    async def warm_up(self, call: Callable[[bytes], Awaitable[bytes]]) -> None:
        """The spec's ``warmup`` sequential calls (not counted)."""
        for i in range(self.spec.get("warmup", 0)):
            await call(self.bodies[i % len(self.bodies)])

    async def loop(self, call: Callable[[bytes], Awaitable[bytes]], slot: int) -> None:
        """The spec's ``calls`` sequential ``await call(body)`` (the bodies from ``slot``
        on), each timed and its reply compared with its body."""
        bodies, lat, clock = self.bodies, self.lat, time.perf_counter_ns
        mask = len(bodies) - 1
        for i in range(self.spec["calls"]):
            body = bodies[(i + slot) & mask]
            t0 = clock()
            reply = await call(body)
            lat.append(clock() - t0)
            if reply != body:
                self.bad += 1
            self.done += 1

    def result(self, start: float, end: float) -> dict[str, Any]:
        """The RESULT (:func:`calls_result`)."""
        return calls_result(self.spec, self.done, self.bad, start, end, self.lat)


def worker_main(roles: Mapping[str, RoleFn], argv: list[str] | None = None) -> int:
    """Run the role named in the spec and print its RESULT; the ``__main__`` of workers."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.worker_X SPEC_JSON", file=sys.stderr)
        return 2
    spec: Spec = json.loads(args[0])
    role = roles.get(spec["role"])
    if role is None:
        emit({"error": f"unknown role {spec['role']!r}"})
        return 2
    signal.alarm(int(spec["deadline"]) + ALARM_GRACE)
    try:
        result = role(spec)
    except Exception as exc:
        traceback.print_exc()
        emit({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    emit({**result, "cpu": time.process_time() - _cpu_mark})
    return 0


# -- length-prefixed frames (raw-unix and py-relay) ------------------------------------
def frame_prefix(size: int) -> bytes:
    return LEN.pack(size)


class FrameReader:
    """Incremental reader of ``u32 BE length | payload`` frames from a blocking socket.

    ``fill()`` receives into one reusable buffer; ``complete()`` returns the span of
    complete frames buffered so far, without copying them. The buffer grows to hold the
    largest frame seen, so a 4 MiB frame is received in place, never re-joined.
    """

    __slots__ = ("buf", "end", "sock", "start")

    def __init__(self, sock: socket.socket, size: int = 1 << 20) -> None:
        self.sock = sock
        self.buf = bytearray(size)
        self.start = 0
        self.end = 0

    def fill(self) -> int:
        """Receive what is available (blocks until something is); 0 means EOF."""
        if len(self.buf) - self.end < _MIN_ROOM:
            self._make_room()
        n = self.sock.recv_into(memoryview(self.buf)[self.end :])
        self.end += n
        return n

    def _make_room(self) -> None:
        pending = self.end - self.start
        need = pending + _MIN_ROOM
        if pending >= 4:
            need = max(need, 4 + LEN.unpack_from(self.buf, self.start)[0])
        if need > len(self.buf):
            new = bytearray(max(need, 2 * len(self.buf)))
            new[:pending] = memoryview(self.buf)[self.start : self.end]
            self.buf = new
        elif self.start:
            self.buf[:pending] = self.buf[self.start : self.end]
        self.start, self.end = 0, pending

    def complete(self, expect: int = -1) -> tuple[int, int, int, int]:
        """``(start, stop, count, bad)``: ``buf[start:stop]`` holds ``count`` complete
        frames, ``bad`` of which have a payload length other than ``expect`` (if given).

        Marks them consumed; the caller must use the span before the next ``fill``.
        """
        buf, pos, end = self.buf, self.start, self.end
        unpack = LEN.unpack_from
        count = bad = 0
        while end - pos >= 4:
            n = unpack(buf, pos)[0]
            if end - pos - 4 < n:
                break
            if n != expect:
                bad += 1
            pos += 4 + n
            count += 1
        start, self.start = self.start, pos
        if pos == end:
            self.start = self.end = 0
        return start, pos, count, bad if expect >= 0 else 0

    def frames(self, start: int, stop: int) -> list[tuple[int, int]]:
        """``(offset, length)`` of each frame (prefix included) in ``buf[start:stop]``."""
        out = []
        buf, unpack = self.buf, LEN.unpack_from
        while start < stop:
            n = unpack(buf, start)[0] + 4
            out.append((start, n))
            start += n
        return out


def percentiles(values: list[int]) -> dict[str, float]:
    """p0..p100 (every 1 %), p99.9 of ``values`` (nearest rank), for plots and tables."""
    if not values:
        return {}
    s = sorted(values)
    n = len(s)

    def rank(q: float) -> float:
        return float(s[min(n - 1, max(0, math.ceil(q * n) - 1))])

    out = {f"p{p}": rank(p / 100) for p in range(101)}
    out["p99.9"] = rank(0.999)
    return out
