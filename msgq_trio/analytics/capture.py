"""Traffic capture analysis (record format: docs/CAPTURE.md; figures: docs/ANALYTICS.md).

Everything is DataFrame operations on the records; only small aggregates (per-kind
totals, top-N lists, histogram bins, per-second series of a bounded number of points)
are ever collected into the driver.

How a request ends (one row per ``command`` record in the ``requests`` table, column
``status``):

* ``answered``: the callee sent a REPLY (for a broker command: the broker did);
* ``callee-error``: the callee sent an ERROR (its handler failed, ``bad-request``...);
* ``broker-error``: the broker refused the request and answered it itself
  (``no-recipient``, ``limit-exceeded``, ``receiver-full``, ``multiple-recipients``...):
  the request never reached a callee;
* ``never-answered``: the request was delivered and the callee never answered it. Column
  ``reason`` says what the capture shows instead: the code of the answer the broker gave
  on the callee's behalf (``recipient-gone`` when the callee disconnected or was killed,
  ``timeout`` at the deadline), or ``no-reply-in-capture`` when the capture holds no
  answer at all (still pending when the capture stopped, or its answer was dropped).

A ``call_all`` command expects one reply per recipient; it is ``never-answered`` when
some never came, ``callee-error`` when one was an error, else ``answered``.

Pairing: a reply answers the command with ``command.sender == reply.target`` and
``command.request_id == reply.reply_to``. The broker's ``no-recipient`` error is the
exception (its target is the original target, not the caller): the command's own
``outcome == "no-recipient"`` says it was answered so, and those error records are not
paired. Request ids are unique per caller lname, and lnames per broker lifetime: analyse
captures of one broker lifetime at a time (a restarted broker reuses lnames).

Latency (``latency_ms``) is reply ts minus command ts for replies by the callee (and the
broker's answers to its own commands); the broker records a request after routing it, so
an immediate answer can carry a timestamp a few microseconds earlier: latency is clamped
at 0. Percentiles are ``percentile_approx`` with accuracy 10,000: exact (nearest rank)
for groups below 10,000 values, within 0.01 % of the rank above.
"""

from __future__ import annotations

import glob
import math
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

#: The broker's lname in capture records (frames the broker originates).
BROKER = "l.0"
#: Codes the broker gives on a callee's behalf for a request it had delivered.
ON_BEHALF_CODES = ("recipient-gone", "timeout")
PERCENTILE_ACCURACY = 10_000
#: At most this many points per series in the HTML plots (the Parquet tables keep 1 s).
MAX_PLOT_POINTS = 600


def capture_schema() -> Any:
    """The Spark schema of a capture record: every documented field, plus the two of a
    ``capture-dropped`` record. ``recipients`` is read as a string because some broker
    versions write ``true`` for forwarded answers; :func:`read_capture` normalizes it.
    ``body`` is read as raw JSON text (bodies of different shapes)."""
    from pyspark.sql import types as T

    s, i, d, b = T.StringType(), T.LongType(), T.DoubleType(), T.BooleanType()
    fields = [
        ("ts", d), ("seq", i), ("kind", s), ("sender", s), ("sender_name", s),
        ("on_behalf_of", s), ("target", s), ("request_id", i), ("reply_to", i), ("all", b),
        ("size", i), ("attachments", i), ("fds", i), ("outcome", s), ("recipients", s),
        ("command", s), ("event", s), ("code", s), ("error_message", s), ("body", s),
        ("body_encoding", s), ("dropped", i), ("dropped_total", i),
    ]
    return T.StructType([T.StructField(n, t, True) for n, t in fields])


def expand_paths(paths: Iterable[str | os.PathLike[str]], pattern: str = "*.jsonl") -> list[str]:
    """Files named by ``paths``: a directory stands for its ``pattern`` files, a glob for
    its matches (sorted). Raises FileNotFoundError for a path that names nothing.
    Non-local URLs (``hdfs://``, ``s3a://``...) are passed to Spark as they are."""
    out: list[str] = []
    for p in map(str, paths):
        if "://" in p and not p.startswith("file://"):
            out.append(p)
            continue
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, pattern)))
        elif any(c in p for c in "*?["):
            found = sorted(glob.glob(p))
        else:
            found = [p] if os.path.exists(p) else []
        if not found:
            raise FileNotFoundError(f"no {pattern} files at {p}")
        out.extend(str(Path(f).resolve()) for f in found)
    return out


