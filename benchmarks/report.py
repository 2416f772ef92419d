"""Turning runs into figures: medians and ranges, the text table, machine info, plots."""

from __future__ import annotations

import datetime
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from msgq_trio import __version__
from msgq_trio.protocol.framing import SPEEDUPS

from .systems import PEER, SYSTEMS
from .workloads import WORKLOADS, Workload

Results = dict[str, dict[str, dict[str, Any]]]  # system -> workload -> summary
TIMES, DASH = "\u00d7", "\u2013"  # multiplication sign, en dash (ratios and ranges)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min and max of the ok runs; a status and reason when none is ok."""
    ok = [r["value"] for r in runs if r.get("status") == "ok"]
    summary: dict[str, Any] = {"runs": runs, "ok": len(ok)}
    if ok:
        summary.update(status="ok", median=statistics.median(ok), min=min(ok), max=max(ok))
        failed = [r for r in runs if r.get("status") not in ("ok", "skipped")]
        skipped = [r for r in runs if r.get("status") == "skipped"]
        if failed:
            summary["note"] = f"{len(failed)} of {len(runs)} runs failed: {failed[0]['detail']}"
        elif skipped:
            summary["note"] = (
                f"{len(skipped)} of {len(runs)} repetitions skipped: {skipped[0]['detail']}"
            )
    else:
        last = runs[-1] if runs else {"status": "n/a", "detail": "not run"}
        summary.update(
            status=last.get("status", "error"), median=None, reason=last.get("detail", "")
        )
    return summary


def _median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get("status") == "ok" and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def fmt_value(v: float, workload: Workload) -> str:
    """231k, 1.14M, 912, 181."""
    if workload.unit in ("µs", "MB/s"):
        return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e4:
        return f"{v / 1e3:.0f}k"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}"


def fmt_ratio(r: float) -> str:
    """1.3, 0.26, 0.026, 14, 1600."""
    if r >= 10:
        return f"{r:,.0f}"
    if r >= 1:
        return f"{r:.1f}"
    return f"{r:.2g}"


def reference(
    results: Results, system: str, wkey: str, *, asyncio: bool = False
) -> tuple[str, float] | None:
    """The best peer in this column other than ``system`` (or the best ceiling if no peer
    has a figure): the figure a cell's ratio is against. ``asyncio``: the best asyncio
    peer only (no ceiling)."""
    w = WORKLOADS[wkey]
    for kinds in ((PEER,), () if asyncio else ("ceiling",)):
        cands = [
            (name, s[wkey]["median"])
            for name, s in results.items()
            if name != system
            and SYSTEMS[name].kind in kinds
            and (SYSTEMS[name].asyncio or not asyncio)
            and s.get(wkey, {}).get("status") == "ok"
        ]
        if cands:
            pick = max if w.higher_is_better else min
            return pick(cands, key=lambda c: c[1])
    return None


def cell(
    results: Results,
    system: str,
    wkey: str,
    *,
    ranges: bool = True,
    width: int = 40,
    asyncio: bool = False,
) -> str:
    w = WORKLOADS[wkey]
    s = results[system].get(wkey)
    if s is None:
        return "-"
    if s["status"] != "ok":
        text = f"{s['status']} ({s.get('reason', '')})" if s.get("reason") else s["status"]
        return text if len(text) <= width else text[: width - 1] + "…"
    text = fmt_value(s["median"], w)
    if ranges and s["min"] != s["max"]:
        text += f" [{fmt_value(s['min'], w)}{DASH}{fmt_value(s['max'], w)}]"
    ref = reference(results, system, wkey, asyncio=asyncio)
    if ref is not None and ref[1] > 0:
        text += f" ({fmt_ratio(s['median'] / ref[1])}{TIMES} {ref[0]})"
    if s.get("note"):
        text += " *"
    return text


