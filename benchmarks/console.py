"""What the web console costs a busy bus: ``python -m benchmarks.console``.

One broker with ``--clients`` idle connections (bare sockets past the handshake, as the
scale benchmark holds them) and one echo responder in the README's handler form. Rounds
alternate without and with a ``msgq-trio console`` process attached, so a drift of the
machine falls on both sides alike. Each round measures:

* the round trip's p50 and p99 over ``--calls`` sequential calls from a trio client;
* with the console attached, the time to load its page over HTTP: the HTML, its script
  and style sheet, and one snapshot of the bus (what a browser fetches before it draws
  the clients table), each load from a fresh connection. A viewer holds the console's
  event stream open on the clients view for the whole round (the console takes no
  snapshot while no page is open; that view asks the broker for the most).

Prints one JSON document; the medians over rounds are what BENCHMARKS.md quotes.

``--cost`` measures instead what does not depend on the machine's load: CPU time (user
+ system, from ``/proc/PID/stat``) rather than wall-clock time. With ``--clients`` idle
connections it asks the broker each snapshot command ``--calls`` times and reports the
broker's CPU per answer and the answer's size (CBOR bytes); then it runs a console with
one viewer on each view for ``--seconds`` with a short ``--interval``, and reports the
broker's and the console's CPU per snapshot and the bytes each snapshot sends to the
viewer.
"""

from __future__ import annotations

import argparse
import http.cookiejar
import json
import os
import re
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import trio

import msgq_trio
from msgq_trio.console.service import CLIENT_FIELDS, STATS_FIELDS
from msgq_trio.protocol.codes import PROTOCOL_VERSION, FrameType
from msgq_trio.protocol.framing import encode_cbor, encode_frame

PY = sys.executable

RESPONDER = """
import sys, trio, msgq_trio

async def main():
    async with msgq_trio.connect(sys.argv[1], name="Echo") as bus:
        await bus.subscribe("Echo")

        @bus.command("echo")
        async def echo(params):
            return params
        print("READY", flush=True)
        await trio.sleep_forever()

trio.run(main)
"""


def _line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The next line of ``proc``'s stdout, or an error naming the process."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise RuntimeError(f"{proc.args!r} printed no line within {timeout} s")
        chunk = os.read(fd, 1)
        if not chunk:
            raise RuntimeError(f"{proc.args!r} exited ({proc.wait()}) before its first line")
        buf += chunk
    return buf.decode().strip()


def _idle(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    hello = encode_frame(
        FrameType.HELLO,
        header=encode_cbor({"version": PROTOCOL_VERSION, "name": "idle", "pid": os.getpid()}),
    )
    s.sendall(b"".join(bytes(p) for p in hello))
    s.recv(65536)  # WELCOME
    return s


async def _round_trips(path: str, calls: int, warmup: int) -> list[float]:
    out: list[float] = []
    async with msgq_trio.connect(path, name="bench") as bus:
        for i in range(warmup + calls):
            t0 = time.perf_counter()
            await bus.call("Echo", "echo", {"i": i})
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1e6)
    return out


def _page_load(url: str) -> float:
    """Seconds to fetch the page, its assets and one snapshot, each on a new connection."""
    # A fresh cookie jar: the page sets the session cookie its API calls carry.
    opener = urllib.request.build_opener(
        urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
    )
    t0 = time.perf_counter()
    html = opener.open(url, timeout=30).read().decode()
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    base = url.rstrip("/")
    for asset in assets:
        opener.open(base + asset, timeout=30).read()
    opener.open(base + "/api/snapshot", timeout=30).read()
    return time.perf_counter() - t0


CLK_TCK = os.sysconf("SC_CLK_TCK")