def read_capture(spark: SparkSession, paths: Sequence[str]) -> DataFrame:
    """The capture records of ``paths`` (files, directories, globs) as a DataFrame with
    :func:`capture_schema`, ``recipients`` as a long, ``second`` (the 1 s bucket, unix
    seconds) and ``file`` (the source file). Malformed lines (a file cut mid-line) become
    rows with every field null and are dropped."""
    from pyspark.sql import functions as F

    df = spark.read.schema(capture_schema()).option("mode", "PERMISSIVE").json(
        expand_paths(paths))
    rec = F.col("recipients")
    return (
        df.where(F.col("kind").isNotNull())
        .withColumn("recipients", F.when(rec == "true", F.lit(1)).when(rec == "false", F.lit(0))
                    .otherwise(rec.cast("long")))
        .withColumn("second", F.floor("ts").cast("long"))
        .withColumn("file", F.col("_metadata.file_path"))  # input_file_name() is deprecated
    )


def _ms(col: Column) -> Column:
    from pyspark.sql import functions as F

    return F.round(col * 1000.0, 3)


def requests_table(df: DataFrame) -> DataFrame:
    """One row per ``command`` record: caller, target, command, ts, expected replies, the
    counts of replies by kind and party, ``status`` and ``reason`` (module docstring)."""
    from pyspark.sql import functions as F

    cmds = df.where(F.col("kind") == "command").select(
        F.col("sender").alias("caller"), F.col("sender_name").alias("caller_name"),
        "request_id", "target", "command", F.col("all").alias("call_all"), "recipients",
        "outcome", F.col("ts").alias("cmd_ts"), F.col("seq").alias("cmd_seq"),
        F.col("file").alias("cmd_file"),
    )
    replies = replies_of(df)
    joined = cmds.join(replies, on=["caller", "request_id"], how="left")
    callee = (F.col("replier") != BROKER) | (F.col("outcome") == "broker")
    on_behalf = (F.col("replier") == BROKER) & F.coalesce(
        F.col("code").isin(*ON_BEHALF_CODES), F.lit(False))
    grouped = joined.groupBy(
        "caller", "caller_name", "request_id", "target", "command", "call_all", "recipients",
        "outcome", "cmd_ts", "cmd_seq", "cmd_file",
    ).agg(
        F.count("reply_kind").alias("replies"),
        F.sum(F.when(callee & (F.col("reply_kind") == "answer"), 1).otherwise(0))
        .alias("callee_answers"),
        F.sum(F.when(callee & (F.col("reply_kind") == "error"), 1).otherwise(0))
        .alias("callee_errors"),
        F.sum(F.when(on_behalf, 1).otherwise(0)).alias("broker_on_behalf"),
        F.sum(F.when((F.col("replier") == BROKER) & ~callee & ~on_behalf, 1).otherwise(0))
        .alias("broker_refusals"),
        F.min(F.when(callee & (F.col("reply_kind") == "error"), F.col("code")))
        .alias("callee_code"),
        F.min(F.when(on_behalf, F.col("code"))).alias("on_behalf_code"),
        F.min(F.when((F.col("replier") == BROKER) & ~callee & ~on_behalf, F.col("code")))
        .alias("refusal_code"),
        F.max(F.when(callee, F.col("reply_ts"))).alias("last_callee_reply_ts"),
    )
    delivered = F.col("outcome").isin("delivered", "broker")
    expected = F.when(F.col("call_all") & delivered, F.col("recipients")).otherwise(F.lit(1))
    callee_replies = F.col("callee_answers") + F.col("callee_errors")
    status = (
        F.when(F.col("outcome") == "no-recipient", F.lit("broker-error"))
        .when(~delivered | (F.col("broker_refusals") > 0), F.lit("broker-error"))
        .when(callee_replies < expected, F.lit("never-answered"))
        .when(F.col("callee_errors") > 0, F.lit("callee-error"))
        .otherwise(F.lit("answered"))
    )
    reason = (
        F.when(F.col("outcome") == "no-recipient", F.lit("no-recipient"))
        .when(~delivered | (F.col("broker_refusals") > 0),
              F.coalesce(F.col("refusal_code"), F.concat(F.lit("refused/"), F.col("outcome"))))
        .when(callee_replies < expected,
              F.coalesce(F.col("on_behalf_code"), F.lit("no-reply-in-capture")))
        .when(F.col("callee_errors") > 0, F.col("callee_code"))
        .otherwise(F.lit(None).cast("string"))
    )
    return (
        grouped.withColumn("expected_replies", expected)
        .withColumn("status", status)
        .withColumn("reason", reason)
    )


