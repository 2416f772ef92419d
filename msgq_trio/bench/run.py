"""``msgq-trio bench``: msgq_trio next to raw-socket ceilings and (``--peers``) NATS,
Redis and ZeroMQ, on identical workloads, every broker and client its own process.

Usage::

    msgq-trio bench [--quick] [--peers] [--repeat R] [--systems a,b] [--workloads x,y]
                    [--json PATH] [--plot DIR] [--timeout S]

Workloads: one-way, fan-out, req-reply, concurrent, large (see
:mod:`msgq_trio.bench.workloads`). Systems: msgq_trio, raw-unix, py-relay (the default
set) and nats, redis, zeromq (``--peers``; installed when missing, see
:mod:`msgq_trio.bench.install`). Each figure is the median of R repetitions; repetitions
are interleaved (rep 1 of everything, then rep 2...) so slow drifts of the machine hit
every system alike. A run that exceeds its hard timeout is reported as ``timeout``, and
the remaining repetitions of that system and workload are skipped.

Exit status: 0 when msgq_trio and the ceilings were measured everywhere, 1 when one of
their runs failed or timed out (peers that are n/a or fail do not change it), 2 on a
usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .install import ensure_peers, missing, peer_versions
from .report import DASH, Results, cpu_table, latency_table, machine_info, plot, summarize, table
from .systems import DEFAULT_SYSTEMS, PEER, PEER_SYSTEMS, SYSTEMS
from .workloads import (
    FULL,
    FULL_TIMEOUT,
    QUICK,
    QUICK_TIMEOUT,
    WORKLOADS,
    describe,
    run_one,
)

Printer = Callable[[str], None]


def _csv(value: str, known: Sequence[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in known]
    if unknown or not items:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}")
    return items


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="msgq-trio bench",
        description="Benchmark msgq_trio against raw-socket ceilings and, with --peers, "
                    "NATS, Redis and ZeroMQ.")
    p.add_argument("--quick", "--smoke", action="store_true",
                   help="tiny counts, 1 repetition: checks that everything runs (< 60 s)")
    p.add_argument("--peers", action="store_true",
                   help="also run nats, redis, zeromq (installed if missing)")
    p.add_argument("--systems", type=lambda v: _csv(v, list(SYSTEMS), "system"),
                   help=f"comma-separated subset of: {', '.join(SYSTEMS)}")
    p.add_argument("--workloads", type=lambda v: _csv(v, list(WORKLOADS), "workload"),
                   help=f"comma-separated subset of: {', '.join(WORKLOADS)}")
    p.add_argument("--repeat", type=int, default=None,
                   help="repetitions per figure (default 3; 1 with --quick)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"hard timeout per run in seconds (default {FULL_TIMEOUT:.0f}, "
                        f"{QUICK_TIMEOUT:.0f} with --quick)")
    p.add_argument("--json", type=Path, metavar="PATH",
                   help="write every repetition's figures and the machine info here")
    p.add_argument("--plot", type=Path, metavar="DIR",
                   help="write PNG charts here (needs matplotlib)")
    p.add_argument("--no-install", action="store_true",
                   help="do not install missing peers; report them as n/a")
    p.add_argument("--markdown", action="store_true",
                   help="print the tables as Markdown (for BENCHMARKS.md)")
    p.add_argument("--render", type=Path, metavar="JSON",
                   help="run nothing: print the report of an earlier --json file")
    return p


def run_bench(systems: list[str], workloads: list[str], *, quick: bool, repeat: int,
              timeout: float, install: bool = True, say: Printer = print) -> dict[str, Any]:
    """Run the benchmark; returns the report (what ``--json`` writes)."""
    started = time.monotonic()
    machine = machine_info()  # at the start: the source tree may change during the run
    params = QUICK if quick else FULL
    unusable: dict[str, str] = {}
    peers = [s for s in systems if SYSTEMS[s].kind == PEER]
    if peers:
        unusable = ensure_peers(peers, say) if install else missing(peers)
    for name, reason in unusable.items():
        say(f"bench: {name} is n/a: {reason}")

    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {w: [] for w in workloads}
                                                         for s in systems}
    for rep in range(repeat):
        for wkey in workloads:
            w = WORKLOADS[wkey]
            for name in systems:
                done = runs[name][wkey]
                if name in unusable:
                    if not done:
                        done.append({"status": "n/a", "value": None,
                                     "detail": unusable[name]})
                    continue
                if done and done[-1]["status"] == "timeout":
                    continue  # one timeout is enough: do not spend R x timeout on it
                res = run_one(SYSTEMS[name], w, params[wkey], timeout, seed=rep)
                res["repetition"] = rep + 1
                done.append(res)
                figure = (f"{res['value']:,.1f} {w.unit}" if res["status"] == "ok"
                          else f"{res['status']}: {res['detail']}")
                say(f"[{rep + 1}/{repeat}] {wkey:<10} {name:<10} {figure} "
                    f"({res['seconds']:.1f} s)")

    results: Results = {s: {w: summarize(runs[s][w]) for w in workloads} for s in systems}
    return {
        "machine": machine,
        "versions": peer_versions() if peers else {},
        "config": {
            "mode": "quick" if quick else "full", "repeat": repeat, "timeout_s": timeout,
            "systems": systems, "workloads": workloads,
            "params": {w: params[w] for w in workloads},
            "descriptions": {w: describe(w, params[w]) for w in workloads},
            "system_descriptions": {s: SYSTEMS[s].description for s in systems},
        },
        "unavailable": unusable,
        "results": results,
        "wall_seconds": round(time.monotonic() - started, 1),
    }


def render(report: dict[str, Any], *, markdown: bool = False) -> str:
    """The text report: table, latency detail, settings."""
    results: Results = report["results"]
    cfg = report["config"]
    systems, workloads = cfg["systems"], cfg["workloads"]
    m = report["machine"]
    lines = [
        f"msgq-trio bench ({cfg['mode']}, median of {cfg['repeat']} "
        f"[min{DASH}max], ratio to the best peer): {m['nproc']} CPUs {m['cpu_model']}, "
        f"Python {m['python']}, msgq_trio {m['msgq_trio_version']}",
        "",
        table(results, systems, workloads, markdown=markdown),
    ]
    if cfg["mode"] == "quick":
        lines[1:1] = ["quick mode: counts are tiny, so these figures only show that "
                      "everything runs; do not quote them"]
    if "req-reply" in workloads:
        lines += ["", "request/reply round trip (median of repetitions):",
                  latency_table(results, systems, markdown=markdown)]
    lines += ["", "CPU µs per message / delivery / call, broker + all clients "
              "(large: per message):", cpu_table(results, systems, workloads,
                                                markdown=markdown)]
    notes = [f"  {s} {w}: {results[s][w]['note']}" for s in systems for w in workloads
             if results[s][w].get("note")]
    if notes:
        lines += ["", "* some repetitions failed:", *notes]
    lines += ["", "workloads:"] + [f"  {w}: {d}" for w, d in cfg["descriptions"].items()]
    lines.append(f"total wall time {report['wall_seconds']:.0f} s")
    return "\n".join(lines)


def _exit_status(report: dict[str, Any]) -> int:
    for name, per in report["results"].items():
        if SYSTEMS[name].kind == PEER:
            continue
        for s in per.values():
            if any(r.get("status") != "ok" for r in s["runs"]):
                return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``msgq-trio bench`` (``python -m msgq_trio bench ...``)."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["--"]:
        args_in = args_in[1:]
    parser = build_parser()
    args = parser.parse_args(args_in)
    if args.render:
        try:
            report = json.loads(args.render.read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"--render: cannot read {args.render}: {exc}")
        print(render(report, markdown=args.markdown))
        return _exit_status(report)
    systems = args.systems or DEFAULT_SYSTEMS + (PEER_SYSTEMS if args.peers else [])
    workloads = args.workloads or list(WORKLOADS)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    if repeat < 1:
        parser.error("--repeat must be at least 1")
    timeout = args.timeout or (QUICK_TIMEOUT if args.quick else FULL_TIMEOUT)
    report = run_bench(systems, workloads, quick=args.quick, repeat=repeat, timeout=timeout,
                       install=not args.no_install)
    report = {"command": "msgq-trio bench " + " ".join(args_in), **report}
    print()
    print(render(report, markdown=args.markdown))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"raw figures written to {args.json}")
    if args.plot:
        for path in plot(report["results"], systems, workloads, args.plot):
            print(f"plot written: {path}")
    return _exit_status(report)


def smoke(systems: Sequence[str] = ("msgq_trio", "raw-unix"),
          workloads: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the quick mode once and return the report, for the test suite.

    ``report["results"][system][workload]`` has ``status`` ("ok" when measured) and
    ``median`` (the figure, in ``WORKLOADS[workload].unit``). Prints nothing.
    """
    return run_bench(list(systems), list(workloads or WORKLOADS), quick=True, repeat=1,
                     timeout=QUICK_TIMEOUT, install=False, say=lambda _line: None)


if __name__ == "__main__":
    sys.exit(main())
