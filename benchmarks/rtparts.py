"""Which side of a request/reply round trip costs what, by client kind:
``python -m benchmarks.rtparts [--calls 10000] [--rounds 3]``.

A fresh broker (its defaults, busy polling on); for each kind of responder in turn
(trio with an ``async def`` handler as the README teaches, the direct blocking client,
and the "floor"), each kind of requester (trio as ``connect()`` makes it, "trio_sleep"
with ``connect(busy_poll=0)``, floor, direct) makes ``--calls``
sequential calls of a 100-byte body after 1,000 warm-up calls (as many as ``--calls`` if
fewer; every warm-up answer is checked), alternated ``--rounds``
times. Each requester prints its p50 and its CPU per call (user and system, from
``getrusage``: ``os.times()`` counts in clock ticks, coarser than a short run's CPU).

The floor is the least a trio program can do per call: one trio task that writes the
request, waits with ``trio.lowlevel.wait_readable``, receives into a buffer and runs the
client session's parse and dispatch, with no reader task and no waiter object (a
requester), or that answers each request the same way (a responder). It is made from the
direct client's connection and session (their private parts, read in one place,
:func:`_direct_parts`: this is a measuring tool, not an API), so the difference between
the trio client that sleeps for its answers (trio_sleep) and the floor is the trio
driver's own cost, and the difference between the floor and the direct client is trio's
run loop and its wait in ``epoll``; the default trio client polls for its answers
(``busy_poll``), so it can come in under the floor
(BENCHMARKS.md, "The trio round trip").
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import msgq_trio
from msgq_trio import DirectBus, connect_direct
from msgq_trio.client.session import Request, Send
from msgq_trio.demo import start_broker
from msgq_trio.protocol.framing import Frame

from . import child_env

GROUP = "RtParts"
SIZE = 100
WARMUP = 1000
RECEIVE = 256 * 1024
RESPONDERS = ("trio", "direct", "floor")
REQUESTERS = ("trio", "trio_sleep", "floor", "direct")


def _echo(params: Any) -> Any:
    return params


# -- requesters (each returns the latencies of its timed calls, in ns) -----------------
def _cpu() -> tuple[float, float]:
    """This process's user and system CPU seconds so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _timed(calls: int, one: Any) -> tuple[list[int], tuple[float, float], tuple[float, float]]:
    lat = []
    t0 = _cpu()
    for _ in range(calls):
        start = time.perf_counter_ns()
        one()
        lat.append(time.perf_counter_ns() - start)
    return lat, t0, _cpu()


def _check(reply: Any, body: bytes) -> None:
    if reply != body:
        raise AssertionError("the echo came back different")


def _req_direct(sock: str, calls: int) -> dict[str, Any]:
    body = os.urandom(SIZE)
    with connect_direct(sock, "rtparts-direct") as bus:
        for _ in range(min(WARMUP, calls)):
            _check(bus.call(GROUP, "echo", body), body)
        lat, t0, t1 = _timed(calls, lambda: bus.call(GROUP, "echo", body))
    return _figures(lat, t0, t1)


async def _req_trio(sock: str, calls: int, busy_poll: bool = True) -> dict[str, Any]:
    """``busy_poll``: as ``connect()`` makes it (its default), else ``busy_poll=0``."""
    body = os.urandom(SIZE)
    bus_cm = (
        msgq_trio.connect(sock, "rtparts-trio")
        if busy_poll
        else msgq_trio.connect(sock, "rtparts-trio", busy_poll=0)
    )
    async with bus_cm as bus:
        for _ in range(min(WARMUP, calls)):
            _check(await bus.call(GROUP, "echo", body), body)
        lat = []
        t0 = _cpu()
        for _ in range(calls):
            start = time.perf_counter_ns()
            await bus.call(GROUP, "echo", body)
            lat.append(time.perf_counter_ns() - start)
        t1 = _cpu()
    return _figures(lat, t0, t1)


def _direct_parts(bus: DirectBus) -> tuple[Any, Any, Any]:
    """The direct client's socket, protocol connection and session: the one place this
    tool reads client internals (no public API hands them out; the floor is built from
    them), so a rename there is fixed here alone."""
    return bus._sock, bus._conn, bus._s


class _Floor:
    """A direct client's connection and session, driven from one trio task."""

    def __init__(self, bus: DirectBus) -> None:
        self.raw, self.conn, self.session = _direct_parts(bus)
        self.raw.setblocking(False)
        self.view = memoryview(bytearray(RECEIVE))

    async def receive(self) -> list[Any]:
        """The session's events for what one wait and one receive bring."""
        await trio.lowlevel.wait_readable(self.raw)
        n = self.raw.recv_into(self.view)
        if not n:
            raise EOFError("the broker closed the connection")
        self.conn.receive_data(self.view[:n])
        return [self.session.handle(ev) for ev in self.conn.events() if isinstance(ev, Frame)]

    def write(self, pieces: list[Any]) -> None:
        self.raw.send(b"".join(bytes(p) for p in pieces))  # small: one send takes it