def replies_of(df: DataFrame) -> DataFrame:
    """Answers and errors that can be paired: keyed by (caller, request_id), with the
    replier, its kind, code, ts. The broker's ``no-recipient`` errors are left out
    (module docstring)."""
    from pyspark.sql import functions as F

    return df.where(
        F.col("kind").isin("answer", "error") & F.col("reply_to").isNotNull()
        # eqNullSafe: answers have a null code, and a null condition drops the row
        & ~((F.col("sender") == BROKER) & F.col("code").eqNullSafe("no-recipient"))
    ).select(
        F.col("target").alias("caller"), F.col("reply_to").alias("request_id"),
        F.col("sender").alias("replier"), F.col("sender_name").alias("replier_name"),
        F.col("kind").alias("reply_kind"), "code", "on_behalf_of",
        F.col("ts").alias("reply_ts"),
    )


def latency_pairs(df: DataFrame) -> DataFrame:
    """Every (command, callee reply) pair with ``latency_ms`` (clamped at 0)."""
    from pyspark.sql import functions as F

    cmds = df.where(F.col("kind") == "command").select(
        F.col("sender").alias("caller"), "request_id", "target", "command", "outcome",
        F.col("ts").alias("cmd_ts"),
    )
    pairs = cmds.join(replies_of(df), on=["caller", "request_id"], how="inner")
    return pairs.where((F.col("replier") != BROKER) | (F.col("outcome") == "broker")).select(
        "target", "command", "caller", "request_id", "replier", "reply_kind", "code",
        _ms(F.greatest(F.col("reply_ts") - F.col("cmd_ts"), F.lit(0.0))).alias("latency_ms"),
    )


def latency_table(pairs: DataFrame) -> DataFrame:
    """Per (target, command): replies, p50/p95/p99/max latency in ms."""
    from pyspark.sql import functions as F

    return (
        pairs.groupBy("target", "command")
        .agg(
            F.count("*").alias("replies"),
            F.percentile_approx("latency_ms", [0.5, 0.95, 0.99], PERCENTILE_ACCURACY)
            .alias("p"),
            F.max("latency_ms").alias("max_ms"),
        )
        .select(
            "target", "command", "replies",
            F.col("p")[0].alias("p50_ms"), F.col("p")[1].alias("p95_ms"),
            F.col("p")[2].alias("p99_ms"), "max_ms",
        )
        .orderBy(F.desc("replies"), "target", "command")
    )


def _rows(df: DataFrame) -> list[dict[str, Any]]:
    return [r.asDict() for r in df.collect()]


def _top(rows: list[dict[str, Any]], n: int, *keys: str) -> list[dict[str, Any]]:
    """The first ``n`` rows by ``keys`` descending (ties: the row's other values)."""
    return sorted(rows, key=lambda r: tuple(-(r[k] or 0) for k in keys)
                  + tuple(str(v) for v in r.values()))[:n]


def _sum_by(rows: list[dict[str, Any]], keys: Sequence[str],
            values: Sequence[str]) -> list[dict[str, Any]]:
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in rows:
        k = tuple(r[c] for c in keys)
        acc = out.setdefault(k, {**{c: r[c] for c in keys}, **dict.fromkeys(values, 0)})
        for v in values:
            acc[v] += r[v] or 0
    return list(out.values())


