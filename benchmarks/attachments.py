"""Attachment benchmark: 64 MiB binary attachments and descriptor-carrying messages.

``python -m benchmarks.attachments [--blobs N] [--fds N] [--repeat R] [--json FILE]``

Two workloads the main harness does not cover, each 1 publisher -> broker ->
1 subscriber, every party its own process, a fresh broker per repetition:

* **blob**: ``N`` messages (default 20) each carrying one 64 MiB attachment (a
  ``memoryview`` of one buffer, so the publisher copies nothing) and no body. Figure: MB/s
  (10^6 bytes) at the subscriber, ``(N - 1) * size / (last - first received)``; every
  attachment's length is checked.
* **fair** (with ``--fair``): the blob workload again while a separate process makes
  small sequential RPCs (a caller and an echo callee, 64-byte params) through the same
  broker; figures: the blob MB/s and the round-trip p50/p99/max of the small calls made
  while the blobs flowed (large messages must not starve small traffic).
* **fds**: ``N`` messages (default 20,000) each carrying one file descriptor (the read end
  of a pipe; the broker dups it into the receiver with SCM_RIGHTS) and a 16-byte body.
  Figure: messages/s at the subscriber, which closes every descriptor it receives and
  counts those that are not open descriptors (``bad``).

The broker runs with ``--max-frame-size 65 MiB`` (a 64 MiB attachment plus its header
exceeds the 64 MiB default). Every wait is bounded by ``--timeout`` per run. Figures are
medians of ``--repeat`` runs with min-max, like ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import child_env

MiB = 1024 * 1024
BLOB_SIZE = 64 * MiB
GROUP = "bench.attach"
ECHO = "bench.echo"


# -- the worker processes --------------------------------------------------------------
def _worker(role: str, socket_path: str, n: int) -> dict[str, Any]:
    import trio

    from msgq_trio import connect

    async def sub() -> dict[str, Any]:
        count = bad = 0
        first = last = 0.0
        # The client's own frame limit must admit a 64 MiB attachment plus its header.
        async with connect(socket_path, name=f"bench-{role}", max_frame_size=65 * MiB) as bus:
            await bus.subscribe(GROUP)
            print("READY", flush=True)
            async for msg in bus:
                with msg:
                    if role == "sub-blob":
                        atts = msg.attachments
                        if len(atts) != 1 or len(atts[0]) != BLOB_SIZE:
                            bad += 1
                    else:
                        fds = msg.take_fds()
                        for fd in fds:
                            try:
                                os.fstat(fd)
                            except OSError:
                                bad += 1
                            else:
                                os.close(fd)
                        if len(fds) != 1:
                            bad += 1
                count += 1
                if count == 1:
                    first = time.monotonic()
                if count >= n:
                    break
            last = time.monotonic()
        return {"count": count, "bad": bad, "first": first, "last": last}

    async def pub() -> dict[str, Any]:
        async with connect(socket_path, name=f"bench-{role}") as bus:
            print("READY", flush=True)
            await trio.to_thread.run_sync(sys.stdin.readline)  # GO
            start = time.monotonic()
            if role == "pub-blob":
                blob = memoryview(bytearray(os.urandom(4096)) * (BLOB_SIZE // 4096))
                for _ in range(n):
                    await bus.send(GROUP, None, [blob])
            else:
                r, w = os.pipe()
                try:
                    body = b"x" * 16
                    for _ in range(n):
                        await bus.send(GROUP, body, fds=[r])
                    await bus.flush()
                finally:
                    os.close(r)
                    os.close(w)
            await bus.flush()
            return {"start": start, "end": time.monotonic()}

    async def rpc() -> dict[str, Any]:
        # Caller and callee on two connections of this process: the round trip crosses
        # the broker twice, queued behind whatever 64 MiB frames it is writing.
        async with (
            connect(socket_path, name="bench-echo") as callee,
            connect(socket_path, name="bench-caller") as caller,
        ):
            callee.add_command("echo", lambda p: p)
            await callee.subscribe(ECHO)
            params = {"pad": "x" * 64}
            await caller.call(ECHO, "echo", params)
            print("READY", flush=True)
            lat: list[float] = []
            stop = trio.Event()

            async def wait_stop() -> None:
                await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
                stop.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_stop)
                while not stop.is_set() and len(lat) < n:
                    t0 = time.perf_counter()
                    await caller.call(ECHO, "echo", params)
                    lat.append(time.perf_counter() - t0)
                nursery.cancel_scope.cancel()
        lat.sort()
        if not lat:
            return {"calls": 0}
        return {
            "calls": len(lat),
            "p50_us": lat[len(lat) // 2] * 1e6,
            "p99_us": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6,
            "max_us": lat[-1] * 1e6,
        }

    if role == "rpc":
        return trio.run(rpc)
    return trio.run(sub if role.startswith("sub") else pub)


# -- the parent --------------------------------------------------------------------------
class _Child:
    def __init__(self, argv: list[str], log: Path) -> None:
        with open(log, "wb") as err:
            self.p = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
                env=child_env(),
            )
        self.log = log

    def line(self, deadline: float) -> str:
        assert self.p.stdout is not None
        fd = self.p.stdout.fileno()
        buf = b""
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.p.args!r}: no output in time")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1)
                if not chunk:
                    raise RuntimeError(f"exited early: {self.log.read_text()[-500:]}")
                buf += chunk
        return buf.decode().strip()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def run_once(kind: str, n: int, timeout: float) -> dict[str, Any]:
    """One repetition of ``kind`` ("blob", "fair" or "fds"); raises on failure or timeout."""
    fair = kind == "fair"
    if fair:
        kind = "blob"
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="mqa", dir="/tmp") as d:
        sock = str(Path(d) / "bus.sock")
        py = sys.executable
        me = "benchmarks.attachments"
        broker = _Child(
            [
                py,
                "-m",
                "msgq_trio",
                "--log-level",
                "WARNING",
                "serve",
                "--socket",
                sock,
                "--max-frame-size",
                str(65 * MiB),
            ],
            Path(d) / "broker.log",
        )
        children = [broker]
        try:
            while not os.path.exists(sock):
                if time.monotonic() > deadline or broker.p.poll() is not None:
                    raise RuntimeError("broker did not start")
                time.sleep(0.02)
            sub = _Child([py, "-m", me, "--role", f"sub-{kind}", sock, str(n)], Path(d) / "sub.log")
            children.append(sub)
            if sub.line(deadline) != "READY":
                raise RuntimeError("subscriber not ready")
            rpc = None
            if fair:
                rpc = _Child([py, "-m", me, "--role", "rpc", sock, "10000000"], Path(d) / "rpc.log")
                children.append(rpc)
                if rpc.line(deadline) != "READY":
                    raise RuntimeError("rpc pair not ready")
            pub = _Child([py, "-m", me, "--role", f"pub-{kind}", sock, str(n)], Path(d) / "pub.log")
            children.append(pub)
            if pub.line(deadline) != "READY":
                raise RuntimeError("publisher not ready")
            assert pub.p.stdin is not None
            pub.p.stdin.write(b"GO\n")
            pub.p.stdin.flush()
            res = json.loads(sub.line(deadline))
            pub.line(deadline)
            calls: dict[str, Any] = {}
            if rpc is not None:
                assert rpc.p.stdin is not None
                rpc.p.stdin.write(b"STOP\n")
                rpc.p.stdin.flush()
                calls = json.loads(rpc.line(deadline))
        finally:
            for c in reversed(children):
                c.kill()
    if res["count"] != n or res["bad"]:
        raise RuntimeError(f"subscriber got {res['count']} of {n}, {res['bad']} bad")
    span = res["last"] - res["first"]
    if fair:
        if not calls.get("calls"):
            raise RuntimeError("no small call completed while the blobs flowed")
        return {"value": (n - 1) * BLOB_SIZE / span / 1e6, "unit": "MB/s", **calls}
    if kind == "blob":
        return {"value": (n - 1) * BLOB_SIZE / span / 1e6, "unit": "MB/s"}
    return {"value": (n - 1) / span, "unit": "msgs/s"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.attachments", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--role", nargs=3, metavar=("ROLE", "SOCKET", "N"), help=argparse.SUPPRESS)
    p.add_argument("--blobs", type=int, default=20, help="64 MiB messages per run (20)")
    p.add_argument("--fds", type=int, default=20_000, help="fd messages per run (20,000)")
    p.add_argument(
        "--fair",
        action="store_true",
        help="also run the blobs with small RPCs alongside (their p50/p99)",
    )
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0, help="hard limit per run, s")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    if args.role:
        role, sock, n = args.role
        print(json.dumps(_worker(role, sock, int(n))), flush=True)
        return 0
    out: dict[str, Any] = {}
    failed = False
    kinds = [("blob", args.blobs), ("fds", args.fds)]
    if args.fair:
        kinds.insert(1, ("fair", args.blobs))
    for kind, n in kinds:
        values: list[float] = []
        extra: dict[str, list[float]] = {"calls": [], "p50_us": [], "p99_us": [], "max_us": []}
        unit = "msgs/s" if kind == "fds" else "MB/s"
        for _ in range(args.repeat):
            try:
                r = run_once(kind, n, args.timeout)
            except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
                print(f"{kind}: run failed: {exc}", file=sys.stderr)
                failed = True
                continue
            values.append(r["value"])
            for k, v in extra.items():
                if k in r:
                    v.append(r[k])
        if values:
            out[kind] = {
                "n": n,
                "unit": unit,
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "runs": values,
            }
            line = (
                f"{kind:5} n={n:<6} median {statistics.median(values):,.0f} {unit} "
                f"[{min(values):,.0f}-{max(values):,.0f}] over {len(values)} runs"
            )
            if kind == "fair":
                for k, v in extra.items():
                    out[kind][k] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
                line += "; small calls alongside: " + ", ".join(
                    f"{k} {statistics.median(v):,.0f} [{min(v):,.0f}-{max(v):,.0f}]"
                    for k, v in extra.items()
                )
            print(line)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
