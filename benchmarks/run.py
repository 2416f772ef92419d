"""``python -m benchmarks``: msgq_trio next to raw-socket ceilings and (``--peers``) NATS,
Redis, ZeroMQ and RabbitMQ, on identical workloads, every broker and client its own
process.

Usage::

    python -m benchmarks [--quick] [--peers] [--rabbitmq] [--repeat R] [--systems a,b]
                    [--workloads x,y] [--sections main,msgq-only,durable,backlog]
                    [--backlog-messages N]
                    [--json PATH] [--plot DIR] [--timeout S] [--budget S]
    python -m benchmarks --scale [options of benchmarks.scale]

Sections: ``main`` (the peer table below), ``msgq-only`` (SIGKILL to ``recipient-gone``,
capture on/off, broker RSS per idle client: :mod:`benchmarks.extras`) and
``durable`` (durable acked publish: :mod:`benchmarks.durable`), and, only when
asked for, ``backlog`` (a queue filled past memory with no consumer, the plugin's RSS,
its restart time, then drained: :mod:`benchmarks.backlog`; 4,000,000 x 1 KiB by
default, which writes about 5 GiB).

Workloads: one-way, fan-out, req-reply, concurrent, large (see
:mod:`benchmarks.workloads`). Systems (:mod:`benchmarks.systems`): msgq_trio
with its trio, asyncio and direct clients (the trio and asyncio responders answer through
an ``async def`` handler; the ``-def-handler`` rows through a plain ``def``), raw-unix,
py-relay (the default set) and nats, redis, redis-asyncio, zeromq (``--peers``; installed
when missing, see :mod:`benchmarks.install`). The asyncio clients (msgq_trio.aio,
nats-py, redis.asyncio) also get a table of their own, side by side. Each figure is the
median of R repetitions; repetitions are interleaved (rep 1 of everything, then rep 2...)
so slow drifts of the machine hit every system alike. A run that exceeds its hard timeout
is reported as ``timeout``, and the remaining repetitions of that system and workload are
skipped.

Exit status: 0 when msgq_trio and the ceilings were measured everywhere, 1 when one of
their runs failed or timed out (peers that are n/a or fail do not change it), 2 on a
usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import durable, extras
from .install import ensure_peers, missing, peer_versions
from .report import (
    DASH,
    Results,
    asyncio_systems,
    cpu_table,
    durable_table,
    goal_table,
    latency_table,
    machine_info,
    msgq_only_table,
    plot,
    summarize,
    table,
)
from .systems import DEFAULT_SYSTEMS, PEER, PEER_SYSTEMS, SYSTEMS, TCP_SYSTEMS
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

#: Report sections: the peer table, the msgq_trio-only figures, the durable workload, the
#: backlog of the queue plugin (opt-in: it writes gigabytes).
SECTIONS = ("main", "msgq-only", "durable", "backlog")
DEFAULT_SECTIONS = ("main", "msgq-only", "durable")
#: Messages of 1 KiB in the backlog section: 3.8 GiB, past any memory bound the plugin
#: has, the size of the README's backlog figure; --quick uses BACKLOG_QUICK.
BACKLOG_FULL = 4_000_000
BACKLOG_QUICK = 20_000
BACKLOG_SIZE = 1024
#: msgq_trio-only figures: SIGKILLs per repetition, and idle-client counts.
#: 200 kills a repetition: enough for a p99 (a forked callee pool spares each kill an
#: interpreter start-up, so they stay cheap).
#: ``capture_n``: messages of the one-way workload run with capture off and on (half the
#: one-way count: a ratio needs no more, and it runs twice).
MSGQ_ONLY_FULL: dict[str, Any] = {"kills": 200, "idle": [1000, 10000], "capture_n": 100_000}
MSGQ_ONLY_QUICK: dict[str, Any] = {"kills": 2, "idle": [50], "capture_n": 2_000}
#: Seconds after which the remaining runs are skipped (reported as such), so a full run
#: on a slow or busy machine still ends in about 10 minutes.
FULL_BUDGET = 540.0
QUICK_BUDGET = 120.0


def _csv(value: str, known: Sequence[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in known]
    if unknown or not items:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(unknown) or '(none)'}; choose from {', '.join(known)}"
        )
    return items


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark msgq_trio against raw-socket ceilings and, with --peers, "
        "NATS, Redis (sync and asyncio) and ZeroMQ.",
    )
    p.add_argument(
        "--quick",
        "--smoke",
        action="store_true",
        help="tiny counts, 1 repetition: checks that everything runs (< 60 s)",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help="also run nats, redis, redis-asyncio, zeromq (installed if missing)",
    )
    p.add_argument(
        "--rabbitmq",
        action="store_true",
        help="also run rabbitmq, in every workload (installed if missing); its "
        "server starts once per benchmark (its start-up is slow: an Erlang node)",
    )
    p.add_argument(
        "--sections",
        type=lambda v: _csv(v, list(SECTIONS), "section"),
        help=f"comma-separated subset of: {', '.join(SECTIONS)} (default "
        f"{','.join(DEFAULT_SECTIONS)})",
    )
    p.add_argument(
        "--backlog-messages",
        type=int,
        default=None,
        metavar="N",
        help=f"messages of {BACKLOG_SIZE} B in the backlog section (default "
        f"{BACKLOG_FULL:,}, {BACKLOG_QUICK:,} with --quick)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds after which remaining runs are skipped (default "
        f"{FULL_BUDGET:.0f}, {QUICK_BUDGET:.0f} with --quick)",
    )
    p.add_argument(
        "--systems",
        type=lambda v: _csv(v, list(SYSTEMS), "system"),
        help=f"comma-separated subset of: {', '.join(SYSTEMS)}",
    )
    p.add_argument(
        "--workloads",
        type=lambda v: _csv(v, list(WORKLOADS), "workload"),
        help=f"comma-separated subset of: {', '.join(WORKLOADS)}",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="repetitions per figure (default 3; 1 with --quick)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=f"hard timeout per run in seconds (default {FULL_TIMEOUT:.0f}, "
        f"{QUICK_TIMEOUT:.0f} with --quick)",
    )
    p.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="write every repetition's figures and the machine info here",
    )
    p.add_argument(
        "--plot", type=Path, metavar="DIR", help="write PNG charts here (needs matplotlib)"
    )
    p.add_argument(
        "--no-install", action="store_true", help="do not install missing peers; report them as n/a"
    )
    p.add_argument(
        "--markdown",
        nargs="?",
        const="-",
        metavar="FILE",
        help="print the report as Markdown tables (for BENCHMARKS.md); with "
        "FILE, write them there and print the text report as usual",
    )
    p.add_argument(
        "--render",
        type=Path,
        metavar="JSON",
        help="run nothing: print the report (and with --plot, the plots) of an earlier --json file",
    )
    return p


def run_bench(
    systems: list[str],
    workloads: list[str],
    *,
    quick: bool,
    repeat: int,
    timeout: float,
    install: bool = True,
    say: Printer = print,
    sections: Sequence[str] = DEFAULT_SECTIONS,
    rabbitmq: bool = False,
    budget: float | None = None,
    backlog_messages: int | None = None,
    msgq_durable_rows: Sequence[str] = tuple(durable.MSGQ_ROWS),
) -> dict[str, Any]:
    """Run the benchmark; returns the report (what ``--json`` writes).

    ``systems`` and ``workloads`` are those of the main table; ``sections`` picks the
    parts to run; the durable workload runs the msgq_trio rows, nats and redis when they
    are in ``systems``, and rabbitmq when ``rabbitmq`` is true (``msgq_durable_rows``:
    which of :data:`durable.MSGQ_ROWS` run). Repetition ``r`` of every
    section runs before repetition ``r + 1`` of any. Once ``budget`` seconds have passed,
    the remaining runs are not started and show as ``skipped``.
    """
    started = time.monotonic()
    budget = budget if budget is not None else (QUICK_BUDGET if quick else FULL_BUDGET)
    machine = machine_info()  # at the start: the source tree may change during the run
    params = QUICK if quick else FULL
    unusable: dict[str, str] = {}
    main_on = "main" in sections
    rabbitmq = rabbitmq or "rabbitmq" in systems
    requested = systems  # the durable section's peers, with or without the main table
    systems = systems if main_on else []
    durable_rows = (
        list(msgq_durable_rows)
        + [p for p in durable.PEER_ROWS if p in requested or (p == "rabbitmq" and rabbitmq)]
        if "durable" in sections
        else []
    )
    peers = sorted(
        {s for s in systems if SYSTEMS[s].kind == PEER}
        | {p for p in durable_rows if p in durable.PEER_ROWS}
    )
    if peers:
        unusable = ensure_peers(peers, say) if install else missing(peers)
    for name, reason in unusable.items():
        say(f"bench: {name} is n/a: {reason}")
    only_params = MSGQ_ONLY_QUICK if quick else MSGQ_ONLY_FULL
    only_keys = (
        ["kill", "capture"] + [f"idle-{c}" for c in only_params["idle"]]
        if "msgq-only" in sections
        else []
    )
    only_runs: dict[str, list[dict[str, Any]]] = {k: [] for k in only_keys}
    durable_params = durable.DURABLE_QUICK if quick else durable.DURABLE_FULL
    durable_runs: dict[str, list[dict[str, Any]]] = {r: [] for r in durable_rows}

    def over_budget() -> bool:
        return time.monotonic() - started > budget

    skipped = {
        "status": "skipped",
        "value": None,
        "detail": f"time budget of {budget:.0f} s used up",
    }

    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {w: [] for w in workloads} for s in systems
    }
    rabbit = durable.SHARED_RABBIT  # started at first use, stopped in the finally
    try:
        for rep in range(repeat):
            for wkey in workloads:
                w = WORKLOADS[wkey]
                for name in systems:
                    done = runs[name][wkey]
                    if name in unusable:
                        if not done:
                            done.append({"status": "n/a", "value": None, "detail": unusable[name]})
                        continue
                    if SYSTEMS[name].only and wkey not in SYSTEMS[name].only:
                        if not done:
                            done.append(
                                {"status": "n/a", "value": None, "detail": SYSTEMS[name].not_run}
                            )
                        continue
                    if done and done[-1]["status"] in ("timeout", "skipped"):
                        continue  # one timeout is enough: do not spend R x timeout on it
                    if over_budget():
                        done.append(dict(skipped))
                        continue
                    res = run_one(SYSTEMS[name], w, params[wkey], timeout, seed=rep)
                    res["repetition"] = rep + 1
                    done.append(res)
                    figure = (
                        f"{res['value']:,.1f} {w.unit}"
                        if res["status"] == "ok"
                        else f"{res['status']}: {res['detail']}"
                    )
                    say(
                        f"[{rep + 1}/{repeat}] {wkey:<10} {name:<10} {figure} "
                        f"({res['seconds']:.1f} s)"
                    )
            for key in only_keys:
                done = only_runs[key]
                if done and done[-1]["status"] in ("timeout", "skipped", "n/a"):
                    continue
                if over_budget():
                    done.append(dict(skipped))
                    continue
                if key == "kill":
                    res = extras.run_kill(only_params["kills"], timeout)
                elif key == "capture":
                    res = extras.run_capture(
                        {**params["one-way"], "n": only_params["capture_n"]}, timeout, seed=rep
                    )
                else:
                    res = extras.run_idle(int(key.split("-")[1]), max(timeout, 90.0))
                res["repetition"] = rep + 1
                done.append(res)
                figure = (
                    f"{res['value']:,.2f}"
                    if res["status"] == "ok"
                    else f"{res['status']}: {res['detail']}"
                )
                say(f"[{rep + 1}/{repeat}] msgq-only  {key:<10} {figure} ({res['seconds']:.1f} s)")
            _durable_rep(
                durable_rows,
                durable_runs,
                durable_params,
                unusable,
                timeout,
                rep,
                repeat,
                over_budget,
                skipped,
                say,
                rabbit,
            )
        backlog_result: dict[str, Any] | None = None
        if "backlog" in sections:
            n = backlog_messages or (BACKLOG_QUICK if quick else BACKLOG_FULL)
            backlog_result = _backlog(n, over_budget(), skipped, say)
    finally:
        rabbit_start = rabbit.start_seconds
        rabbit.close()

    results: Results = {s: {w: summarize(runs[s][w]) for w in workloads} for s in systems}
    return {
        "machine": machine,
        "versions": peer_versions() if peers else {},
        "config": {
            "mode": "quick" if quick else "full",
            "repeat": repeat,
            "timeout_s": timeout,
            "systems": systems,
            "workloads": workloads,
            "params": {w: params[w] for w in workloads},
            "descriptions": {w: describe(w, params[w]) for w in workloads},
            "system_descriptions": {s: SYSTEMS[s].description for s in systems},
        },
        "unavailable": unusable,
        "results": results,
        "msgq_only": {k: summarize(v) for k, v in only_runs.items()},
        "msgq_only_params": only_params if only_keys else {},
        "durable": {k: summarize(v) for k, v in durable_runs.items()},
        "durable_params": durable_params if durable_rows else {},
        "backlog": backlog_result,
        "rabbitmq_start_seconds": rabbit_start,
        "wall_seconds": round(time.monotonic() - started, 1),
        "loadavg_end": _loadavg(),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _backlog(n: int, over: bool, skipped: dict[str, Any], say: Printer) -> dict[str, Any]:
    """The backlog section, once (it is one long run, not a repeated figure)."""
    if over:
        return dict(skipped)
    import tempfile

    from .backlog import run_backlog

    t0 = time.monotonic()
    try:
        res: dict[str, Any] = {
            "status": "ok",
            **run_backlog(n, BACKLOG_SIZE, Path(tempfile.mkdtemp(prefix="msgq-backlog-"))),
        }
    except (RuntimeError, OSError) as exc:
        res = {"status": "failed", "value": None, "detail": str(exc)}
    res["seconds"] = round(time.monotonic() - t0, 1)
    say(
        f"backlog    {n:,} x {BACKLOG_SIZE} B: "
        + (
            f"fill {res['fill_msgs_per_s']:,.0f} msgs/s, plugin peak RSS "
            f"{res['fill_peak_rss_mib']:.0f} MiB, restart {res['restart_with_backlog_s']:.2f} s, "
            f"drain {res['drain_msgs_per_s']:,.0f} msgs/s"
            if res["status"] == "ok"
            else f"{res['status']}: {res['detail']}"
        )
        + f" ({res['seconds']:.1f} s)"
    )
    return res


def _durable_rep(
    rows: list[str],
    runs: dict[str, list[dict[str, Any]]],
    params: dict[str, int],
    unusable: dict[str, str],
    timeout: float,
    rep: int,
    repeat: int,
    over_budget: Callable[[], bool],
    skipped: dict[str, Any],
    say: Printer,
    rabbit: durable.SharedRabbit,
) -> None:
    """Repetition ``rep`` of the durable workload on every row (RabbitMQ is the shared
    server ``rabbit``, started on its first use; a fresh durable queue per run)."""
    for name in rows:
        done = runs[name]
        if name in unusable or (done and done[-1]["status"] in ("timeout", "skipped", "n/a")):
            if name in unusable and not done:
                done.append({"status": "n/a", "value": None, "detail": unusable[name]})
            continue
        if over_budget():
            done.append(dict(skipped))
            continue
        server = None
        if name == "rabbitmq":
            first = rabbit.start_seconds is None
            server = rabbit.get()
            if first and server is not None:
                say(
                    f"[{rep + 1}/{repeat}] durable    rabbitmq-server started in "
                    f"{rabbit.start_seconds:.1f} s"
                )
        if name == "rabbitmq" and server is None:
            res = {"status": "n/a", "value": None, "detail": rabbit.error, "seconds": 0.0}
        else:
            res = durable.run_durable_one(
                name, params, min(timeout, durable.DURABLE_TIMEOUT), rep, server
            )
        res["repetition"] = rep + 1
        done.append(res)
        figure = (
            f"{res['value']:,.0f} msgs/s"
            if res["status"] == "ok"
            else f"{res['status']}: {res['detail']}"
        )
        say(f"[{rep + 1}/{repeat}] durable    {name:<10} {figure} ({res['seconds']:.1f} s)")


def _build(m: dict[str, Any]) -> str:
    """Which frame codec the run measured (reports from before it was recorded: none)."""
    if "msgq_trio_speedups" not in m:
        return ""
    return " (compiled fast path)" if m["msgq_trio_speedups"] else " (pure Python)"


def render(report: dict[str, Any], *, markdown: bool = False) -> str:
    """The report: tables, latency and CPU detail, msgq_trio-only and durable figures,
    settings. ``markdown``: GitHub tables with a blank line around each, lists as lists,
    ready to paste into BENCHMARKS.md."""
    results: Results = report["results"]
    cfg = report["config"]
    systems, workloads = cfg["systems"], cfg["workloads"]
    m = report["machine"]
    gap = [""] if markdown else []  # Markdown: a table must not continue a paragraph
    item = "- " if markdown else "  "
    lines = [
        f"python -m benchmarks ({cfg['mode']}, median of {cfg['repeat']} "
        f"[min{DASH}max], ratio to the best peer): {m['nproc']} CPUs {m['cpu_model']}, "
        f"Python {m['python']}, msgq_trio {m['msgq_trio_version']}"
        f"{' at ' + m['msgq_trio_commit'] if m.get('msgq_trio_commit') else ''}{_build(m)}",
    ]
    load0, load1 = m.get("loadavg_start"), report.get("loadavg_end")
    if load0 or load1:
        lines += [
            *gap,
            f"`{report.get('command', 'python -m benchmarks')}`: {m.get('date', '?')}, "
            f"wall time {report['wall_seconds']:.0f} s; load average (1, 5, 15 min) "
            f"at start {load0}, at end {load1}",
        ]
    if cfg["mode"] == "quick":
        lines += [
            *gap,
            "quick mode: counts are tiny, so these figures only show that "
            "everything runs; do not quote them",
        ]
    if systems:
        lines += ["", table(results, systems, workloads, markdown=markdown)]
    aio = asyncio_systems(systems)
    if aio:
        lines += [
            "",
            "asyncio clients side by side (msgq_trio.aio, nats-py, redis.asyncio; ratio to "
            "the best other asyncio peer):",
            *gap,
            table(results, aio, workloads, markdown=markdown, asyncio=True),
        ]
    if systems and "req-reply" in workloads:
        lines += [
            "",
            "request/reply round trip (median of repetitions):",
            *gap,
            latency_table(results, systems, markdown=markdown),
        ]
    if systems:
        lines += [
            "",
            "CPU µs per message / delivery / call, broker + all clients (large: per message):",
            *gap,
            cpu_table(results, systems, workloads, markdown=markdown),
        ]
    notes = [
        f"{item}{s} {w}: {results[s][w]['note']}"
        for s in systems
        for w in workloads
        if results[s][w].get("note")
    ]
    for section in ("msgq_only", "durable"):
        notes += [
            f"{item}{section} {k}: {v['note']}"
            for k, v in report.get(section, {}).items()
            if v.get("note")
        ]
    if notes:
        lines += ["", "(*) some repetitions failed or were skipped:", *gap, *notes]
    if report.get("msgq_only"):
        lines += [
            "",
            "msgq_trio only (median [min" + DASH + "max] of repetitions):",
            *gap,
            msgq_only_table(report, markdown=markdown),
        ]
    if report.get("durable"):
        p = report["durable_params"]
        lines += [
            "",
            f"durable acked publish, {p['n']:,} x {p['size']} B; peers: window of "
            f"{p['window']:,} unacknowledged; msgq_trio: {_msgq_durable_window()} "
            f"(median [min{DASH}max]; ratio to the best peer):",
            *gap,
            durable_table(report, markdown=markdown),
        ]
    b = report.get("backlog")
    if b and b.get("status") == "ok":
        lines += [
            "",
            f"backlog: {b['messages']:,} x {b['size']} B = {b['backlog_gib']:.2f} "
            f"GiB queued with no consumer (store file {b['store_gib']:.2f} GiB), ack 1 "
            "after fsync, then drained by one push consumer (window 1,000):",
            *gap,
            *(
                f"{item}{line}"
                for line in (
                    f"fill: {b['fill_msgs_per_s']:,.0f} msgs/s; the queue plugin's peak "
                    f"RSS {b['fill_peak_rss_mib']:.0f} MiB",
                    f"restart (SIGKILL of the broker, start on the same store, to "
                    f"listening): {b['restart_with_backlog_s']:.2f} s "
                    f"(empty store: {b['start_empty_s']:.2f} s), once the killed "
                    f"broker's plugin had exited ({b['old_plugin_exit_s']:.2f} s)",
                    f"drain: {b['drain_msgs_per_s']:,.0f} msgs/s, every message once and "
                    f"in order; plugin RSS at most {b['drain_rss_mib']:.0f} MiB "
                    f"({b['drain_rss_anon_mib']:.0f} MiB anonymous)",
                )
            ),
        ]
    elif b:
        lines += ["", f"backlog: {b.get('status')}: {b.get('detail')}"]
    if any(s in report["results"] for s in ("nats", "redis")):
        lines += [
            "",
            "the goal, ahead of NATS and Redis in every column (ratio > 1: "
            "msgq_trio ahead; for latency, their p50 / msgq_trio's):",
            *gap,
            goal_table(report, markdown=markdown),
        ]
    lines += ["", "workloads:", *gap] + [f"{item}{w}: {d}" for w, d in cfg["descriptions"].items()]
    lines += [*gap, f"total wall time {report['wall_seconds']:.0f} s"]
    return "\n".join(lines)


def _msgq_durable_window() -> str:
    """How the queue plugin's harness keeps messages in flight (its own constants)."""
    try:
        from .durable_msgq import BATCH, WINDOW
    except ImportError:
        return "the queue plugin's harness"
    return f"put_many batches of {BATCH}, {WINDOW} batches in flight, ack after fsync"