def analyze_capture(df: DataFrame, top: int = 20, step: Callable[[str], None] | None = None,
                    ) -> tuple[dict[str, DataFrame], dict[str, Any]]:
    """The analysis of the capture records ``df`` (from :func:`read_capture`).

    Returns ``(tables, figures)``: ``tables`` are the DataFrames that grow with the data
    (traffic per second, every request, requests never answered, slow-consumer signals
    per second), to be written by Spark; ``figures`` are small collected aggregates
    (totals, per kind, per sender and target, latency per (target, command), errors by
    code and party, request outcomes, plot series), whose lists under ``tables_small``
    are written as tables too. ``top`` bounds the top-N lists of the report.

    About ten Spark jobs in all: a fixed cost per job dominates small captures, so
    aggregates are collected at the finest small grain once and summed in Python.
    """
    from pyspark.sql import functions as F

    step = step or df.sparkSession.sparkContext.setJobDescription
    df = df.persist()
    tables: dict[str, DataFrame] = {}
    small: dict[str, list[dict[str, Any]]] = {}

    step("capture: totals")
    totals = df.agg(
        F.count("*").alias("records"), F.min("ts").alias("first_ts"),
        F.max("ts").alias("last_ts"), F.sum("size").alias("bytes"),
        F.sum(F.when(F.col("kind") == "capture-dropped", F.col("dropped")).otherwise(0))
        .alias("capture_dropped"),
        F.countDistinct("file").alias("files"),
    ).first()
    assert totals is not None
    fig: dict[str, Any] = totals.asDict()
    fig["capture_dropped"] = int(fig["capture_dropped"] or 0)
    fig["bytes"] = int(fig["bytes"] or 0)

    frames = df.where(F.col("kind") != "capture-dropped")
    tables["traffic_per_second"] = frames.groupBy(
        "second", "kind", "sender", "sender_name", "target"
    ).agg(F.count("*").alias("frames"), F.sum("size").alias("bytes"))

    step("capture: traffic per sender and kind")
    by_sender_kind = _rows(frames.groupBy("sender", "sender_name", "kind").agg(
        F.count("*").alias("frames"), F.sum("size").alias("bytes"),
        F.countDistinct("target").alias("targets")))
    small["per_kind"] = sorted(_sum_by(by_sender_kind, ["kind"], ["frames", "bytes"]),
                               key=lambda r: r["kind"])
    fig["per_kind"] = small["per_kind"]
    small["senders"] = _top(_sum_by(by_sender_kind, ["sender", "sender_name"],
                                    ["frames", "bytes"]), len(by_sender_kind), "bytes",
                            "frames")
    fig["top_senders"] = small["senders"][:top]
    step("capture: traffic per target")
    small["targets"] = _top(_rows(frames.groupBy("target").agg(
        F.count("*").alias("frames"), F.sum("size").alias("bytes"),
        F.countDistinct("sender").alias("senders"))), 1 << 62, "bytes", "frames")
    fig["top_targets"] = small["targets"][:top]

    # traffic over time for the plot: at most MAX_PLOT_POINTS buckets per kind
    span = 0.0 if fig["first_ts"] is None else fig["last_ts"] - fig["first_ts"]
    width = max(1, math.ceil((span + 1) / MAX_PLOT_POINTS))
    fig["plot_bucket_s"] = width
    base = math.floor(fig["first_ts"] or 0)
    step("capture: traffic over time")
    fig["traffic_series"] = _rows(
        frames.withColumn("bucket", F.floor((F.col("second") - base) / width) * width + base)
        .groupBy("bucket", "kind").agg(F.count("*").alias("frames"),
                                       F.sum("size").alias("bytes"))
        .orderBy("bucket", "kind"))

    step("capture: pairing requests")
    requests = requests_table(df)
    tables["requests"] = requests
    tables["never_answered"] = requests.where(F.col("status") == "never-answered").select(
        "cmd_ts", "caller", "caller_name", "request_id", "target", "command", "reason",
        "expected_replies", "callee_answers", "callee_errors",
    )
    outcomes = _rows(requests.groupBy("status", "reason", "target", "command", "caller",
                                      "caller_name").agg(F.count("*").alias("requests")))
    small["request_outcomes"] = outcomes
    fig["request_status"] = sorted(
        _sum_by(outcomes, ["status", "reason"], ["requests"]),
        key=lambda r: (r["status"], r["reason"] or ""))
    by_status = {s: 0 for s in ("answered", "callee-error", "broker-error", "never-answered")}
    for r in fig["request_status"]:
        by_status[r["status"]] = by_status.get(r["status"], 0) + r["requests"]
    fig["requests"] = {"total": sum(by_status.values()), **by_status}
    fig["never_answered_by_target"] = _top(
        _sum_by([r for r in outcomes if r["status"] == "never-answered"],
                ["target", "command", "reason"], ["requests"]), top, "requests")
    small["failed_requests_by_caller"] = _top(
        _sum_by([r for r in outcomes if r["status"] != "answered"],
                ["caller", "caller_name", "status", "reason"], ["requests"]),
        len(outcomes), "requests")

    step("capture: latency percentiles")
    pairs = latency_pairs(df)
    small["latency"] = _top(_rows(latency_table(pairs)), 1 << 62, "replies")
    fig["latency"] = small["latency"][:top]
    # histogram: 10 log-spaced bins per decade from 1 µs; 0 goes in the first bin
    step("capture: latency histogram")
    bin_col = F.floor(F.log10(F.greatest(F.col("latency_ms"), F.lit(0.001))) * 10).cast("int")
    fig["latency_histogram"] = _rows(
        pairs.groupBy(bin_col.alias("bin")).agg(F.count("*").alias("n")).orderBy("bin"))

    step("capture: errors")
    party = (F.when(F.col("sender") != BROKER, F.lit("callee"))
             .when(F.col("on_behalf_of").isNotNull(), F.lit("broker-for-callee"))
             .otherwise(F.lit("broker")))
    by_party = _rows(frames.where(F.col("kind") == "error").withColumn("party", party)
                     .groupBy("code", "party", "sender", "sender_name", "on_behalf_of")
                     .agg(F.count("*").alias("errors")))
    for r in by_party:
        r["from_callees"] = r["errors"] if r["party"] == "callee" else 0
        r["from_broker"] = 0 if r["party"] == "callee" else r["errors"]
    small["errors_by_code"] = _top(
        _sum_by(by_party, ["code"], ["errors", "from_callees", "from_broker"]),
        len(by_party), "errors")
    fig["errors_by_code"] = small["errors_by_code"]
    small["errors_by_party"] = _top(
        [{k: r[k] for k in ("code", "party", "sender", "sender_name", "on_behalf_of",
                            "errors")} for r in by_party], len(by_party), "errors")
    fig["errors_by_party"] = small["errors_by_party"][:top]

    step("capture: slow consumers")
    slow = slow_consumer_signals(df)
    tables["slow_consumers_per_second"] = slow
    small["slow_consumers"] = _top(_rows(
        slow.groupBy("signal", "client")
        .agg(F.sum("count").alias("count"), F.min("second").alias("first_second"),
             F.max("second").alias("last_second"))), 1 << 62, "count")
    fig["slow_consumers"] = small["slow_consumers"][:top]
    fig["tables_small"] = small
    return tables, fig


