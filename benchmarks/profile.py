"""Profile the msgq_trio broker's hot path under a benchmark workload with py-spy.

Usage::

    python -m benchmarks.profile [--workloads one-way,req-reply] [--rate 250]
                                      [--out DIR] [--top 25] [--clients]

Runs each workload once (full size) against a fresh broker process while ``py-spy
record --nonblocking`` samples that broker, then prints, per workload, the functions with
the most samples at the top of the stack (self) and on it (inclusive), as shares of the
samples. ``DIR`` keeps the collapsed stacks (``<workload>.txt``, for flamegraph tools).
With ``--clients`` the client processes (subscriber, publisher, requester, responder) are
sampled too, each into ``<workload>-<process>.txt``. py-spy skips idle threads, but with
``--nonblocking`` it cannot tell that trio is blocked in ``epoll_wait``: those samples are
counted apart and left out of the shares.

py-spy (``pip install py-spy``) needs ptrace rights over the broker: root, or
``kernel.yama.ptrace_scope = 0``. Not part of ``python -m benchmarks``: sampling costs the
broker a little, so the figures of a profiled run are not quoted.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .procs import Proc, Service
from .systems import SYSTEMS, System, _start_msgq
from .workloads import FULL, FULL_TIMEOUT, WORKLOADS, run_one


def _profiled(out: Path, rate: int, spy: str) -> tuple[System, list[float]]:
    """A msgq_trio system whose broker py-spy samples into ``out`` while it runs."""
    started: list[float] = []

    def start(run_dir: Path, pattern: str, deadline: float) -> Service:
        svc = _start_msgq(run_dir, pattern, deadline)
        proc = subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(svc.pids[0]),
                "--rate",
                str(rate),
                "--nonblocking",
                "--format",
                "raw",
                "--output",
                str(out),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        started.append(time.monotonic())

        def stop() -> None:
            # SIGINT makes py-spy write its output; it runs before the broker's stop.
            started.append(time.monotonic())
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

        svc.stops.append(stop)
        return svc

    return dataclasses.replace(
        SYSTEMS["msgq_trio"], description="profiled broker", start=start
    ), started


#: Leaf frames that are trio blocked in epoll_wait: py-spy's ``--nonblocking`` mode
#: samples them as if running (the GIL is released there).
_WAITING = ("EpollIOManager.get_events", "EpollIOManager._epoll_wait")


def summarize(stacks: Path, top: int) -> tuple[int, list[str]]:
    """(samples, report lines) from py-spy's collapsed stacks; samples blocked in
    epoll_wait are counted but left out of the shares."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = waiting = 0
    for line in stacks.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_s)
        frames = [_short(f) for f in stack.split(";")]
        if frames[-1].startswith(_WAITING):
            waiting += count  # blocked in epoll_wait: idle, not work
            continue
        total += count
        own[frames[-1]] += count
        for f in set(frames):
            inclusive[f] += count
    lines = [
        f"{waiting:,} samples waiting in epoll (left out); shares of the {total:,} others:",
        "  self  incl  function (file of the function)",
    ]
    shown = set()
    for name, n in own.most_common(top):
        shown.add(name)
        lines.append(f"{n / total:6.1%} {inclusive[name] / total:5.0%}  {name}")
    lines.append("  inclusive only (callers):")
    for name, n in inclusive.most_common(top * 2):
        if name not in shown and n / total >= 0.05:
            lines.append(f"        {n / total:5.0%}  {name}")
    return total + waiting, lines


def _short(frame: str) -> str:
    """``func (path/to/msgq_trio/x.py:12)`` -> ``func (msgq_trio/x.py)``."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    for marker in ("site-packages/", "/lib/python3", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{name} ({path})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="py-spy profile of the msgq_trio broker")
    p.add_argument("--workloads", default="one-way,req-reply")
    p.add_argument("--rate", type=int, default=250, help="samples per second")
    p.add_argument("--out", type=Path, help="keep the collapsed stacks here")
    p.add_argument("--top", type=int, default=20)
    p.add_argument(
        "--clients", action="store_true", help="also sample every client process of the workload"
    )
    args = p.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="mqp-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    spies: list[subprocess.Popen[bytes]] = []
    worker = Proc.worker
    for key in args.workloads.split(","):
        stacks = out_dir / f"{key}.txt"
        system, times = _profiled(stacks, args.rate, spy)
        if args.clients:

            def spied(
                name: str,
                module: str,
                spec: dict[str, object],
                log_dir: Path,
                pass_fds: tuple[int, ...] = (),
                key: str = key,
            ) -> Proc:
                proc = worker(name, module, spec, log_dir, pass_fds)
                # py-spy ends, and writes its file, when the process it samples exits.
                spies.append(
                    subprocess.Popen(
                        [
                            spy,
                            "record",
                            "--pid",
                            str(proc.popen.pid),
                            "--rate",
                            str(args.rate),
                            "--nonblocking",
                            "--format",
                            "raw",
                            "--output",
                            str(out_dir / f"{key}-{name}.txt"),
                        ],
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                return proc

            Proc.worker = spied  # type: ignore[method-assign,assignment]
        try:
            res = run_one(system, WORKLOADS[key], FULL[key], FULL_TIMEOUT)
        finally:
            Proc.worker = worker  # type: ignore[method-assign]
            for sp in spies:
                try:
                    sp.wait(30)
                except subprocess.TimeoutExpired:
                    sp.kill()
                    sp.wait(5)
            spies.clear()
        seconds = times[1] - times[0] if len(times) == 2 else 0.0
        w = WORKLOADS[key]
        figure = (
            f"{res['value']:,.1f} {w.unit}"
            if res["status"] == "ok"
            else f"{res['status']}: {res['detail']}"
        )
        print(f"== {key}: {figure} (profiled, not a benchmark figure)")
        if not stacks.exists():
            print("   py-spy wrote nothing (ptrace not permitted?)")
            continue
        total, lines = summarize(stacks, args.top)
        busy = total / (args.rate * seconds) if seconds else 0.0
        print(
            f"   {total:,} samples over {seconds:.1f} s of broker life ({busy:.0%} of "
            f"{args.rate}/s)"
        )
        print("\n".join("   " + line for line in lines))
        for client in sorted(out_dir.glob(f"{key}-*.txt")):
            n, lines = summarize(client, args.top // 2)
            print(f"   -- client {client.stem[len(key) + 1 :]}: {n:,} samples")
            print("\n".join("   " + line for line in lines))
    print(f"collapsed stacks in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
