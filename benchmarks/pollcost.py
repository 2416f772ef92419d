"""What busy polling costs at paced rates: broker CPU with ``limits.busy_poll`` at its
default and at 0. ``python -m benchmarks.pollcost [--seconds 5]``.

For each rate and kind (``call``: a trio client calls an echo command on another; ``send``:
one-way messages to it), a fresh broker is started twice, default and ``--busy-poll 0``;
one process holds both clients and paces the traffic at the rate (``trio.sleep_until``
on a fixed schedule). Broker CPU is user + system time from ``/proc/PID/stat`` over the
paced period, as a share of one core; the p50 is the caller's own timing of a call (or
of ``send``). The benchmark's ``req-reply`` column is the same call back to back; this
tool shows the cost where calls are spaced, which the adaptive window is for.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import trio

import msgq_trio
from msgq_trio.demo import start_broker

TICK = os.sysconf("SC_CLK_TCK")
#: (calls or messages per second, kind)
CASES = ((100, "call"), (1000, "call"), (3000, "call"), (1000, "send"), (5000, "send"))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def _paced(sock: Path, rate: float, kind: str, seconds: float) -> tuple[int, float]:
    """Run the paced traffic; (operations done, p50 of their own time in µs)."""
    async with (
        msgq_trio.connect(sock, name="callee") as callee,
        msgq_trio.connect(sock, name="caller") as caller,
    ):
        callee.add_command("echo", lambda params: params)
        await callee.subscribe("Echo")
        period = 1.0 / rate
        t0 = trio.current_time()
        times = []
        n = 0
        while trio.current_time() - t0 < seconds:
            start = time.perf_counter()
            if kind == "call":
                await caller.call("Echo", "echo", n)
            else:
                await caller.send("Echo", n)
            times.append(time.perf_counter() - start)
            n += 1
            await trio.sleep_until(t0 + n * period)
        times.sort()
        return n, times[len(times) // 2] * 1e6


def measure(rate: float, kind: str, flags: tuple[str, ...], seconds: float) -> dict[str, float]:
    """One broker, one paced run: its CPU share of a core, the operations, their p50."""
    with tempfile.TemporaryDirectory(prefix="mqpc") as d:
        sock = Path(d) / "bus.sock"
        proc = start_broker(sock, *flags)
        try:
            time.sleep(0.3)
            before, t = _cpu_seconds(proc.pid), time.monotonic()
            n, p50 = trio.run(_paced, sock, rate, kind, seconds)
            cpu = (_cpu_seconds(proc.pid) - before) / (time.monotonic() - t)
        finally:
            proc.terminate()
            proc.wait(10)
    return {"ops": n, "cpu_share": cpu, "p50_us": p50}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="paced period per run")
    args = ap.parse_args(argv)
    print(
        "| traffic | broker CPU, default (busy polling) | broker CPU, --busy-poll 0 "
        "| p50 µs default / off |"
    )
    print("|---|---|---|---|")
    for rate, kind in CASES:
        on = measure(rate, kind, (), args.seconds)
        off = measure(rate, kind, ("--busy-poll", "0"), args.seconds)
        what = f"{rate:,} {'calls' if kind == 'call' else 'one-way messages'}/s"
        print(
            f"| {what} ({on['ops']:,} done) | {on['cpu_share']:.1%} of a core "
            f"| {off['cpu_share']:.1%} | {on['p50_us']:.0f} / {off['p50_us']:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
