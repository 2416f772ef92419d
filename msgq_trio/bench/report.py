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

from .. import __version__
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
        failed = [r for r in runs if r.get("status") != "ok"]
        if failed:
            summary["note"] = f"{len(failed)} of {len(runs)} runs failed: {failed[0]['detail']}"
    else:
        last = runs[-1] if runs else {"status": "n/a", "detail": "not run"}
        summary.update(status=last.get("status", "error"), median=None,
                       reason=last.get("detail", ""))
    return summary


def _median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get("status") == "ok" and key in r]
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


def reference(results: Results, system: str, wkey: str) -> tuple[str, float] | None:
    """The best peer in this column other than ``system`` (or the best ceiling if no peer
    has a figure): the figure a cell's ratio is against."""
    w = WORKLOADS[wkey]
    for kinds in ((PEER,), ("ceiling",)):
        cands = [(name, s[wkey]["median"]) for name, s in results.items()
                 if name != system and SYSTEMS[name].kind in kinds
                 and s.get(wkey, {}).get("status") == "ok"]
        if cands:
            pick = max if w.higher_is_better else min
            return pick(cands, key=lambda c: c[1])
    return None


def cell(results: Results, system: str, wkey: str, *, ranges: bool = True,
         width: int = 40) -> str:
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
    ref = reference(results, system, wkey)
    if ref is not None and ref[1] > 0:
        text += f" ({fmt_ratio(s['median'] / ref[1])}{TIMES} {ref[0]})"
    if s.get("note"):
        text += " *"
    return text


def table(results: Results, systems: list[str], workloads: list[str], *,
          markdown: bool = False) -> str:
    """One row per system, one column per workload."""
    head = ["system"] + [
        f"{WORKLOADS[k].title} ({WORKLOADS[k].unit}"
        + (")" if WORKLOADS[k].higher_is_better else ", lower is better)") for k in workloads]
    rows = [[name] + [cell(results, name, k, width=60 if markdown else 40) for k in workloads]
            for name in systems]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{wd}}}" for wd in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * wd for wd in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(lines)


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


def cpu_table(results: Results, systems: list[str], workloads: list[str], *,
              markdown: bool = False) -> str:
    """CPU µs per message / delivery / call: broker + all clients (medians of repetitions).

    On 2 cores, a throughput figure is bounded by this total: it is where the time goes.
    """
    head = ["system", *workloads]
    rows = []
    for name in systems:
        row = [name]
        for k in workloads:
            runs = [r["cpu_us_per_unit"] for r in results[name].get(k, {}).get("runs", [])
                    if r.get("status") == "ok" and "cpu_us_per_unit" in r]
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


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, RAM, kernel, Python, msgq_trio version and source, date."""
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu_model": "unknown",
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "kernel": platform.release(),
        "msgq_trio_version": __version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
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
            head = subprocess.run([*git, "rev-parse", "--short", "HEAD"],
                                  capture_output=True, text=True, timeout=10, check=False)
            dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10, check=False)
            if head.returncode == 0:
                info["msgq_trio_commit"] = head.stdout.strip() + (
                    " (with uncommitted changes)" if dirty.stdout.strip() else "")
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def plot(results: Results, systems: list[str], workloads: list[str], out_dir: Path) -> list[Path]:
    """Bar charts of the throughput workloads (median, min-max whiskers) and the
    round-trip latency distribution. Returns the files written; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install matplotlib); no plots written")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    colors = {"subject": "tab:red", "ceiling": "tab:gray", "peer": "tab:blue"}
    for key in workloads:
        w = WORKLOADS[key]
        names = [n for n in systems if results[n].get(key, {}).get("status") == "ok"]
        if not names:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        med = [results[n][key]["median"] for n in names]
        lo = [m - results[n][key]["min"] for n, m in zip(names, med, strict=True)]
        hi = [results[n][key]["max"] - m for n, m in zip(names, med, strict=True)]
        ax.bar(names, med, yerr=[lo, hi], capsize=4,
               color=[colors[SYSTEMS[n].kind] for n in names])
        ax.set_ylabel(w.unit)
        better = "higher" if w.higher_is_better else "lower"
        ax.set_title(f"{w.title} ({w.unit}, {better} is better; median, min{DASH}max)")
        if max(med) / max(min(med), 1e-9) > 50:
            ax.set_yscale("log")
        fig.tight_layout()
        path = out_dir / f"{key}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    if "req-reply" in workloads:
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = False
        for n in systems:
            s = results[n].get("req-reply", {})
            runs = [r for r in s.get("runs", []) if r.get("status") == "ok"]
            if not runs:
                continue
            run = sorted(runs, key=lambda r: r["value"])[len(runs) // 2]  # the median run
            pct = run["percentiles_us"]
            qs = list(range(101))
            ax.plot([pct[f"p{q}"] for q in qs], qs, label=n, color=None)
            drawn = True
        if drawn:
            ax.set_xscale("log")
            ax.set_xlabel("round trip (µs, log scale)")
            ax.set_ylabel("percentile")
            ax.set_title("request/reply latency distribution (median run)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = out_dir / "latency.png"
            fig.savefig(path, dpi=100)
            written.append(path)
        plt.close(fig)
    return written
