"""Pipe throughput: a msgq_trio named pipe next to a raw Unix socket and ``cat`` through a
fifo, each between two processes. ``python -m benchmarks.pipes [--mib 256]``.

The cross-broker row (``--cross``, docs/PIPES.md "Pipes across brokers") moves the same
bytes from a writer on broker A to a reader on broker B, two brokers on this machine
joined by ``--pipe-peer``, beside the single-broker row, for each ``--chunks`` size
(``--cross`` alone: 64 KiB and 4 MiB writes, the pipe rows only).

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
from functools import partial
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


def _serve(sock: Path, *flags: str) -> subprocess.Popen[str]:
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
            *flags,
        ],
        stdout=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert broker.stdout is not None
    if "listening" not in broker.stdout.readline():
        raise RuntimeError("the broker did not start")
    return broker


def _wait_peers(socks: list[Path], timeout: float = 30.0) -> None:
    """Until each broker's pipe service is connected to the other, both ways."""
    import trio

    import msgq_trio

    async def up(sock: Path) -> bool:
        async with msgq_trio.connect(sock, "bench-stats") as bus:
            fed = (await bus.call("msgq-pipe", "pipe.stats", {}))["federation"]
            return all(p["state"] == "up" for p in fed["peers"]) and bool(fed["links_in"])

    deadline = time.monotonic() + timeout
    while not all(trio.run(up, s) for s in socks):
        if time.monotonic() > deadline:
            raise RuntimeError("the brokers did not connect to each other")
        time.sleep(0.1)


def bench_pipe(total: int, chunk: int, tmp: Path, *, cross: bool = False) -> float:
    """MB/s through a msgq_trio pipe (broker + pipe plugin + writer + reader processes);
    ``cross``: writer on broker A, reader on broker B (two brokers joined by
    ``--pipe-peer``; the pipe's name is homed on one of them, so the bytes cross the
    broker-to-broker connection once)."""
    sock = tmp / "bus.sock"
    other = tmp / "bus2.sock"
    brokers = []
    try:
        if cross:
            brokers.append(_serve(sock, "--pipe-peer", str(other)))
            brokers.append(_serve(other, "--pipe-peer", str(sock)))
            _wait_peers([sock, other])
        else:
            brokers.append(_serve(sock))
        env = dict(os.environ, MSGQ_TRIO_SOCKET=str(other if cross else sock))
        reader = _start(_PIPE_PEER, "read", "bench", str(total), str(chunk), env=env)
        assert reader.stdout is not None
        reader.stdout.readline()
        env = dict(os.environ, MSGQ_TRIO_SOCKET=str(sock))
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
        for broker in brokers:
            broker.send_signal(signal.SIGTERM)
        for broker in brokers:
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
    ap.add_argument(
        "--cross",
        action="store_true",
        help="the pipe on one broker and across two (writer on A, reader on B), per "
        "--chunks size, instead of the comparison with a socket and a fifo",
    )
    ap.add_argument(
        "--chunks",
        default="64,4096",
        help="with --cross: KiB per write, comma-separated (default 64,4096)",
    )
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
        if args.cross:
            systems = []
            for kib in (int(k) for k in args.chunks.split(",")):
                systems += [
                    (
                        f"pipe, one broker, {kib} KiB writes",
                        partial(bench_pipe, total, kib * 1024, tmp),
                    ),
                    (
                        f"pipe, two brokers, {kib} KiB writes",
                        partial(bench_pipe, total, kib * 1024, tmp, cross=True),
                    ),
                ]
        for label, fn in systems:
            results = []
            for _ in range(args.runs):
                for f in tmp.iterdir():
                    if f.name not in ("bus.sock", "bus2.sock"):
                        f.unlink()
                results.append(fn())
            rows.append((label, max(results), results))
        what = f"{args.chunks} KiB writes" if args.cross else f"{args.chunk} KiB writes"
        print(f"{args.mib} MiB, {what}, best of {args.runs} ({os.cpu_count()} CPUs)")
        for label, best, results in rows:
            runs = ", ".join(f"{r:.0f}" for r in results)
            print(f"  {label:34s} {best:8.0f} MB/s   (runs: {runs})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