def table(
    results: Results,
    systems: list[str],
    workloads: list[str],
    *,
    markdown: bool = False,
    asyncio: bool = False,
) -> str:
    """One row per system, one column per workload. ``asyncio``: ratios against the best
    asyncio peer (:func:`asyncio_systems` gives the rows of that table)."""
    head = ["system"] + [
        f"{WORKLOADS[k].title} ({WORKLOADS[k].unit}"
        + (")" if WORKLOADS[k].higher_is_better else ", lower is better)")
        for k in workloads
    ]
    width = 60 if markdown else 40
    rows = [
        [name] + [cell(results, name, k, width=width, asyncio=asyncio) for k in workloads]
        for name in systems
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{wd}}}" for wd in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * wd for wd in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(lines)


def asyncio_systems(systems: list[str]) -> list[str]:
    """The asyncio clients of a run (msgq_trio.aio, nats-py, redis.asyncio, aiormq), for
    the table that sets them side by side; none unless an asyncio peer ran beside one
    of msgq_trio's (a table without a peer compares nothing)."""
    mine = [s for s in systems if SYSTEMS[s].asyncio]
    kinds = {SYSTEMS[s].kind for s in mine}
    return mine if PEER in kinds and len(kinds) > 1 else []


def latency_table(results: Results, systems: list[str], *, markdown: bool = False) -> str:
    """Round-trip latency detail: medians over repetitions of p50, p99, max and mean."""
    head = ["system", "p50 µs", "p99 µs", "max µs", "mean µs"]
    rows = []
    for name in systems:
        s = results[name].get("req-reply")
        if s is None:
            continue
        runs = s["runs"]
        vals = [_median_of(runs, k) for k in ("p50_us", "p99_us", "max_us", "mean_us")]
        rows.append([name] + [f"{v:,.0f}" if v is not None else s["status"] for v in vals])
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:>{wd}}}" if i else f"{{:<{wd}}}" for i, wd in enumerate(widths))
    return "\n".join([fmt.format(*head)] + [fmt.format(*r) for r in rows])


def _fmt_us(v: float) -> str:
    return f"{v:.1f}" if v < 10 else f"{v:,.0f}"


def cpu_table(
    results: Results, systems: list[str], workloads: list[str], *, markdown: bool = False
) -> str:
    """CPU µs per message / delivery / call: broker + all clients (medians of repetitions).

    On 2 cores, a throughput figure is bounded by this total: it is where the time goes.
    """
    head = ["system", *workloads]
    rows = []
    for name in systems:
        row = [name]
        for k in workloads:
            runs = [
                r["cpu_us_per_unit"]
                for r in results[name].get(k, {}).get("runs", [])
                if r.get("status") == "ok" and "cpu_us_per_unit" in r
            ]
            if not runs:
                row.append("-")
                continue
            brokers = [r["broker"] for r in runs if r["broker"] is not None]
            clients = statistics.median(r["clients"] for r in runs)
            broker = _fmt_us(statistics.median(brokers)) if brokers else "-"
            row.append(f"{broker} + {_fmt_us(clients)}")
        rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{wd}}}" for wd in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*r) for r in rows])


def _md_or_text(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{wd}}}" for wd in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*r) for r in rows])


