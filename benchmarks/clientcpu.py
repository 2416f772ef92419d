"""Client CPU per one-way message, publisher and subscriber apart, and where the
subscriber's goes: ``python -m benchmarks.clientcpu [--n 200000] [--runs 3]
[--no-gc] [--profile pub|sub] [--subscribers N]``.

A fresh broker; a subscriber process (``async for msg in bus`` reading ``msg.body``)
and a publisher process (``await bus.send(group, body)`` for 100-byte bodies, then
``flush``), both the trio client as the README teaches it. Each reports its own
``time.process_time()`` over the messages, divided by their number, and the
subscriber also its receives, the bytes per receive and the time its garbage
collector spent per generation (``gc.callbacks``). ``--no-gc`` turns the collector
off in both (to see what it costs); ``--profile`` runs one side under cProfile and
prints its top functions to stderr (the figures of such a run are not comparable).
Used for the A/B of client changes (BENCHMARKS.md, "Client CPU per message"); the
benchmark proper (``python -m benchmarks``) reports broker + client CPU per message beside
the peers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import msgq_trio
from msgq_trio.demo import start_broker
from msgq_trio.protocol.framing import SPEEDUPS

from . import child_env

GROUP = "clientcpu"
SIZE = 100


class _GcTimer:
    """Seconds the collector spent per generation (a ``gc.callbacks`` entry)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1


async def _sub(sock: str, n: int, timer: _GcTimer) -> dict[str, Any]:
    from msgq_trio.transport import sockets

    receives = [0, 0]
    orig = sockets.SocketReceiver.receive_into

    async def counted(self: sockets.SocketReceiver, conn: Any) -> int:
        got = await orig(self, conn)
        receives[0] += 1
        receives[1] += got
        return got

    sockets.SocketReceiver.receive_into = counted  # type: ignore[method-assign]
    count = 0
    t0 = w0 = 0.0
    async with msgq_trio.connect(sock, name="clientcpu-sub") as bus:
        await bus.subscribe(GROUP)
        print("READY", flush=True)
        async for msg in bus:
            if count == 0:
                t0, w0 = time.process_time(), time.monotonic()
                receives[:] = [0, 0]
                timer.seconds = [0.0, 0.0, 0.0]
                timer.collections = [0, 0, 0]
            count += 1
            if len(msg.body) != SIZE:
                raise AssertionError(f"body of {len(msg.body)} bytes, sent {SIZE}")
            if count >= n:
                break
        t1, w1 = time.process_time(), time.monotonic()
    return {
        "cpu_us": (t1 - t0) / max(1, n - 1) * 1e6,
        "rate": (n - 1) / max(1e-9, w1 - w0),
        "receives": receives[0],
        "bytes_per_receive": receives[1] / max(1, receives[0]),
        "gc_ms": [round(s * 1000, 1) for s in timer.seconds],
        "gc_collections": timer.collections,
    }


async def _pub(sock: str, n: int) -> dict[str, Any]:
    body = os.urandom(SIZE)
    async with msgq_trio.connect(sock, name="clientcpu-pub") as bus:
        await trio.sleep(0.3)  # the subscriber's subscription is in place before this
        t0, w0 = time.process_time(), time.monotonic()
        send = bus.send
        for _ in range(n):
            await send(GROUP, body)
        await bus.flush()
        t1, w1 = time.process_time(), time.monotonic()
    return {"cpu_us": (t1 - t0) / n * 1e6, "rate": n / (w1 - w0)}


def _child(role: str, sock: str, n: int, no_gc: bool, profile: bool) -> None:
    timer = _GcTimer()
    gc.callbacks.append(timer)
    if no_gc:
        gc.disable()
    run: Any = (lambda: _sub(sock, n, timer)) if role == "sub" else (lambda: _pub(sock, n))
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        result = prof.runcall(trio.run, run)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    else:
        result = trio.run(run)
    print("RESULT " + json.dumps(result), flush=True)