async def _req_floor(sock: str, calls: int) -> dict[str, Any]:
    body = os.urandom(SIZE)
    with connect_direct(sock, "rtparts-floor") as bus:
        floor = _Floor(bus)
        s = floor.session

        async def one() -> None:
            call, pieces = s.start_call(GROUP, "echo", body, now=0.0)
            floor.write(pieces)
            while not call.done:
                await floor.receive()
            s.finish(call)
            _check(call.result, body)

        for _ in range(min(WARMUP, calls)):
            await one()
        lat = []
        t0 = _cpu()
        for _ in range(calls):
            start = time.perf_counter_ns()
            await one()
            lat.append(time.perf_counter_ns() - start)
        t1 = _cpu()
    return _figures(lat, t0, t1)


def _figures(lat: list[int], t0: tuple[float, float], t1: tuple[float, float]) -> dict[str, Any]:
    n = len(lat)
    return {
        "p50_us": statistics.median(lat) / 1000,
        "user_us": (t1[0] - t0[0]) / n * 1e6,
        "sys_us": (t1[1] - t0[1]) / n * 1e6,
    }


# -- responders (serve until killed) ---------------------------------------------------
def _resp_direct(sock: str) -> None:
    with connect_direct(sock, "rtparts-echo") as bus:
        bus.command("echo")(_echo)
        bus.subscribe(GROUP)
        print("READY", flush=True)
        bus.serve(None)


async def _resp_trio(sock: str) -> None:
    async with msgq_trio.connect(sock, "rtparts-echo") as bus:

        @bus.command("echo")
        async def echo(params: Any) -> Any:
            return params

        await bus.subscribe(GROUP)
        print("READY", flush=True)
        await trio.sleep_forever()


async def _resp_floor(sock: str) -> None:
    with connect_direct(sock, "rtparts-echo") as bus:
        bus.command("echo")(_echo)
        bus.subscribe(GROUP)
        floor = _Floor(bus)
        s = floor.session
        print("READY", flush=True)
        while True:
            out: list[Any] = []
            for event in await floor.receive():
                if isinstance(event, Request) and event.handler is not None:
                    msg = event.message
                    try:
                        answer = s.answer_for(msg, event.handler(msg.body, msg), None)
                    except Exception as exc:
                        answer = s.answer_for(msg, None, exc)
                    out.extend(answer or ())
                elif isinstance(event, Send):
                    out.extend(event.pieces)
            if out:
                floor.write(out)


def _child(role: str, sock: str, calls: int) -> None:
    kind, side = role.split("-")
    if side == "responder":
        if kind == "direct":
            _resp_direct(sock)
        else:
            trio.run(_resp_trio if kind == "trio" else _resp_floor, sock)
        return
    if kind == "direct":
        result = _req_direct(sock, calls)
    elif kind == "trio_sleep":
        result = trio.run(_req_trio, sock, calls, False)
    else:
        result = trio.run(_req_trio if kind == "trio" else _req_floor, sock, calls)
    print("RESULT " + json.dumps(result), flush=True)


def _run(argv: list[str], timeout: float) -> dict[str, Any]:
    out = subprocess.run(
        argv, stdout=subprocess.PIPE, text=True, timeout=timeout, check=True, env=child_env()
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            parsed: dict[str, Any] = json.loads(line[7:])
            return parsed
    raise RuntimeError(f"a requester printed no RESULT: {out.stdout!r}")


def run(calls: int, rounds: int, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Every (responder, round, requester) figure, in the order they were measured."""
    rows: list[dict[str, Any]] = []
    base = [sys.executable, "-m", "benchmarks.rtparts", "--calls", str(calls)]
    with tempfile.TemporaryDirectory(prefix="msgq-rtparts-") as tmp:
        sock = str(Path(tmp) / "bus.sock")
        broker = start_broker(Path(sock))
        try:
            for responder in RESPONDERS:
                proc = subprocess.Popen(
                    [*base, "--child", f"{responder}-responder", "--socket", sock],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=child_env(),
                )
                try:
                    assert proc.stdout is not None
                    if not proc.stdout.readline().startswith("READY"):
                        raise RuntimeError(f"the {responder} responder did not start")
                    for round_ in range(rounds):
                        for requester in REQUESTERS:
                            argv = [*base, "--child", f"{requester}-requester", "--socket", sock]
                            row = _run(argv, timeout)
                            row.update(responder=responder, requester=requester, round=round_)
                            rows.append(row)
                finally:
                    proc.kill()
                    proc.wait()
                    if proc.stdout is not None:
                        proc.stdout.close()
        finally:
            broker.terminate()
            broker.wait()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10_000, help="timed calls per run (10,000)")
    p.add_argument("--rounds", type=int, default=3, help="alternations per responder (3)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child, args.socket, args.calls)
        return
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"msgq_trio {msgq_trio.__version__}; load average {load}", flush=True)
    print("p50 µs (user + system CPU µs per call) by responder and requester; one row per round")
    print(f"{'responder':<10}" + "".join(f"{r + ' requester':>26}" for r in REQUESTERS))
    rows = run(args.calls, args.rounds)
    for responder in RESPONDERS:
        for round_ in range(args.rounds):
            cells = []
            for requester in REQUESTERS:
                (r,) = [
                    x
                    for x in rows
                    if (x["responder"], x["requester"], x["round"])
                    == (responder, requester, round_)
                ]
                cells.append(f"{r['p50_us']:.0f} ({r['user_us']:.0f} + {r['sys_us']:.0f})")
            print(f"{responder:<10}" + "".join(f"{c:>26}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