def _num(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    if digits == 0 and abs(v) >= 1e4:
        return f"{v / 1e3:,.0f}k" if abs(v) < 1e6 else f"{v / 1e6:.2f}M"
    return f"{v:,.{digits}f}"


def _range(s: dict[str, Any], digits: int = 0) -> str:
    """``median [min-max]``, or the status and reason when nothing was measured."""
    if s.get("status") != "ok":
        reason = s.get("reason", "")
        return f"{s.get('status', 'n/a')} ({reason})" if reason else str(s.get("status"))
    text = _num(s["median"], digits)
    if s["min"] != s["max"]:
        text += f" [{_num(s['min'], digits)}{DASH}{_num(s['max'], digits)}]"
    return text + (" *" if s.get("note") else "")


def msgq_only_table(report: dict[str, Any], *, markdown: bool = False) -> str:
    """SIGKILL to recipient-gone, capture on/off, broker RSS per idle client."""
    only = report["msgq_only"]
    rows: list[list[str]] = []
    if "kill" in only:
        s = only["kill"]
        n = report.get("msgq_only_params", {}).get("kills", "?")
        rows.append(
            [
                f"callee SIGKILL -> caller's recipient-gone, p50 µs ({n} kills a run)",
                _range(s),
                f"p99 {_num(_median_of(s['runs'], 'p99_us'))} µs, max "
                f"{_num(_median_of(s['runs'], 'max_us'))} µs; SIGKILL -> EOF on a "
                f"socket the callee held: p50 "
                f"{_num(_median_of(s['runs'], 'kernel_eof_p50_us'))} µs (medians of runs)",
            ]
        )
    if "capture" in only:
        s = only["capture"]
        on, off = _median_of(s["runs"], "on"), _median_of(s["runs"], "off")
        rec = _median_of(s["runs"], "records_written")
        drop = _median_of(s["runs"], "records_dropped")
        cn = report.get("msgq_only_params", {}).get("capture_n")
        what = f"{cn:,} x 100 B" if cn else "one-way"
        rows.append(
            [
                f"one-way ({what}) with capture on / off (ratio of msgs/s)",
                _range(s, 2),
                f"on {_num(on)} msgs/s, off {_num(off)} msgs/s; "
                f"{_num(rec)} records written, {_num(drop)} dropped",
            ]
        )
    for key in sorted(
        (k for k in only if k.startswith("idle-")), key=lambda k: int(k.split("-")[1])
    ):
        s = only[key]
        clients = int(key.split("-")[1])
        before = _median_of(s["runs"], "broker_rss_before_kib")
        after = _median_of(s["runs"], "broker_rss_after_kib")
        cl = _median_of(s["runs"], "client_rss_per_connection_kib")
        conn = _median_of(s["runs"], "connect_seconds")
        rows.append(
            [
                f"broker RSS per idle client, {clients:,} clients (KiB)",
                _range(s, 1),
                f"broker {_num(before and before / 1024, 1)} -> "
                f"{_num(after and after / 1024, 1)} MiB; "
                f"{_num(conn, 1)} s to connect them; client side "
                f"{_num(cl, 1)} KiB per connection",
            ]
        )
    return _md_or_text(["figure", "median [min" + DASH + "max]", "detail"], rows, markdown)


def _fmt_any(v: float, workload: Workload | None) -> str:
    return fmt_value(v, workload) if workload is not None else _num(v)


#: The goal table's msgq_trio figure: the better of these (system, label in the cell).
GOAL_DEFAULT = (("msgq_trio", ""), ("msgq_trio-direct", " (direct client)"))
#: Its extra rows: the broker with ``limits.busy_poll`` 0 (off; it is on by default).
GOAL_NO_BUSY_POLL = (
    ("msgq_trio-no-busy-poll", ""),
    ("msgq_trio-direct-no-busy-poll", " (direct client)"),
)
NO_BUSY_POLL_ROW = ", busy polling off"


def goal_table(report: dict[str, Any], *, markdown: bool = False) -> str:
    """The goal, column by column: msgq_trio's median against NATS's and Redis's,
    as a ratio where above 1 means msgq_trio is ahead (for latency: theirs / ours), and
    whether it is ahead of both. msgq_trio's figure is the better of the trio client
    (``msgq_trio``) and the direct client (``msgq_trio-direct``), named when direct: the
    default configuration. Where the no-busy-poll variants ran, a second row (title ending
    ", busy polling off") gives theirs, for a broker told to spend no CPU on polling."""
    results: Results = report["results"]
    rows: list[list[str]] = []

    def med(summary: dict[str, Any] | None) -> float | None:
        return summary["median"] if summary and summary.get("status") == "ok" else None

    columns: list[tuple[str, str, bool, float | None, float | None, float | None, str]] = []
    for key in report["config"]["workloads"]:
        w = WORKLOADS[key]
        nats, redis = (med(results.get(n, {}).get(key)) for n in ("nats", "redis"))
        # msgq_trio's figure is the better of its two clients; the cell says which. The
        # broker with busy polling off (on by default) gets a row of its own.
        for suffix, variants in (("", GOAL_DEFAULT), (NO_BUSY_POLL_ROW, GOAL_NO_BUSY_POLL)):
            mine, client = None, ""
            for system, label in variants:
                v = med(results.get(system, {}).get(key))
                if v is not None and (
                    mine is None or (v > mine if w.higher_is_better else v < mine)
                ):
                    mine, client = v, label
            columns.append(
                (
                    f"{w.title} ({w.unit}){suffix}",
                    key,
                    w.higher_is_better,
                    mine,
                    nats,
                    redis,
                    client,
                )
            )
    if report.get("durable"):
        d = report["durable"]
        columns.append(
            (
                "durable acked publish (msgs/s)",
                "durable",
                True,
                med(d.get("msgq_trio")),
                med(d.get("nats")),
                med(d.get("redis")),
                "",
            )
        )
    for title, key, higher, mine, nats, redis, client in columns:
        if mine is None:
            continue
        workload = WORKLOADS.get(key)
        ahead = []
        cells = []
        for theirs in (nats, redis):
            if theirs is None:
                cells.append("-")
                continue
            ratio = mine / theirs if higher else theirs / mine
            ahead.append(ratio > 1)
            cells.append(f"{_fmt_any(theirs, workload)} ({fmt_ratio(ratio)}{TIMES})")
        verdict = "yes" if ahead and all(ahead) else "no" if ahead else "-"
        rows.append([title, _fmt_any(mine, workload) + client, *cells, verdict])
    return _md_or_text(
        [
            "column",
            "msgq_trio",
            "NATS (msgq_trio ahead by)",
            "Redis (msgq_trio ahead by)",
            "ahead of both",
        ],
        rows,
        markdown,
    )


def durable_table(report: dict[str, Any], *, markdown: bool = False) -> str:
    """Durable acked publish: msgs/s with ratio to the best peer, ack latency, and the
    queue plugin's own statistics for the msgq_trio rows."""
    rows_in: dict[str, dict[str, Any]] = report["durable"]
    peers = {
        n: s["median"]
        for n, s in rows_in.items()
        if not n.startswith("msgq_trio") and s.get("status") == "ok"
    }
    rows = []
    for name, s in rows_in.items():
        cell = _range(s)
        others = {n: v for n, v in peers.items() if n != name}
        if s.get("status") == "ok" and others:
            best = max(others, key=lambda n: others[n])
            cell += f" ({fmt_ratio(s['median'] / others[best])}{TIMES} {best})"
        skipped = _median_of(s["runs"], "writes_skipped_share")
        fsyncs = _median_of(s["runs"], "fsyncs")
        rows.append(
            [
                name,
                cell,
                _num(_median_of(s["runs"], "p50_us")),
                _num(_median_of(s["runs"], "p99_us")),
                _num(_median_of(s["runs"], "producer_cpu_us"), 1),
                "-" if skipped is None else f"{skipped:.0%}",
                _num(fsyncs),
            ]
        )
    return _md_or_text(
        [
            "system",
            "msgs/s",
            "ack p50 µs",
            "ack p99 µs",
            "producer CPU µs/msg",
            "writes skipped",
            "fsyncs",
        ],
        rows,
        markdown,
    )


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, RAM, kernel, Python, msgq_trio version and source, date."""
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu_model": "unknown",
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "msgq_trio_version": __version__,
        # The clients and the broker the harness starts import the same build (their
        # environment is this one's): MSGQ_TRIO_PURE_PYTHON=1 or no compiled extension.
        "msgq_trio_speedups": SPEEDUPS,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        # Others' work on a shared machine moves every figure: the report shows this.
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["ram_gib"] = round(int(line.split()[1]) / 1024 / 1024, 1)
                    break
    except OSError:
        pass
    src = Path(__file__).resolve().parents[2]
    if (src / ".git").exists() and shutil.which("git"):
        try:
            # Read-only: --no-optional-locks keeps `status` from refreshing the index.
            git = ["git", "--no-optional-locks", "-C", str(src)]
            head = subprocess.run(
                [*git, "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            dirty = subprocess.run(
                [*git, "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            if head.returncode == 0:
                info["msgq_trio_commit"] = head.stdout.strip() + (
                    " (with uncommitted changes)" if dirty.stdout.strip() else ""
                )
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def plot(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """PNG charts: one bar chart per throughput workload (median, min-max whiskers), the
    round-trip latency distribution, the durable workload's bars and ack-latency
    distribution, and the SIGKILL-to-error distribution. Returns the files written; []
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install matplotlib); no plots written")
        return []
    results: Results = report["results"]
    systems, workloads = report["config"]["systems"], report["config"]["workloads"]
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    colors = {"subject": "tab:red", "ceiling": "tab:gray", "peer": "tab:blue"}

    def bars(
        name: str, summaries: dict[str, dict[str, Any]], unit: str, title: str, color_of: Any
    ) -> None:
        names = [n for n, s in summaries.items() if s.get("status") == "ok"]
        if not names:
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        med = [summaries[n]["median"] for n in names]
        lo = [m - summaries[n]["min"] for n, m in zip(names, med, strict=True)]
        hi = [summaries[n]["max"] - m for n, m in zip(names, med, strict=True)]
        ax.bar(names, med, yerr=[lo, hi], capsize=4, color=[color_of(n) for n in names])
        ax.set_ylabel(unit)
        ax.set_title(title)
        if max(med) / max(min(med), 1e-9) > 10:  # else the peers are slivers
            ax.set_yscale("log")
        ax.tick_params(axis="x", labelsize=8)
        if len(names) > 7:  # long system names overlap side by side
            ax.tick_params(axis="x", labelrotation=30)
            for label in ax.get_xticklabels():
                label.set_horizontalalignment("right")
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    def distribution(name: str, curves: dict[str, dict[str, Any]], xlabel: str, title: str) -> None:
        """Percentile curves (x: latency, log scale) of each system's median run."""
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = False
        for label, s in curves.items():
            runs = [
                r for r in s.get("runs", []) if r.get("status") == "ok" and r.get("percentiles_us")
            ]
            if not runs:
                continue
            run = sorted(runs, key=lambda r: r["value"])[len(runs) // 2]  # the median run
            pct = run["percentiles_us"]
            qs = list(range(101))
            ax.plot([max(pct[f"p{q}"], 0.1) for q in qs], qs, label=label)
            drawn = True
        if drawn:
            ax.set_xscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("percentile")
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = out_dir / f"{name}.png"
            fig.savefig(path, dpi=100)
            written.append(path)
        plt.close(fig)

    for key in workloads:
        w = WORKLOADS[key]
        better = "higher" if w.higher_is_better else "lower"
        bars(
            key,
            {n: results[n].get(key, {}) for n in systems},
            w.unit,
            f"{w.title} ({w.unit}, {better} is better; median, min{DASH}max)",
            lambda n: colors[SYSTEMS[n].kind],
        )
    if "req-reply" in workloads:
        distribution(
            "latency",
            {n: results[n].get("req-reply", {}) for n in systems},
            "round trip (µs, log scale)",
            "request/reply latency distribution (median run)",
        )
    if report.get("durable"):
        p = report.get("durable_params", {})
        bars(
            "durable",
            report["durable"],
            "msgs/s",
            f"durable acked publish, {p.get('n', 0):,} x {p.get('size', 0)} B "
            f"(msgs/s; median, min{DASH}max)",
            lambda n: colors["subject" if n.startswith("msgq_trio") else "peer"],
        )
        distribution(
            "durable-latency",
            report["durable"],
            "publish to ack (µs, log scale)",
            "durable publish ack latency distribution (median run)",
        )
    if report.get("msgq_only", {}).get("kill"):
        distribution(
            "kill-to-error",
            {"msgq_trio": report["msgq_only"]["kill"]},
            "callee SIGKILL to caller's recipient-gone (µs, log scale)",
            "time to learn that a callee died (median run)",
        )
    return written
