"""``msgq-trio analyze capture|scenarios``: run an analysis, write the report.

Output directory layout: ``report.html`` (self-contained), ``summary.json`` (the figures
of the report), ``tables/<name>/`` (Parquet, or CSV with ``--format csv``), written by
Spark so they scale with the data. The terminal gets a summary table on stdout and
progress lines on stderr while Spark works. Exit status: 0, 2 for usage errors or
missing input, 3 when pyspark or Java is missing.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from . import SparkUnavailable

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="msgq-trio analyze",
        description="Analyse traffic captures and scenario results on Spark "
        "(docs/ANALYTICS.md).")
    sub = p.add_subparsers(dest="what", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", required=True, type=Path, help="output directory")
    common.add_argument("--master", default=None,
                        help="Spark master URL (default $MSGQ_TRIO_SPARK_MASTER or local[*]; "
                        "under spark-submit: its --master)")
    common.add_argument("--format", choices=["parquet", "csv"], default="parquet",
                        help="table format (default parquet)")
    common.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    c = sub.add_parser("capture", parents=[common], help="traffic capture files (*.jsonl)")
    c.add_argument("paths", nargs="+", help="capture files, directories or globs")
    c.add_argument("--top", type=int, default=20, help="rows of the top-N lists (default 20)")
    s = sub.add_parser("scenarios", parents=[common], help="scenario result records (*.jsonl)")
    s.add_argument("paths", nargs="+", help="result files, directories or globs")
    s.add_argument("--baseline", nargs="+", default=None,
                   help="result files to compare against (regressions)")
    s.add_argument("--rss-ratio", type=float, default=0.2,
                   help="RSS regression threshold, relative (default 0.2)")
    s.add_argument("--latency-ratio", type=float, default=0.5,
                   help="p99 latency regression threshold, relative (default 0.5)")
    return p


class Progress:
    """Prints what Spark is doing to ``stream`` every ``interval`` seconds while active:
    the step (the job description), and tasks done / total of the active stages. Polls
    the status tracker from a daemon thread; ``stop()`` ends it."""

    def __init__(self, spark: SparkSession, stream: TextIO | None = None,
                 interval: float = 1.0) -> None:
        self._sc = spark.sparkContext
        self._stream = stream or sys.stderr
        self._step = "spark"
        self._interval = interval
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._last = ""
        self._thread = threading.Thread(target=self._run, name="spark-progress", daemon=True)

    def start(self) -> Progress:
        self._thread.start()
        return self

    def step(self, text: str) -> None:
        """Announce a step of the driver (also used as the job description)."""
        self._sc.setJobDescription(text)
        self._step = text  # the job description is thread-local: the poller reads this
        self._print(text)

    def _print(self, text: str) -> None:
        self._stream.write(f"[{time.monotonic() - self._t0:6.1f}s] {text}\n")
        self._stream.flush()

    def _run(self) -> None:
        tracker = self._sc.statusTracker()
        while not self._stop.wait(self._interval):
            try:
                stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
                jobs = [tracker.getJobInfo(j) for j in tracker.getActiveJobsIds()]
            except Exception:  # the context is stopping: nothing more to show
                return
            done = sum(s.numCompletedTasks for s in stages if s)
            total = sum(s.numTasks for s in stages if s)
            if not total:
                continue
            line = (f"{self._step}: {len(jobs)} job(s), stage(s) "
                    f"{','.join(str(s.stageId) for s in stages if s)}: "
                    f"{done}/{total} tasks")
            if line != self._last:
                self._last = line
                self._print(line)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def write_tables(tables: dict[str, DataFrame], out: Path, fmt: str,
                 progress: Progress | None) -> None:
    """Write each Spark table to ``out/tables/<name>/`` (a directory of part files,
    overwritten) with Spark, so they scale with the data."""
    for name, df in tables.items():
        if progress:
            progress.step(f"writing table {name}")
        w = df.write.mode("overwrite")
        path = str(out / "tables" / name)
        if fmt == "csv":
            w.option("header", True).csv(path)
        else:
            w.parquet(path)


def write_small_tables(tables: dict[str, list[dict[str, Any]]], out: Path, fmt: str) -> None:
    """Write collected aggregates to ``out/tables/<name>.parquet`` (pyarrow) or ``.csv``:
    no Spark job for a table already in the driver."""
    (out / "tables").mkdir(parents=True, exist_ok=True)
    for name, rows in tables.items():
        path = out / "tables" / f"{name}.{fmt}"
        if fmt == "csv":
            import csv

            cols = list(rows[0]) if rows else []
            with open(path, "w", newline="") as f:
                wr = csv.DictWriter(f, fieldnames=cols)
                wr.writeheader()
                wr.writerows(rows)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), path)


def _json_default(v: Any) -> Any:
    if isinstance(v, _dt.datetime | _dt.date):
        return v.isoformat()
    return str(v)


def run_capture(spark: SparkSession, paths: Sequence[str], out: Path, *, fmt: str = "parquet",
                top: int = 20, progress: Progress | None = None) -> dict[str, Any]:
    """Analyse the captures ``paths`` into ``out``; returns the figures (summary.json)."""
    from .capture import analyze_capture, expand_paths, read_capture
    from .report import capture_html

    files = expand_paths(paths)
    if progress:
        progress.step(f"reading {len(files)} capture file(s)")
    tables, fig = analyze_capture(read_capture(spark, files), top=top,
                                  step=progress.step if progress else None)
    out.mkdir(parents=True, exist_ok=True)
    write_small_tables(fig.pop("tables_small"), out, fmt)
    write_tables(tables, out, fmt, progress)
    fig["sources"] = files
    (out / "summary.json").write_text(json.dumps(fig, indent=1, default=_json_default))
    (out / "report.html").write_text(capture_html(fig, files, str(out / "tables")))
    return fig


def run_scenarios(spark: SparkSession, paths: Sequence[str], out: Path, *,
                  baseline: Sequence[str] | None = None, fmt: str = "parquet",
                  rss_ratio: float = 0.2, latency_ratio: float = 0.5,
                  progress: Progress | None = None) -> dict[str, Any]:
    """Analyse the scenario results ``paths`` (against ``baseline``) into ``out``."""
    from .capture import expand_paths
    from .report import scenarios_html
    from .scenarios import analyze_scenarios, read_results

    files = expand_paths(paths)
    base_files = expand_paths(baseline) if baseline else None
    if progress:
        progress.step(f"reading {len(files)} result file(s)"
                      + (f" and {len(base_files)} baseline file(s)" if base_files else ""))
    cur = read_results(spark, files, "current")
    base = read_results(spark, base_files, "baseline") if base_files else None
    tables, fig = analyze_scenarios(cur, base, rss_ratio=rss_ratio,
                                    latency_ratio=latency_ratio,
                                    step=progress.step if progress else None)
    out.mkdir(parents=True, exist_ok=True)
    write_small_tables(tables, out, fmt)
    fig["sources"] = files
    fig["baseline_sources"] = base_files or []
    (out / "summary.json").write_text(json.dumps(fig, indent=1, default=_json_default))
    (out / "report.html").write_text(scenarios_html(fig, files, str(out / "tables")))
    return fig


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``msgq-trio analyze``; returns the exit status."""
    args = build_parser().parse_args(argv)
    from .capture import expand_paths

    try:
        expand_paths(args.paths)
        if getattr(args, "baseline", None):
            expand_paths(args.baseline)
    except FileNotFoundError as exc:
        print(f"msgq-trio analyze: {exc}", file=sys.stderr)
        return 2
    from .session import spark_session

    t0 = time.monotonic()
    try:
        if not args.quiet:
            print("[   0.0s] starting Spark", file=sys.stderr, flush=True)
        spark = spark_session(args.master)
    except SparkUnavailable as exc:
        print(f"msgq-trio analyze: {exc}", file=sys.stderr)
        return 3
    progress = None if args.quiet else Progress(spark).start()
    try:
        if args.what == "capture":
            from .report import capture_text

            fig = run_capture(spark, args.paths, args.out, fmt=args.format, top=args.top,
                              progress=progress)
            text = capture_text(fig)
        else:
            from .report import scenarios_text

            fig = run_scenarios(spark, args.paths, args.out, baseline=args.baseline,
                                fmt=args.format, rss_ratio=args.rss_ratio,
                                latency_ratio=args.latency_ratio, progress=progress)
            text = scenarios_text(fig)
    finally:
        if progress:
            progress.stop()
    print(text)
    print(f"\nreport: {args.out / 'report.html'}  ({time.monotonic() - t0:.1f} s)")
    return 0
