"""Attachment benchmark: 64 MiB binary attachments and descriptor-carrying messages.

``python -m msgq_trio.bench.attachments [--blobs N] [--fds N] [--repeat R] [--json FILE]``

Two workloads the main harness does not cover (issue 8), each 1 publisher -> broker ->
1 subscriber, every party its own process, a fresh broker per repetition:

* **blob**: ``N`` messages (default 20) each carrying one 64 MiB attachment (a
  ``memoryview`` of one buffer, so the publisher copies nothing) and no body. Figure: MB/s
  (10^6 bytes) at the subscriber, ``(N - 1) * size / (last - first received)``; every
  attachment's length is checked.
* **fds**: ``N`` messages (default 20,000) each carrying one file descriptor (the read end
  of a pipe; the broker dups it into the receiver with SCM_RIGHTS) and a 16-byte body.
  Figure: messages/s at the subscriber, which closes every descriptor it receives and
  counts those that are not open descriptors (``bad``).

The broker runs with ``--max-frame-size 65 MiB`` (a 64 MiB attachment plus its header
exceeds the 64 MiB default). Every wait is bounded by ``--timeout`` per run. Figures are
medians of ``--repeat`` runs with min-max, like ``msgq-trio bench``.
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

MiB = 1024 * 1024
BLOB_SIZE = 64 * MiB
GROUP = "bench.attach"


# -- the worker processes --------------------------------------------------------------
def _worker(role: str, socket_path: str, n: int) -> dict[str, Any]:
    import trio

    from .. import connect

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

    return trio.run(sub if role.startswith("sub") else pub)


# -- the parent --------------------------------------------------------------------------
class _Child:
    def __init__(self, argv: list[str], log: Path) -> None:
        with open(log, "wb") as err:
            self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=err, start_new_session=True)
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
    """One repetition of ``kind`` ("blob" or "fds"); raises on failure or timeout."""
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory(prefix="mqa", dir="/tmp") as d:
        sock = str(Path(d) / "bus.sock")
        py = sys.executable
        me = "msgq_trio.bench.attachments"
        broker = _Child([py, "-m", "msgq_trio", "--log-level", "WARNING", "serve",
                         "--socket", sock, "--max-frame-size", str(65 * MiB)],
                        Path(d) / "broker.log")
        children = [broker]
        try:
            while not os.path.exists(sock):
                if time.monotonic() > deadline or broker.p.poll() is not None:
                    raise RuntimeError("broker did not start")
                time.sleep(0.02)
            sub = _Child([py, "-m", me, "--role", f"sub-{kind}", sock, str(n)],
                         Path(d) / "sub.log")
            children.append(sub)
            if sub.line(deadline) != "READY":
                raise RuntimeError("subscriber not ready")
            pub = _Child([py, "-m", me, "--role", f"pub-{kind}", sock, str(n)],
                         Path(d) / "pub.log")
            children.append(pub)
            if pub.line(deadline) != "READY":
                raise RuntimeError("publisher not ready")
            assert pub.p.stdin is not None
            pub.p.stdin.write(b"GO\n")
            pub.p.stdin.flush()
            res = json.loads(sub.line(deadline))
            pub.line(deadline)
        finally:
            for c in reversed(children):
                c.kill()
    if res["count"] != n or res["bad"]:
        raise RuntimeError(f"subscriber got {res['count']} of {n}, {res['bad']} bad")
    span = res["last"] - res["first"]
    if kind == "blob":
        return {"value": (n - 1) * BLOB_SIZE / span / 1e6, "unit": "MB/s"}
    return {"value": (n - 1) / span, "unit": "msgs/s"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m msgq_trio.bench.attachments",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--role", nargs=3, metavar=("ROLE", "SOCKET", "N"), help=argparse.SUPPRESS)
    p.add_argument("--blobs", type=int, default=20, help="64 MiB messages per run (20)")
    p.add_argument("--fds", type=int, default=20_000, help="fd messages per run (20,000)")
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
    for kind, n in (("blob", args.blobs), ("fds", args.fds)):
        values: list[float] = []
        unit = "MB/s" if kind == "blob" else "msgs/s"
        for _ in range(args.repeat):
            try:
                values.append(run_once(kind, n, args.timeout)["value"])
            except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
                print(f"{kind}: run failed: {exc}", file=sys.stderr)
                failed = True
        if values:
            out[kind] = {"n": n, "unit": unit, "median": statistics.median(values),
                         "min": min(values), "max": max(values), "runs": values}
            print(f"{kind:5} n={n:<6} median {statistics.median(values):,.0f} {unit} "
                  f"[{min(values):,.0f}-{max(values):,.0f}] over {len(values)} runs")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