def slow_consumer_signals(df: DataFrame) -> DataFrame:
    """Per second and client: what the capture shows of slow consumers. Signals:
    ``receiver-full`` (a request refused because the callee's queue was over
    out_hard_limit; client = that callee), ``slow-consumer`` (an ERROR with that code,
    or a ``disconnected`` membership event whose captured body gives that reason; client
    = the dropped lname), ``answer-discarded`` (an answer nobody waited for any more;
    client = its sender), ``capture-dropped`` (records the capture itself lost; client =
    ``capture``). Queued bytes are not in the capture (``msgq-trio ctl stats`` has them)."""
    from pyspark.sql import functions as F

    reason = F.get_json_object(F.col("body"), "$.reason")
    signal = (
        F.when(F.col("code") == "receiver-full", F.lit("receiver-full"))
        .when(F.col("code") == "slow-consumer", F.lit("slow-consumer"))
        .when((F.col("kind") == "membership") & (F.col("event") == "disconnected")
              & (reason == "slow-consumer"), F.lit("slow-consumer"))
        .when(F.col("outcome") == "discarded", F.lit("answer-discarded"))
        .when(F.col("kind") == "capture-dropped", F.lit("capture-dropped"))
    )
    client = (
        F.when(F.col("code") == "receiver-full", F.coalesce("on_behalf_of", "target"))
        .when(F.col("kind") == "membership", F.get_json_object(F.col("body"), "$.lname"))
        .when(F.col("code") == "slow-consumer", F.col("target"))
        .when(F.col("kind") == "capture-dropped", F.lit("capture"))
        .otherwise(F.col("sender"))
    )
    amount = F.when(F.col("kind") == "capture-dropped", F.col("dropped")).otherwise(F.lit(1))
    return (
        df.withColumn("signal", signal).where(F.col("signal").isNotNull())
        .groupBy("second", "signal", client.alias("client"))
        .agg(F.sum(amount).alias("count"))
        .orderBy("second", "signal", "client")
    )
