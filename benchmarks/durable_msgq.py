"""Durable queue benchmark: acked (after fsync) msgs/s through the queue plugin.

``run_durable(n, size, producers, consumer, workdir, timeout)`` starts its own broker with
the queue plugin (store in ``workdir``, ``sync = true``), runs ``producers`` producer
processes that together put ``n`` messages of ``size`` bytes with a window of batches in
flight (``start_put_many``: one frame, one commit per batch; ack 1 after fsync), and
optionally one consumer process acking every message (push, window ``CONSUMER_WINDOW``).

Ack-1 latency is measured per batch (send of the batch -> its answer) and applies to every
message of the batch. ``python -m benchmarks.durable_msgq`` prints the median of 3
runs for n=200,000, size=100, producers 1 and 16, consumer off and on.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from . import child_env

#: Messages per put_many frame / commit, and batches in flight per producer: 4 x 500
#: keeps the group commit fed (the next batches arrive while one is fsynced) without
#: making one batch's latency huge.
BATCH = 500
WINDOW = 4
CONSUMER_WINDOW = 1000
QUEUE = "bench"


def _percentile(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(p / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.durable_msgq", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def _readline(p: subprocess.Popen[str], what: str) -> str:
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"{what} exited (status {p.wait()}) without answering")
    return line.strip()


def run_durable(
    n: int, size: int, producers: int, consumer: bool, workdir: Path, timeout: float
) -> dict[str, Any]:
    """Run one durable benchmark; see the module docstring.

    Returns:
        ``{"msgs_per_s", "ack_p50_us", "ack_p99_us", "writes_skipped_share", "fsyncs"}``;
        ``writes_skipped_share`` is None without a consumer.
    Raises:
        RuntimeError: the broker or a worker failed or did not finish within ``timeout``.
    Resource handling: every process started is killed on return; ``workdir/store`` is
    recreated at the start of each run and left for inspection.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "store"
    shutil.rmtree(store, ignore_errors=True)
    sock = workdir / "b.sock"
    cfg = workdir / "durable.toml"
    cfg.write_text(
        f'[plugins.queue]\ndir = "{store}"\nsync = true\n[plugins.queue.queues.{QUEUE}]\n'
    )
    log = open(workdir / "broker.log", "w")  # noqa: SIM115 - closed in finally
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
            "--config",
            str(cfg),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    procs: list[subprocess.Popen[str]] = []
    deadline = time.monotonic() + timeout

    def expire() -> None:
        # A worker that never answers would block a readline forever: killing every
        # process at the deadline ends those reads (EOF -> RuntimeError).
        for p in [broker, *procs]:
            if p.poll() is None:
                p.kill()

    watchdog = threading.Timer(timeout, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        if "listening" not in _readline(broker, "broker"):
            raise RuntimeError("broker did not start; see " + str(workdir / "broker.log"))
        cons = None
        if consumer:
            cons = _spawn(["--consumer", str(sock), str(n)])
            procs.append(cons)
            _readline(cons, "consumer")  # "ready"
        share = [n // producers + (i < n % producers) for i in range(producers)]
        prods = [
            _spawn(["--producer", str(sock), str(k), str(size), str(i)])
            for i, k in enumerate(share)
        ]
        procs += prods
        for p in prods:
            _readline(p, "producer")  # "ready"
        t0 = time.perf_counter()
        for p in prods:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        latencies: list[float] = []
        weights: list[int] = []
        for p in prods:
            res = json.loads(_readline(p, "producer"))
            latencies += res["lat"]
            weights += res["n"]
        elapsed = time.perf_counter() - t0
        if time.monotonic() > deadline:
            raise RuntimeError(f"run took longer than {timeout} s")
        stats = json.loads(_run_stats(sock))
        if cons is not None:
            _readline(cons, "consumer")  # "done": everything consumed
        per_msg = sorted(x for lat, w in zip(latencies, weights, strict=True) for x in [lat] * w)
        put = stats["put"] or 1
        return {
            "msgs_per_s": n / elapsed,
            "ack_p50_us": _percentile(per_msg, 50) * 1e6,
            "ack_p99_us": _percentile(per_msg, 99) * 1e6,
            "writes_skipped_share": stats["writes_skipped"] / put if consumer else None,
            "fsyncs": int(stats["fsyncs"]),
        }
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        broker.terminate()
        try:
            broker.wait(15)
        except subprocess.TimeoutExpired:
            broker.kill()
            broker.wait()
        log.close()


def _run_stats(sock: Path) -> str:
    from msgq_trio.sync import connect

    with connect(sock, "bench-stats") as bus:
        return json.dumps(bus.queue(QUEUE).stats())


# -- worker processes -----------------------------------------------------------------------
def _producer(sock: str, n: int, size: int, index: int) -> None:
    import trio

    from msgq_trio import connect

    async def main() -> None:
        async with connect(sock, f"bench-producer-{index}") as bus:
            q = bus.queue(QUEUE)
            await q.prepare()
            body = b"x" * size
            print("ready", flush=True)
            await trio.to_thread.run_sync(sys.stdin.readline)
            waits: collections.deque[tuple[float, int, Any]] = collections.deque()
            lat: list[float] = []
            sizes: list[int] = []

            async def finish() -> None:
                t, k, wait = waits.popleft()
                await wait()
                lat.append(time.perf_counter() - t)
                sizes.append(k)

            left = n
            while left:
                k = min(BATCH, left)
                left -= k
                if len(waits) == WINDOW:
                    await finish()
                waits.append((time.perf_counter(), k, q.start_put_many([body] * k)))
            while waits:
                await finish()
            print(json.dumps({"lat": lat, "n": sizes}), flush=True)

    trio.run(main)


def _consumer(sock: str, n: int) -> None:
    import trio

    from msgq_trio import connect

    async def main() -> None:
        async with connect(sock, "bench-consumer") as bus:
            got = 0
            async with bus.queue(QUEUE).consume(window=CONSUMER_WINDOW) as msgs:
                print("ready", flush=True)
                async for m in msgs:
                    await m.ack()
                    got += 1
                    if got >= n:
                        break
            print("done", flush=True)

    trio.run(main)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--producer", nargs=4, metavar=("SOCK", "N", "SIZE", "INDEX"))
    p.add_argument("--consumer", nargs=2, metavar=("SOCK", "N"))
    p.add_argument("--n", type=int, default=200_000)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path(f"/tmp/msgq-durable-{os.getpid()}"))
    args = p.parse_args(argv)
    if args.producer:
        sock, n, size, index = args.producer
        _producer(sock, int(n), int(size), int(index))
        return 0
    if args.consumer:
        _consumer(args.consumer[0], int(args.consumer[1]))
        return 0
    print(
        f"durable queue: n={args.n} size={args.size}, median of {args.runs} runs "
        f"(ack 1 after fsync; batches of {BATCH}, window {WINDOW})"
    )
    for producers in (1, 16):
        for consumer in (False, True):
            runs = [
                run_durable(args.n, args.size, producers, consumer, args.workdir, 300)
                for _ in range(args.runs)
            ]

            def med(key: str, runs: list[dict[str, Any]] = runs) -> float:
                return float(statistics.median(float(r[key]) for r in runs))

            share = "-" if not consumer else f"{med('writes_skipped_share'):.1%}"
            print(
                f"producers={producers:2d} consumer={'on ' if consumer else 'off'} "
                f"msgs/s={med('msgs_per_s'):9.0f} ack p50={med('ack_p50_us') / 1000:7.1f} ms "
                f"p99={med('ack_p99_us') / 1000:7.1f} ms fsyncs={med('fsyncs'):.0f} "
                f"writes skipped={share}",
                flush=True,
            )
    shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
