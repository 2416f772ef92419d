"""What the web console costs a busy bus: ``python -m benchmarks.console``.

One broker with ``--clients`` idle connections (bare sockets past the handshake, as the
scale benchmark holds them) and one echo responder in the README's handler form. Rounds
alternate without and with a ``msgq-trio console`` process attached, so a drift of the
machine falls on both sides alike. Each round measures:

* the round trip's p50 and p99 over ``--calls`` sequential calls from a trio client;
* with the console attached, the time to load its page over HTTP: the HTML, its script
  and style sheet, and one snapshot of the bus (what a browser fetches before it draws
  the clients table), each load from a fresh connection.

Prints one JSON document; the medians over rounds are what BENCHMARKS.md quotes.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.console", description=__doc__)
    ap.add_argument("--clients", type=int, default=1000, help="idle connections (default 1,000)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind (default 3)")
    ap.add_argument("--calls", type=int, default=3000, help="round trips per round")
    ap.add_argument("--loads", type=int, default=5, help="page loads per round with the console")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="mqconsole-"))
    path = str(tmp / "bus.sock")
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
                    # The first snapshot of 1,000 clients is taken before the page shows it.
                    time.sleep(3)
                    loads = [_page_load(url) for _ in range(args.loads)]
                    row["page_load_ms"] = [round(x * 1e3, 1) for x in loads]
                rts = trio.run(_round_trips, path, args.calls, 200)
                qs = statistics.quantiles(rts, n=100)
                row["rt_p50_us"] = round(statistics.median(rts), 1)
                row["rt_p99_us"] = round(qs[98], 1)
                if proc is not None:
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