def _exit_status(report: dict[str, Any]) -> int:
    for name, per in report["results"].items():
        if SYSTEMS[name].kind == PEER:
            continue
        for s in per.values():
            # n/a: a workload the system does not run by design (``System.only``)
            if any(r.get("status") not in ("ok", "skipped", "n/a") for r in s["runs"]):
                return 1
    if (report.get("backlog") or {}).get("status") == "failed":
        return 1
    mine = [
        *report.get("msgq_only", {}).values(),
        *(s for name, s in report.get("durable", {}).items() if name.startswith("msgq_trio")),
    ]
    for s in mine:
        if any(r.get("status") not in ("ok", "skipped", "n/a") for r in s["runs"]):
            return 1
    return 0


def _output(report: dict[str, Any], markdown: str | None) -> None:
    """Print the report: as text, or as Markdown with ``--markdown``; with ``--markdown
    FILE``, print the text and write the Markdown tables to FILE (to paste into
    BENCHMARKS.md)."""
    if markdown in (None, "-"):
        print(render(report, markdown=markdown == "-"))
        return
    print(render(report))
    path = Path(markdown)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(report, markdown=True) + "\n")
    print(f"Markdown tables written to {path}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks [options]``, run from a checkout."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["--"]:
        args_in = args_in[1:]
    if args_in[:1] == ["--scale"]:
        # The scale workloads (thousands of clients) have options of their own.
        from . import scale

        return scale.main(args_in[1:])
    parser = build_parser()
    args = parser.parse_args(args_in)
    if args.render:
        try:
            report = json.loads(args.render.read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"--render: cannot read {args.render}: {exc}")
        _output(report, args.markdown)
        if args.plot:
            for path in plot(report, args.plot):
                print(f"plot written: {path}")
        return _exit_status(report)
    systems = args.systems or DEFAULT_SYSTEMS + (
        PEER_SYSTEMS + TCP_SYSTEMS if args.peers else []
    ) + (["rabbitmq"] if args.rabbitmq else [])
    workloads = args.workloads or list(WORKLOADS)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    if repeat < 1:
        parser.error("--repeat must be at least 1")
    timeout = args.timeout or (QUICK_TIMEOUT if args.quick else FULL_TIMEOUT)
    report = run_bench(
        systems,
        workloads,
        quick=args.quick,
        repeat=repeat,
        timeout=timeout,
        install=not args.no_install,
        sections=args.sections or DEFAULT_SECTIONS,
        rabbitmq=args.rabbitmq,
        budget=args.budget,
        backlog_messages=args.backlog_messages,
    )
    report = {"command": "python -m benchmarks " + " ".join(args_in), **report}
    if args.json:  # first: a failure to render must not lose the measurements
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print()
    _output(report, args.markdown)
    if args.json:
        print(f"raw figures written to {args.json}")
    if args.plot:
        for path in plot(report, args.plot):
            print(f"plot written: {path}")
    return _exit_status(report)


def smoke(
    systems: Sequence[str] = (
        "msgq_trio",
        "msgq_trio-def-handler",
        "msgq_trio-direct",
        "msgq_trio-direct-no-busy-poll",
        "raw-unix",
    ),
    workloads: Sequence[str] | None = None,
    sections: Sequence[str] = DEFAULT_SECTIONS,
    msgq_durable_rows: Sequence[str] = ("msgq_trio", "msgq_trio +consumer"),
) -> dict[str, Any]:
    """Run the quick mode once and return the report, for the test suite.

    ``report["results"][system][workload]`` has ``status`` ("ok" when measured) and
    ``median`` (the figure, in ``WORKLOADS[workload].unit``); ``report["msgq_only"][key]``
    and ``report["durable"][row]`` the same for those sections. Installs nothing, starts
    no peer that is not in ``systems``, prints nothing. The 16-producer durable row is
    left out by default: it only adds processes to the same harness path.
    """
    return run_bench(
        list(systems),
        list(workloads or WORKLOADS),
        quick=True,
        repeat=1,
        timeout=QUICK_TIMEOUT,
        install=False,
        say=lambda _line: None,
        sections=sections,
        msgq_durable_rows=msgq_durable_rows,
    )


if __name__ == "__main__":
    sys.exit(main())