#: The snapshot's requests to the broker (``ping``: the cost of any request, for scale).
COST_COMMANDS: list[tuple[str, str, Any]] = [
    ("msgq", "ping", None),
    ("msgq", "version", None),
    ("msgq", "config-get", None),
    ("msgq", "stats", None),
    ("msgq", "groups", None),
    ("msgq", "command-stats", None),
    ("msgq", "capture-status", None),
    ("msgq", "clients", None),
    ("msgq", "stats", {"fields": STATS_FIELDS}),
    ("msgq", "clients", {"fields": CLIENT_FIELDS}),
    # Each call with the generation of the previous answer: what the console asks.
    ("msgq", "clients", {"fields": CLIENT_FIELDS, "since": 0}),
]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def _command_costs(path: str, broker_pid: int, calls: int) -> list[dict[str, Any]]:
    rows = []
    async with msgq_trio.connect(path, name="bench-cost") as bus:
        for target, command, first in COST_COMMANDS:
            chained = isinstance(first, dict) and "since" in first
            answer = await bus.call(target, command, first)
            c0 = cpu_seconds(broker_pid)
            for _ in range(calls):
                params = {**first, "since": answer["generation"]} if chained else first
                answer = await bus.call(target, command, params)
            cpu = cpu_seconds(broker_pid) - c0
            shown = {**first, "since": "<previous generation>"} if chained else first
            rows.append(
                {
                    "command": command if shown is None else f"{command} {json.dumps(shown)}",
                    "broker_cpu_us": round(cpu / calls * 1e6, 1),
                    "answer_bytes": len(encode_cbor(answer)),
                }
            )
    return rows


class _EventReader:
    """A viewer's event stream read by a thread: events and bytes received."""

    def __init__(self, url: str, view: str) -> None:
        import threading

        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar())
        )
        self.base = url.rstrip("/")
        self.opener.open(self.base + "/", timeout=30).read()  # the session cookie
        self.resp = self.opener.open(f"{self.base}/api/events?view={view}", timeout=60)
        self.events = 0
        self.bytes = 0
        self.stopped = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for line in self.resp:
                if self.stopped:
                    return
                self.bytes += len(line)
                if line.startswith(b"event: "):
                    self.events += 1
        except (OSError, ValueError, AttributeError):  # closed by close(), mid-read
            return

    def close(self) -> None:
        self.stopped = True
        self.resp.close()


def _console_cost(
    path: str, broker_pid: int, view: str, seconds: float, interval: float
) -> dict[str, Any]:
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "msgq_trio",
            "console",
            "-s",
            path,
            "--listen",
            "127.0.0.1:0",
            "--interval",
            str(interval),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        url = _line(proc, 60)
        reader = _EventReader(url, view)
        time.sleep(3)  # the first snapshots (and the imports' warm-up) are not counted
        e0, b0 = reader.events, reader.bytes
        c0, k0 = cpu_seconds(broker_pid), cpu_seconds(proc.pid)
        time.sleep(seconds)
        c1, k1 = cpu_seconds(broker_pid), cpu_seconds(proc.pid)
        events, sent = reader.events - e0, reader.bytes - b0
        reader.close()
        n = max(events, 1)
        return {
            "view": view,
            "snapshots": events,
            "broker_cpu_ms_per_snapshot": round((c1 - c0) / n * 1e3, 2),
            "console_cpu_ms_per_snapshot": round((k1 - k0) / n * 1e3, 2),
            "sse_bytes_per_snapshot": round(sent / n),
        }
    finally:
        proc.terminate()
        proc.wait(30)


