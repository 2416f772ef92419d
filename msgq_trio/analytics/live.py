"""``msgq-trio analyze live DIR --out OUT``: a Spark Structured Streaming query over a
capture directory the broker is writing, keeping a per-minute dashboard current.

The stream is :mod:`msgq_trio.analytics.livesource` (it tails the rotating files); each
micro-batch (``--trigger`` seconds apart) updates, per minute of record time: frames and
bytes per kind, requests and broker refusals, errors per code, slow-consumer signals
(the signals of :func:`msgq_trio.analytics.capture.slow_consumer_signals`), and the
latency percentiles of the callee replies to the requests made in that minute. After
each batch ``OUT/dashboard.html`` (refreshes itself in the browser; matplotlib charts)
and ``OUT/live.json`` (the same figures) are rewritten, each replaced in one step.

How the state is bounded:

* the driver holds the last ``--minutes`` minutes of per-minute figures (a few numbers
  per kind, code and signal) and the first ``--top`` slow-consumer clients;
* requests still waiting for an answer (``--pending-horizon`` seconds at most, keyed by
  broker instance, caller and request id: restart-safe) and the latency of each answered
  request of the retained minutes stay in the executors (local checkpoints), and a
  minute's percentiles are recomputed by Spark only when a batch adds to that minute.

Resource handling: the query and the Spark session are stopped however the command
ends. Error handling: Ctrl-C (SIGINT) or SIGTERM stops the query cleanly after the batch
in progress (exit 0); a second one ends the process at once (128 + the signal); a failed
query exits 4 with Spark's error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import SparkUnavailable
from .storage import is_local, join, local_path, to_uri, write_text

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Defaults of the command's bounds (each has its option).
MINUTES = 60  # an hour of per-minute rows: a screen's worth
PENDING_HORIZON_S = 600.0  # 10 x the default request timeout: answers come before it
TRIGGER_S = 5.0  # a micro-batch is ~10 small Spark jobs: seconds apart, not continuous
TOP = 10
#: How long Ctrl-C waits for the batch in progress before stopping the query anyway.
STOP_WAIT_S = 60.0


def add_live_parser(sub: Any, spark_opts: argparse.ArgumentParser) -> None:
    """The ``live`` subcommand's options (``sub``: the analyze subparsers)."""
    p = sub.add_parser(
        "live",
        parents=[spark_opts],
        help="a live per-minute dashboard of a capture directory being "
        "written (Structured Streaming); Ctrl-C ends it",
    )
    p.add_argument("dir", help="the capture directory the broker writes (local)")
    p.add_argument(
        "--out", required=True, help="where dashboard.html and live.json are kept (a path or a URI)"
    )
    p.add_argument(
        "--trigger",
        type=float,
        default=TRIGGER_S,
        help=f"seconds between micro-batches (default {TRIGGER_S:g})",
    )
    p.add_argument(
        "--minutes",
        type=int,
        default=MINUTES,
        help=f"minutes shown and kept in the driver (default {MINUTES})",
    )
    p.add_argument(
        "--pending-horizon",
        type=float,
        default=PENDING_HORIZON_S,
        help="seconds a request waits for its answer before the live view "
        f"forgets it (default {PENDING_HORIZON_S:g})",
    )
    p.add_argument(
        "--top", type=int, default=TOP, help=f"slow-consumer clients listed (default {TOP})"
    )
    p.add_argument(
        "--start",
        choices=["earliest", "latest"],
        default="earliest",
        help="earliest: also the records already in DIR (default); latest: "
        "only records written from now on",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no line per batch")


def _add(d: dict[str, int], key: str, n: int) -> None:
    d[key] = d.get(key, 0) + n


class LiveState:
    """The per-minute figures, updated by :meth:`process_batch` (the query's
    ``foreachBatch``; it runs in the driver, one batch at a time).

    Args:
        spark: the session of the query.
        minutes / pending_horizon / top: the bounds (module docstring).
        publish: called with the figures after every batch that had records.
    """

    def __init__(
        self,
        spark: SparkSession,
        *,
        minutes: int,
        pending_horizon: float,
        top: int,
        publish: Callable[[dict[str, Any]], None],
    ) -> None:
        self.spark = spark
        self.minutes_kept = minutes
        self.horizon = pending_horizon
        self.top = top
        self.publish = publish
        self.minutes: dict[int, dict[str, Any]] = {}
        self.clients: dict[tuple[str, str, str], int] = {}
        self.pending: DataFrame | None = None
        self.pairs: DataFrame | None = None
        self.batches = 0
        self.records = 0
        self.last_ts: float | None = None
        self.lock = threading.Lock()

    def _minute(self, m: int) -> dict[str, Any]:
        row = self.minutes.get(m)
        if row is None:
            row = self.minutes[m] = {
                "minute": m,
                "frames": {},
                "bytes": {},
                "requests": 0,
                "refused": 0,
                "errors": {},
                "slow": {},
                "latency": None,
            }
        return row

    def process_batch(self, batch: DataFrame, batch_id: int) -> None:
        """Fold one micro-batch into the figures, then publish them."""
        from pyspark.sql import functions as F

        from .capture import BROKER, REQUEST_KEY, replies_of, slow_consumer_signals

        df = (
            batch.withColumn("broker_instance", F.coalesce(F.col("broker_instance"), F.lit("")))
            .withColumn("second", F.floor(F.col("ts")).cast("long"))
            .withColumn("minute", (F.floor(F.col("ts") / 60) * 60).cast("long"))
            .persist()
        )
        try:
            counts = (
                df.groupBy(
                    "minute",
                    "kind",
                    "code",
                    F.col("outcome").isin("delivered", "broker").alias("accepted"),
                )
                .agg(
                    F.count("*").alias("n"),
                    F.sum("size").alias("bytes"),
                    F.max("ts").alias("max_ts"),
                )
                .collect()
            )
            if not counts:
                return
            with self.lock:
                for r in counts:
                    self.records += r["n"]
                    self.last_ts = max(self.last_ts or r["max_ts"], r["max_ts"])
                    if r["kind"] == "capture-dropped":
                        continue
                    row = self._minute(r["minute"])
                    _add(row["frames"], r["kind"], r["n"])
                    _add(row["bytes"], r["kind"], int(r["bytes"] or 0))
                    if r["kind"] == "command":
                        row["requests"] += r["n"]
                        if not r["accepted"]:
                            row["refused"] += r["n"]
                    elif r["kind"] == "error":
                        _add(row["errors"], r["code"] or "", r["n"])
            slow = slow_consumer_signals(df).withColumn(
                "minute", (F.floor(F.col("second") / 60) * 60).cast("long")
            )
            for r in slow.groupBy("minute", "signal").agg(F.sum("count").alias("n")).collect():
                with self.lock:
                    _add(self._minute(r["minute"])["slow"], r["signal"], r["n"])
            # the first `top` clients of this batch: a client outside every batch's top
            # is not listed (the per-minute totals above are exact)
            for r in (
                slow.groupBy("signal", "broker_instance", "client")
                .agg(F.sum("count").alias("n"))
                .orderBy(F.desc("n"))
                .limit(self.top)
                .collect()
            ):
                key = (r["signal"], r["broker_instance"], r["client"] or "")
                self.clients[key] = self.clients.get(key, 0) + r["n"]
            self._latency(df, F, BROKER, REQUEST_KEY, replies_of)
        finally:
            df.unpersist()
        with self.lock:
            self.batches += 1
            for m in sorted(self.minutes)[: -self.minutes_kept or None]:
                del self.minutes[m]
            if len(self.clients) > self.top:
                kept = sorted(self.clients.items(), key=lambda kv: (-kv[1], kv[0]))[: self.top]
                self.clients = dict(kept)
        self.publish(self.figures())

    def _latency(
        self,
        df: DataFrame,
        F: Any,
        broker: str,
        key: list[str],
        replies_of: Callable[[DataFrame], DataFrame],
    ) -> None:
        """Pair the batch's replies with the pending requests (this batch's and earlier
        ones), keep the unanswered ones within the horizon, and recompute the latency
        percentiles of the minutes that got new pairs."""
        from .capture import PERCENTILE_ACCURACY

        cmds = df.where(
            (F.col("kind") == "command") & F.col("outcome").isin("delivered", "broker")
        ).select(
            "broker_instance",
            F.col("sender").alias("caller"),
            "request_id",
            "outcome",
            F.coalesce(F.col("all"), F.lit(False)).alias("call_all"),
            F.col("ts").alias("cmd_ts"),
            "minute",
        )
        waiting = cmds if self.pending is None else self.pending.unionByName(cmds)
        replies = replies_of(df)
        pairs = (
            waiting.join(replies, key, "inner")
            .where((F.col("replier") != broker) | (F.col("outcome") == "broker"))
            .select(
                "minute",
                F.round(
                    F.greatest(F.col("reply_ts") - F.col("cmd_ts"), F.lit(0.0)) * 1000.0, 3
                ).alias("latency_ms"),
            )
        )
        horizon = (self.last_ts or 0.0) - self.horizon
        answered = replies.select(*key).distinct()
        # a call_all request waits for every recipient: it stays until the horizon
        still = waiting.join(answered, key, "left_anti").unionByName(
            waiting.where(F.col("call_all")).join(answered, key, "left_semi")
        )
        self.pending = still.where(F.col("cmd_ts") >= horizon).localCheckpoint()
        new_pairs = pairs.localCheckpoint()
        touched = [r["minute"] for r in new_pairs.select("minute").distinct().collect()]
        if not touched:
            return
        oldest = (sorted({*self.minutes, *touched})[-self.minutes_kept :] or [0])[0]
        kept = new_pairs if self.pairs is None else self.pairs.unionByName(new_pairs)
        self.pairs = kept.where(F.col("minute") >= oldest).localCheckpoint()
        rows = (
            self.pairs.where(F.col("minute").isin(touched))
            .groupBy("minute")
            .agg(
                F.count("*").alias("replies"),
                F.percentile_approx("latency_ms", [0.5, 0.95, 0.99], PERCENTILE_ACCURACY).alias(
                    "p"
                ),
                F.max("latency_ms").alias("max_ms"),
            )
            .collect()
        )
        with self.lock:
            for r in rows:
                self._minute(r["minute"])["latency"] = {
                    "replies": r["replies"],
                    "p50_ms": r["p"][0],
                    "p95_ms": r["p"][1],
                    "p99_ms": r["p"][2],
                    "max_ms": r["max_ms"],
                }

    def figures(self) -> dict[str, Any]:
        """A JSON-able copy of the figures (live.json)."""
        with self.lock:
            minutes = [json.loads(json.dumps(self.minutes[m])) for m in sorted(self.minutes)]
            clients = [
                {"signal": s, "broker_instance": b, "client": c, "count": n}
                for (s, b, c), n in sorted(self.clients.items(), key=lambda kv: (-kv[1], kv[0]))
            ]
            return {
                "updated": round(time.time(), 3),
                "batches": self.batches,
                "records": self.records,
                "last_ts": self.last_ts,
                "minutes": minutes,
                "slow_consumers": clients,
            }


def dashboard_html(fig: dict[str, Any], source: str, refresh_s: float) -> str:
    """The live dashboard page (refreshes itself every ``refresh_s`` seconds)."""
    from . import charts
    from .report import e, page, table, utc

    rows = fig["minutes"]
    t0 = rows[0]["minute"] if rows else 0
    x = [(r["minute"] - t0) / 60 for r in rows]

    def series(
        get: Callable[[dict[str, Any]], dict[str, float]],
    ) -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {}
        for xi, r in zip(x, rows, strict=True):
            for k, v in get(r).items():
                out.setdefault(k, []).append((xi, v))
        return out

    def lat(r: dict[str, Any]) -> dict[str, float]:
        s = r["latency"] or {}
        return {k: s[f"{k}_ms"] for k in ("p50", "p95", "p99") if s.get(f"{k}_ms") is not None}

    xlabel = f"minutes from {utc(t0)}"
    b = [
        f'<p class="note">Capture directory <code>{e(source)}</code>: {fig["records"]} '
        f"records in {fig['batches']} batch(es), last record {e(utc(fig['last_ts']))}, "
        f"updated {e(utc(fig['updated']))}. Per minute of record time.</p>"
    ]
    b.append(
        "<figure>"
        + charts.lines(
            "live-frames",
            "Frames per minute by kind",
            series(lambda r: r["frames"]),
            "frames",
            xlabel,
        )
        + "</figure>"
    )
    b.append(
        "<figure>"
        + charts.lines(
            "live-latency", "Callee reply latency (ms)", series(lat), "ms", xlabel, log_y=True
        )
        + "</figure>"
    )
    b.append(
        "<figure>"
        + charts.lines(
            "live-errors",
            "Errors per minute by code",
            series(lambda r: r["errors"]),
            "errors",
            xlabel,
        )
        + "</figure>"
    )
    b.append(
        "<figure>"
        + charts.lines(
            "live-slow",
            "Slow-consumer signals per minute",
            series(lambda r: r["slow"]),
            "signals",
            xlabel,
        )
        + "</figure>"
    )
    flat = [
        {
            "minute": utc(r["minute"])[:16],
            "frames": sum(r["frames"].values()),
            "bytes": sum(r["bytes"].values()),
            "requests": r["requests"],
            "refused": r["refused"],
            "errors": sum(r["errors"].values()),
            "slow": sum(r["slow"].values()),
            **{
                k: (r["latency"] or {}).get(k)
                for k in ("replies", "p50_ms", "p95_ms", "p99_ms", "max_ms")
            },
        }
        for r in reversed(rows)
    ]
    b.append(
        table(
            "live-minutes",
            (
                "minute",
                "frames",
                "bytes",
                "requests",
                "refused",
                "errors",
                "slow",
                "replies",
                "p50_ms",
                "p95_ms",
                "p99_ms",
                "max_ms",
            ),
            flat,
        )
    )
    b.append(
        table(
            "live-slow-consumers",
            ("signal", "broker_instance", "client", "count"),
            fig["slow_consumers"],
        )
    )
    html = page("msgq-trio live traffic", b)
    # a meta refresh, not a script: the page stays script-free like the reports
    return html.replace(
        "<head>", f'<head><meta http-equiv="refresh" content="{max(1, math.ceil(refresh_s))}">', 1
    )


def run_live(
    spark: SparkSession,
    directory: str,
    out: str,
    *,
    stop: threading.Event,
    trigger: float = TRIGGER_S,
    minutes: int = MINUTES,
    pending_horizon: float = PENDING_HORIZON_S,
    top: int = TOP,
    start: str = "earliest",
    log: Callable[[str], None] | None = None,
) -> LiveState:
    """Run the live query until ``stop`` is set (or the query fails: its error is
    raised); returns the final state. The query and its temporary checkpoint are
    removed before returning, whatever happens."""
    from .livesource import SOURCE_NAME, CaptureSource
    from .storage import prepare_output

    out = to_uri(out)
    prepare_output(spark, out)
    spark.dataSource.register(CaptureSource)

    def publish(fig: dict[str, Any]) -> None:
        write_text(spark, join(out, "live.json"), json.dumps(fig, indent=1))
        write_text(
            spark, join(out, "dashboard.html"), dashboard_html(fig, directory, max(trigger, 1.0))
        )
        if log:
            last = fig["minutes"][-1] if fig["minutes"] else None
            log(
                f"batch {fig['batches']}: {fig['records']} records"
                + (
                    f", minute {last['minute']}: {sum(last['frames'].values())} frames"
                    if last
                    else ""
                )
            )

    state = LiveState(
        spark, minutes=minutes, pending_horizon=pending_horizon, top=top, publish=publish
    )
    publish(state.figures())  # the page exists from the start
    checkpoint = tempfile.mkdtemp(prefix="msgq-trio-live-")
    stream = (
        spark.readStream.format(SOURCE_NAME).option("path", directory).option("start", start).load()
    )
    query = (
        stream.writeStream.foreachBatch(state.process_batch)
        .trigger(processingTime=f"{trigger} seconds")
        .option("checkpointLocation", to_uri(checkpoint))
        .queryName("msgq-trio-live")
        .start()
    )
    try:
        while not stop.wait(0.5):
            if not query.isActive:
                break
        failure = query.exception()
        if failure is not None:
            raise failure
    finally:
        try:
            # let the batch in progress finish: stopping interrupts the query's thread,
            # and a batch cut off mid-way logs errors for nothing
            deadline = time.monotonic() + STOP_WAIT_S
            while (
                query.isActive
                and query.status.get("isTriggerActive")
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            query.stop()
        finally:
            shutil.rmtree(checkpoint, ignore_errors=True)
    return state


def main_live(args: argparse.Namespace) -> int:
    """``msgq-trio analyze live``: returns the exit status (module docstring)."""
    from .session import analysis_session, spark_error

    directory = local_path(args.dir)
    if not is_local(args.dir) or not os.path.isdir(directory):
        print(
            f"msgq-trio analyze live: {args.dir} is not a local directory (the live "
            "source tails files the broker writes on this machine)",
            file=sys.stderr,
        )
        return 2
    if args.trigger <= 0 or args.minutes < 1 or args.pending_horizon <= 0 or args.top < 1:
        print(
            "msgq-trio analyze live: --trigger, --minutes, --pending-horizon and --top "
            "must be positive",
            file=sys.stderr,
        )
        return 2
    stop = threading.Event()
    t0 = time.monotonic()

    def say(text: str) -> None:
        if not args.quiet:
            print(f"[{time.monotonic() - t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    say("starting Spark")
    try:
        with analysis_session(args.master, dict(args.conf), "msgq-trio analyze live") as spark:
            # after the session: pyspark's own SIGINT handler raises KeyboardInterrupt in
            # whatever py4j call is running; ours only asks the loop to stop, and a
            # second signal ends the process at once (a stop that hangs must not keep
            # it: the JVM exits when the driver's gateway pipe closes)
            def on_signal(signum: int, _frame: object) -> None:
                if stop.is_set():
                    os._exit(128 + signum)
                stop.set()

            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, on_signal)
            say(
                f"watching {directory}; dashboard {join(to_uri(args.out), 'dashboard.html')}"
                "; Ctrl-C ends"
            )
            state = run_live(
                spark,
                os.path.abspath(directory),
                args.out,
                stop=stop,
                trigger=args.trigger,
                minutes=args.minutes,
                pending_horizon=args.pending_horizon,
                top=args.top,
                start=args.start,
                log=say,
            )
    except SparkUnavailable as exc:
        print(f"msgq-trio analyze live: {exc}", file=sys.stderr)
        return 3
    except Exception as exc:
        reason = spark_error(exc)
        if reason is None:
            raise
        print(f"msgq-trio analyze live: the query failed: {reason}", file=sys.stderr)
        return 4
    print(f"stopped: {state.records} records in {state.batches} batch(es)", flush=True)
    return 0