def _result(out: str) -> dict[str, Any]:
    for line in out.splitlines():
        if line.startswith("RESULT "):
            parsed: dict[str, Any] = json.loads(line[7:])
            return parsed
    raise RuntimeError(f"a client printed no RESULT: {out!r}")


def run_once(
    n: int, *, no_gc: bool = False, profile: str = "", subscribers: int = 1
) -> dict[str, Any]:
    """One broker, ``subscribers`` subscribers, one publisher; every client's figures
    (``sub``: the first subscriber's, ``subs``: all of them)."""
    with tempfile.TemporaryDirectory(prefix="msgq-clientcpu-") as tmp:
        sock = str(Path(tmp) / "bus.sock")
        broker = start_broker(Path(sock))
        try:
            argv = [sys.executable, "-m", "benchmarks.clientcpu", "--n", str(n)]
            argv += ["--no-gc"] if no_gc else []

            def start(role: str) -> subprocess.Popen[str]:
                extra = ["--profile", role] if profile == role else []
                return subprocess.Popen(
                    [*argv, *extra, "--child", role, "--socket", sock],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=child_env(),
                )

            subs = [start("sub") for _ in range(subscribers)]
            for sub in subs:
                assert sub.stdout is not None
                if not sub.stdout.readline().startswith("READY"):
                    raise RuntimeError("a subscriber did not start")
            pub = start("pub")
            pub_out = pub.communicate(timeout=300)[0]
            sub_outs = [sub.communicate(timeout=300)[0] for sub in subs]
        finally:
            broker.terminate()
            broker.wait()
    results = [_result(out) for out in sub_outs]
    return {"pub": _result(pub_out), "sub": results[0], "subs": results}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200_000, help="messages (default 200,000)")
    p.add_argument("--runs", type=int, default=3, help="runs, each printed (default 3)")
    p.add_argument("--no-gc", action="store_true", help="garbage collector off in both")
    p.add_argument("--profile", choices=("pub", "sub"), default="", help="cProfile one side")
    p.add_argument(
        "--subscribers",
        type=int,
        default=1,
        help="subscribers of the publisher's group (default 1; 4: the fan-out workload); "
        "sub figures are their mean",
    )
    p.add_argument("--child", choices=("pub", "sub"), help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child, args.socket, args.n, args.no_gc, args.profile == args.child)
        return
    # The children import the same build (same environment): say which one is measured.
    build = "compiled fast path" if SPEEDUPS else "pure Python (MSGQ_TRIO_PURE_PYTHON or no build)"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"msgq_trio {msgq_trio.__version__}: {build}; load average {load}", flush=True)
    for _ in range(args.runs):
        r = run_once(args.n, no_gc=args.no_gc, profile=args.profile, subscribers=args.subscribers)
        pub, subs = r["pub"], r["subs"]
        sub = {
            key: sum(s[key] for s in subs) / len(subs)
            for key in ("cpu_us", "rate", "receives", "bytes_per_receive")
        }
        sub["gc_ms"] = [round(sum(s["gc_ms"][g] for s in subs) / len(subs), 1) for g in range(3)]
        sub["gc_collections"] = [
            round(sum(s["gc_collections"][g] for s in subs) / len(subs)) for g in range(3)
        ]
        print(
            f"pub {pub['cpu_us']:.2f} us/msg ({pub['rate'] / 1e3:,.0f}k/s)  "
            f"sub {sub['cpu_us']:.2f} us/msg ({sub['rate'] / 1e3:,.0f}k/s)  "
            f"sum {pub['cpu_us'] + sub['cpu_us']:.2f}  "
            f"sub: {sub['receives']} receives of {sub['bytes_per_receive'] / 1024:,.0f} KiB, "
            f"gc ms per generation {sub['gc_ms']} in {sub['gc_collections']} collections",
            flush=True,
        )


if __name__ == "__main__":
    main()