def cost(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """The load-independent figures of ``--cost`` (see the module's docstring)."""
    broker = subprocess.Popen(
        [PY, "-m", "msgq_trio", "serve", "--socket", path], stdout=subprocess.PIPE
    )
    idle: list[socket.socket] = []
    try:
        _line(broker, 30)
        idle = [_idle(path) for _ in range(args.clients)]
        out: dict[str, Any] = {"clients": args.clients, "calls": args.calls}
        out["commands"] = trio.run(_command_costs, path, broker.pid, args.calls)
        c0 = cpu_seconds(broker.pid)
        time.sleep(args.seconds)
        out["broker_idle_cpu_ms_per_s"] = round(
            (cpu_seconds(broker.pid) - c0) / args.seconds * 1e3, 2
        )
        out["console"] = [
            _console_cost(path, broker.pid, view, args.seconds, args.interval)
            for view in args.views.split(",")
        ]
        return out
    finally:
        for s in idle:
            s.close()
        broker.terminate()
        broker.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.console", description=__doc__)
    ap.add_argument("--clients", type=int, default=1000, help="idle connections (default 1,000)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind (default 3)")
    ap.add_argument(
        "--calls",
        type=int,
        default=3000,
        help="round trips per round (enough for several 2 s snapshots per round: see "
        "snapshots_during_round_trips)",
    )
    ap.add_argument("--loads", type=int, default=5, help="page loads per round with the console")
    ap.add_argument("--cost", action="store_true", help="CPU time and bytes, not wall clock")
    ap.add_argument("--seconds", type=float, default=10.0, help="--cost: seconds per view")
    ap.add_argument("--interval", type=float, default=0.25, help="--cost: console's interval")
    ap.add_argument(
        "--views", default="broker,clients", help="--cost: the viewer's views, one run each"
    )
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="mqconsole-"))
    path = str(tmp / "bus.sock")
    if args.cost:
        print(json.dumps(cost(args, path), indent=1))
        return 0
    procs: list[subprocess.Popen[bytes]] = []
    idle: list[socket.socket] = []
    result: dict[str, Any] = {"clients": args.clients, "calls": args.calls, "rounds": []}
    try:
        broker = subprocess.Popen(
            [PY, "-m", "msgq_trio", "serve", "--socket", path], stdout=subprocess.PIPE
        )
        procs.append(broker)
        _line(broker, 30)
        responder = subprocess.Popen([PY, "-c", RESPONDER, path], stdout=subprocess.PIPE)
        procs.append(responder)
        _line(responder, 30)
        idle = [_idle(path) for _ in range(args.clients)]
        for _ in range(args.rounds):
            for console in (False, True):
                row: dict[str, Any] = {"console": console}
                proc = None
                if console:
                    proc = subprocess.Popen(
                        [PY, "-m", "msgq_trio", "console", "-s", path, "--listen", "127.0.0.1:0"],
                        stdout=subprocess.PIPE,
                    )
                    procs.append(proc)
                    url = _line(proc, 60)
                    # A viewer on the clients view for the whole round: the console
                    # snapshots only while a page is open, and this view costs the most.
                    reader = _EventReader(url, "clients")
                    time.sleep(3)
                    loads = [_page_load(url) for _ in range(args.loads)]
                    row["page_load_ms"] = [round(x * 1e3, 1) for x in loads]
                    # A page load's /api/snapshot keeps every section polled for two
                    # intervals: the round trips start once only the viewer's remain.
                    time.sleep(5)
                    pushed = reader.events
                rts = trio.run(_round_trips, path, args.calls, 200)
                qs = statistics.quantiles(rts, n=100)
                row["rt_p50_us"] = round(statistics.median(rts), 1)
                row["rt_p99_us"] = round(qs[98], 1)
                if proc is not None:
                    row["snapshots_during_round_trips"] = reader.events - pushed
                    reader.close()
                    proc.terminate()
                    proc.wait(30)
                    procs.remove(proc)
                result["rounds"].append(row)
        for kind in (False, True):
            rows = [r for r in result["rounds"] if r["console"] is kind]
            key = "with_console" if kind else "without"
            result[key] = {"rt_p50_us": statistics.median(r["rt_p50_us"] for r in rows)}
            if kind:
                loads = [x for r in rows for x in r["page_load_ms"]]
                result[key]["page_load_ms_median"] = statistics.median(loads)
                result[key]["page_load_ms_max"] = max(loads)
        print(json.dumps(result, indent=1))
    finally:
        for s in idle:
            s.close()
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
