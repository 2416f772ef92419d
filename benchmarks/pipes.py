"""Pipe throughput: a msgq_trio named pipe next to a raw Unix socket and ``cat`` through a
fifo, each between two processes. ``python -m benchmarks.pipes [--mib 256]``.

Every figure moves the same bytes from one process to another and counts them at the
far end; MB/s = 10^6 bytes per second of wall time from the writer's start to the
reader's end of stream (process start-up excluded for the pipe: both ends are connected
and attached before the clock starts).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

MiB = 1 << 20

_PIPE_PEER = textwrap.dedent("""
    import os, sys, time, trio
    import msgq_trio

    async def main(role, name, total, chunk):
        async with msgq_trio.connect(name="bench-pipe-" + role) as bus:
            p = bus.pipe(name)
            if role == "write":
                w = await p.open_writer()
                buf = os.urandom(chunk)
                print("ready", flush=True)
                sys.stdin.readline()
                async with w:
                    sent = 0
                    while sent < total:
                        n = min(chunk, total - sent)
                        await w.send_all(buf[:n] if n < chunk else buf)
                        sent += n
            else:
                r = await p.open_reader()
                print("ready", flush=True)
                got = 0
                while True:
                    data = await r.receive_some()
                    if not data:
                        break
                    got += len(data)
                print("done", got, time.monotonic(), flush=True)
                await r.aclose()

    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
""")

_RAW_PEER = textwrap.dedent("""
    import os, socket, sys, time
    role, path, total, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if role == "read":
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(path)
        srv.listen(1)
        print("ready", flush=True)
        c, _ = srv.accept()
        got = 0
        while True:
            d = c.recv(chunk)
            if not d:
                break
            got += len(d)
        print("done", got, time.monotonic(), flush=True)
    else:
        c = socket.socket(socket.AF_UNIX)
        c.connect(path)
        buf = os.urandom(chunk)
        sent = 0
        while sent < total:
            n = min(chunk, total - sent)
            c.sendall(buf[:n] if n < chunk else buf)
            sent += n
        c.close()
""")


def _start(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _done(proc: subprocess.Popen[str]) -> tuple[int, float]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("done"):
            _, got, t = line.split()
            proc.wait(60)
            return int(got), float(t)
    raise RuntimeError("reader ended without a result")


def bench_pipe(total: int, chunk: int, tmp: Path) -> float:
    """MB/s through a msgq_trio pipe (broker + pipe plugin + writer + reader processes)."""
    sock = tmp / "bus.sock"
    broker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "msgq_trio",
            "--log-level",
            "WARNING",
            "serve",
            "--socket",
            str(sock),
            "--plugin",
            "pipe",
        ],
        stdout=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert broker.stdout is not None
        if "listening" not in broker.stdout.readline():
            raise RuntimeError("the broker did not start")
        env = dict(os.environ, MSGQ_TRIO_SOCKET=str(sock))
        reader = _start(_PIPE_PEER, "read", "bench", str(total), str(chunk), env=env)
        assert reader.stdout is not None
        reader.stdout.readline()
        writer = _start(_PIPE_PEER, "write", "bench", str(total), str(chunk), env=env)
        assert writer.stdout is not None and writer.stdin is not None
        writer.stdout.readline()
        t0 = time.monotonic()
        writer.stdin.write("go\n")
        writer.stdin.flush()
        got, t1 = _done(reader)
        writer.wait(60)
        if got != total:
            raise RuntimeError(f"pipe: read {got} of {total} bytes")
        return total / (t1 - t0) / 1e6
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(30)


def bench_raw(total: int, chunk: int, tmp: Path) -> float:
    """MB/s through one AF_UNIX stream socket between two Python processes."""
    path = str(tmp / "raw.sock")
    reader = _start(_RAW_PEER, "read", path, str(total), str(chunk))
    assert reader.stdout is not None
    reader.stdout.readline()
    t0 = time.monotonic()
    writer = _start(_RAW_PEER, "write", path, str(total), str(chunk))
    got, t1 = _done(reader)
    writer.wait(60)
    if got != total:
        raise RuntimeError(f"raw: read {got} of {total} bytes")
    return total / (t1 - t0) / 1e6


def bench_fifo(total: int, tmp: Path) -> float:
    """MB/s of ``head -c N /dev/zero > fifo`` and ``cat fifo > /dev/null`` (shell tools)."""
    fifo = tmp / "fifo"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    reader = subprocess.Popen(
        ["sh", "-c", f"cat {fifo} | wc -c"], stdout=subprocess.PIPE, text=True
    )
    writer = subprocess.Popen(["sh", "-c", f"head -c {total} /dev/zero | cat > {fifo}"])
    out, _ = reader.communicate(timeout=120)
    t1 = time.monotonic()
    writer.wait(60)
    if int(out.strip()) != total:
        raise RuntimeError(f"fifo: read {out.strip()} of {total} bytes")
    return total / (t1 - t0) / 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pipes", description=__doc__)
    ap.add_argument("--mib", type=int, default=256, help="MiB moved per run (default 256)")
    ap.add_argument("--chunk", type=int, default=1024, help="KiB per write (default 1024)")
    ap.add_argument("--runs", type=int, default=3, help="runs per system; best is shown")
    args = ap.parse_args(argv)
    total, chunk = args.mib * MiB, args.chunk * 1024
    tmp = Path(tempfile.mkdtemp(prefix="mqpb", dir="/tmp"))
    try:
        rows = []
        systems: list[tuple[str, Callable[[], float]]] = [
            ("msgq_trio pipe (broker + plugin)", lambda: bench_pipe(total, chunk, tmp)),
            ("raw AF_UNIX socket (Python)", lambda: bench_raw(total, chunk, tmp)),
            ("cat through a fifo", lambda: bench_fifo(total, tmp)),
        ]
        for label, fn in systems:
            results = []
            for _ in range(args.runs):
                for f in tmp.iterdir():
                    if f.name != "bus.sock":
                        f.unlink()
                results.append(fn())
            rows.append((label, max(results), results))
        print(
            f"{args.mib} MiB, {args.chunk} KiB writes, best of {args.runs} ({os.cpu_count()} CPUs)"
        )
        for label, best, results in rows:
            runs = ", ".join(f"{r:.0f}" for r in results)
            print(f"  {label:34s} {best:8.0f} MB/s   (runs: {runs})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
