"""Traffic capture analysis (record format: docs/CAPTURE.md; figures: docs/ANALYTICS.md).

Everything is DataFrame operations on the records; only small aggregates (per-kind
totals, top-N lists, histogram bins, series of a bounded number of points) are ever
collected into the driver.

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

Pairing: a reply answers the command with the same ``broker_instance``,
``command.sender == reply.target`` and ``command.request_id == reply.reply_to``. The
broker's ``no-recipient`` error is the exception (its target is the original target, not
the caller): the command's own ``outcome == "no-recipient"`` says it was answered so, and
those error records are not paired. Request ids are unique per caller lname, and lnames
per broker lifetime: a restarted broker reuses both, so every key of a request or a
connection includes ``broker_instance`` (the broker process that wrote the record;
``""`` for captures older than that field, which must then hold one lifetime).

Driver memory: only one-row summaries, aggregates over a fixed set of values (kinds,
statuses, histogram bins, plot buckets) and top-N rows (``top``) are collected. Every
per-key table (per sender, target, caller, connection, (target, command)) is returned as
a DataFrame for Spark to write, however many connections the capture holds.

Latency (``latency_ms``) is reply ts minus command ts for replies by the callee (and the
broker's answers to its own commands); the broker records a request after routing it, so
an immediate answer can carry a timestamp a few microseconds earlier: latency is clamped
at 0. Percentiles are ``percentile_approx`` with accuracy 10,000: exact (nearest rank)
for groups below 10,000 values, within 0.01 % of the rank above.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .storage import expand_inputs, is_local

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

#: The broker's lname in capture records (frames the broker originates).
BROKER = "l.0"
#: Codes the broker gives on a callee's behalf for a request it had delivered.
ON_BEHALF_CODES = ("recipient-gone", "timeout")
PERCENTILE_ACCURACY = 10_000
#: At most this many points per series in the HTML plots (the Parquet tables keep 1 s).
MAX_PLOT_POINTS = 600
#: What names one request in a capture that may span broker restarts (module docstring).
REQUEST_KEY = ["broker_instance", "caller", "request_id"]


def capture_schema() -> Any:
    """The Spark schema of a capture record: every documented field, plus the two of a
    ``capture-dropped`` record. ``recipients`` is read as a string because some broker
    versions write ``true`` for forwarded answers; :func:`read_capture` normalizes it.
    ``body`` is read as raw JSON text (bodies of different shapes)."""
    from pyspark.sql import types as T

    s, i, d, b = T.StringType(), T.LongType(), T.DoubleType(), T.BooleanType()
    fields = [
        ("ts", d),
        ("seq", i),
        ("kind", s),
        ("sender", s),
        ("sender_name", s),
        ("on_behalf_of", s),
        ("target", s),
        ("request_id", i),
        ("reply_to", i),
        ("all", b),
        ("size", i),
        ("attachments", i),
        ("fds", i),
        ("outcome", s),
        ("recipients", s),
        ("command", s),
        ("event", s),
        ("code", s),
        ("error_message", s),
        ("body", s),
        ("body_encoding", s),
        ("dropped", i),
        ("dropped_total", i),
        ("broker_instance", s),
        ("broker_started", d),
    ]
    return T.StructType([T.StructField(n, t, True) for n, t in fields])


def expand_paths(paths: Iterable[str | os.PathLike[str]], pattern: str = "*.jsonl") -> list[str]:
    """The input URIs of ``paths`` (:func:`msgq_trio.analytics.storage.expand_inputs`)."""
    return expand_inputs(paths, pattern)


def read_capture(spark: SparkSession, paths: Sequence[str]) -> DataFrame:
    """The capture records of ``paths`` (local files, directories, globs, or URIs Spark
    reads itself: a remote directory stands for its ``*.jsonl`` files) as a DataFrame
    with :func:`capture_schema`, ``recipients`` as a long, ``broker_instance`` never null
    (``""`` for records older than the field), ``second`` (the 1 s bucket, unix seconds)
    and ``file`` (the source file). Malformed lines (a file cut mid-line) become rows
    with every field null and are dropped."""
    from pyspark.sql import functions as F

    uris = expand_paths(paths)
    reader = spark.read.schema(capture_schema()).option("mode", "PERMISSIVE")
    if not all(is_local(u) for u in uris):
        reader = reader.option("pathGlobFilter", "*.jsonl")
    df = reader.json(uris)
    rec = F.col("recipients")
    return (
        df.where(F.col("kind").isNotNull())
        .withColumn(
            "recipients",
            F.when(rec == "true", F.lit(1))
            .when(rec == "false", F.lit(0))
            .otherwise(rec.cast("long")),
        )
        .withColumn("broker_instance", F.coalesce(F.col("broker_instance"), F.lit("")))
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
        "broker_instance",
        F.col("sender").alias("caller"),
        F.col("sender_name").alias("caller_name"),
        "request_id",
        "target",
        "command",
        F.col("all").alias("call_all"),
        "recipients",
        "outcome",
        F.col("ts").alias("cmd_ts"),
        F.col("seq").alias("cmd_seq"),
        F.col("file").alias("cmd_file"),
    )
    replies = replies_of(df)
    joined = cmds.join(replies, on=REQUEST_KEY, how="left")
    callee = (F.col("replier") != BROKER) | (F.col("outcome") == "broker")
    on_behalf = (F.col("replier") == BROKER) & F.coalesce(
        F.col("code").isin(*ON_BEHALF_CODES), F.lit(False)
    )
    grouped = joined.groupBy(
        "broker_instance",
        "caller",
        "caller_name",
        "request_id",
        "target",
        "command",
        "call_all",
        "recipients",
        "outcome",
        "cmd_ts",
        "cmd_seq",
        "cmd_file",
    ).agg(
        F.count("reply_kind").alias("replies"),
        F.sum(F.when(callee & (F.col("reply_kind") == "answer"), 1).otherwise(0)).alias(
            "callee_answers"
        ),
        F.sum(F.when(callee & (F.col("reply_kind") == "error"), 1).otherwise(0)).alias(
            "callee_errors"
        ),
        F.sum(F.when(on_behalf, 1).otherwise(0)).alias("broker_on_behalf"),
        F.sum(F.when((F.col("replier") == BROKER) & ~callee & ~on_behalf, 1).otherwise(0)).alias(
            "broker_refusals"
        ),
        F.min(F.when(callee & (F.col("reply_kind") == "error"), F.col("code"))).alias(
            "callee_code"
        ),
        F.min(F.when(on_behalf, F.col("code"))).alias("on_behalf_code"),
        F.min(F.when((F.col("replier") == BROKER) & ~callee & ~on_behalf, F.col("code"))).alias(
            "refusal_code"
        ),
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
        .when(
            ~delivered | (F.col("broker_refusals") > 0),
            F.coalesce(F.col("refusal_code"), F.concat(F.lit("refused/"), F.col("outcome"))),
        )
        .when(
            callee_replies < expected,
            F.coalesce(F.col("on_behalf_code"), F.lit("no-reply-in-capture")),
        )
        .when(F.col("callee_errors") > 0, F.col("callee_code"))
        .otherwise(F.lit(None).cast("string"))
    )
    return (
        grouped.withColumn("expected_replies", expected)
        .withColumn("status", status)
        .withColumn("reason", reason)
    )


def replies_of(df: DataFrame) -> DataFrame:
    """Answers and errors that can be paired: keyed by :data:`REQUEST_KEY`, with the
    replier, its kind, code, ts. The broker's ``no-recipient`` errors are left out
    (module docstring)."""
    from pyspark.sql import functions as F

    return df.where(
        F.col("kind").isin("answer", "error")
        & F.col("reply_to").isNotNull()
        # eqNullSafe: answers have a null code, and a null condition drops the row
        & ~((F.col("sender") == BROKER) & F.col("code").eqNullSafe("no-recipient"))
    ).select(
        "broker_instance",
        F.col("target").alias("caller"),
        F.col("reply_to").alias("request_id"),
        F.col("sender").alias("replier"),
        F.col("sender_name").alias("replier_name"),
        F.col("kind").alias("reply_kind"),
        "code",
        "on_behalf_of",
        F.col("ts").alias("reply_ts"),
    )


def latency_pairs(df: DataFrame) -> DataFrame:
    """Every (command, callee reply) pair with ``latency_ms`` (clamped at 0)."""
    from pyspark.sql import functions as F

    cmds = df.where(F.col("kind") == "command").select(
        "broker_instance",
        F.col("sender").alias("caller"),
        "request_id",
        "target",
        "command",
        "outcome",
        F.col("ts").alias("cmd_ts"),
    )
    pairs = cmds.join(replies_of(df), on=REQUEST_KEY, how="inner")
    return pairs.where((F.col("replier") != BROKER) | (F.col("outcome") == "broker")).select(
        "broker_instance",
        "target",
        "command",
        "caller",
        "request_id",
        "replier",
        "reply_kind",
        "code",
        "cmd_ts",
        _ms(F.greatest(F.col("reply_ts") - F.col("cmd_ts"), F.lit(0.0))).alias("latency_ms"),
    )


def latency_table(pairs: DataFrame) -> DataFrame:
    """Per (target, command): replies, p50/p95/p99/max latency in ms."""
    from pyspark.sql import functions as F

    return (
        pairs.groupBy("target", "command")
        .agg(
            F.count("*").alias("replies"),
            F.percentile_approx("latency_ms", [0.5, 0.95, 0.99], PERCENTILE_ACCURACY).alias("p"),
            F.max("latency_ms").alias("max_ms"),
        )
        .select(
            "target",
            "command",
            "replies",
            F.col("p")[0].alias("p50_ms"),
            F.col("p")[1].alias("p95_ms"),
            F.col("p")[2].alias("p99_ms"),
            "max_ms",
        )
        .orderBy(F.desc("replies"), "target", "command")
    )


def _rows(df: DataFrame) -> list[dict[str, Any]]:
    return [r.asDict() for r in df.collect()]


def _top(df: DataFrame, n: int, *order: Column | str) -> list[dict[str, Any]]:
    """The first ``n`` rows of ``df`` in ``order``: a Spark ``limit``, so the driver gets
    ``n`` rows however large ``df`` is."""
    return _rows(df.orderBy(*order).limit(n))


def analyze_capture(
    df: DataFrame,
    top: int = 20,
    step: Callable[[str], None] | None = None,
) -> tuple[dict[str, DataFrame], dict[str, Any]]:
    """The analysis of the capture records ``df`` (from :func:`read_capture`).

    Returns ``(tables, figures)``: ``tables`` are DataFrames, every per-key table among
    them (per second, request, sender, target, caller, (target, command), client), for
    Spark to write; ``figures`` are what the driver collected: one-row totals, aggregates
    over fixed small sets (kinds, request statuses, error codes, histogram bins, at most
    :data:`MAX_PLOT_POINTS` plot buckets per kind) and the first ``top`` rows of each
    per-key table. The driver's memory does not grow with the number of connections.
    """
    from pyspark.sql import functions as F

    step = step or df.sparkSession.sparkContext.setJobDescription
    df = df.persist()
    tables: dict[str, DataFrame] = {}
    desc = F.desc

    step("capture: totals")
    totals = df.agg(
        F.count("*").alias("records"),
        F.min("ts").alias("first_ts"),
        F.max("ts").alias("last_ts"),
        F.sum("size").alias("bytes"),
        F.sum(F.when(F.col("kind") == "capture-dropped", F.col("dropped")).otherwise(0)).alias(
            "capture_dropped"
        ),
        F.countDistinct("file").alias("files"),
        F.countDistinct("broker_instance").alias("broker_instances"),
    ).first()
    assert totals is not None
    fig: dict[str, Any] = totals.asDict()
    fig["capture_dropped"] = int(fig["capture_dropped"] or 0)
    fig["bytes"] = int(fig["bytes"] or 0)
    fig["top"] = top

    brokers = df.groupBy("broker_instance").agg(
        F.min("broker_started").alias("broker_started"),
        F.count("*").alias("records"),
        F.min("ts").alias("first_ts"),
        F.max("ts").alias("last_ts"),
    )
    tables["brokers"] = brokers
    fig["brokers"] = _top(brokers, top, "broker_started", "first_ts")

    frames = df.where(F.col("kind") != "capture-dropped")
    tables["traffic_per_second"] = frames.groupBy(
        "second", "kind", "broker_instance", "sender", "sender_name", "target"
    ).agg(F.count("*").alias("frames"), F.sum("size").alias("bytes"))

    step("capture: traffic per kind")
    per_kind = frames.groupBy("kind").agg(
        F.count("*").alias("frames"), F.sum("size").alias("bytes")
    )
    tables["per_kind"] = per_kind
    fig["per_kind"] = _rows(per_kind.orderBy("kind"))

    step("capture: top senders")
    senders = (
        frames.groupBy("broker_instance", "sender", "sender_name")
        .agg(
            F.count("*").alias("frames"),
            F.sum("size").alias("bytes"),
            F.countDistinct("target").alias("targets"),
        )
        .persist()
    )
    tables["senders"] = senders
    fig["top_senders"] = _top(
        senders, top, desc("bytes"), desc("frames"), "broker_instance", "sender"
    )
    step("capture: top targets")
    targets = (
        frames.groupBy("broker_instance", "target")
        .agg(
            F.count("*").alias("frames"),
            F.sum("size").alias("bytes"),
            F.countDistinct("sender").alias("senders"),
        )
        .persist()
    )
    tables["targets"] = targets
    fig["top_targets"] = _top(
        targets, top, desc("bytes"), desc("frames"), "broker_instance", "target"
    )

    # traffic over time for the plot: at most MAX_PLOT_POINTS buckets per kind
    span = 0.0 if fig["first_ts"] is None else fig["last_ts"] - fig["first_ts"]
    width = max(1, math.ceil((span + 1) / MAX_PLOT_POINTS))
    fig["plot_bucket_s"] = width
    base = math.floor(fig["first_ts"] or 0)
    step("capture: traffic over time")
    fig["traffic_series"] = _rows(
        frames.withColumn("bucket", F.floor((F.col("second") - base) / width) * width + base)
        .groupBy("bucket", "kind")
        .agg(F.count("*").alias("frames"), F.sum("size").alias("bytes"))
        .orderBy("bucket", "kind")
    )

    step("capture: pairing requests")
    requests = requests_table(df).persist()
    tables["requests"] = requests
    tables["never_answered"] = requests.where(F.col("status") == "never-answered").select(
        "cmd_ts",
        "broker_instance",
        "caller",
        "caller_name",
        "request_id",
        "target",
        "command",
        "reason",
        "expected_replies",
        "callee_answers",
        "callee_errors",
    )
    tables["request_outcomes"] = requests.groupBy(
        "status", "reason", "target", "command", "broker_instance", "caller", "caller_name"
    ).agg(F.count("*").alias("requests"))
    # statuses are four and reasons are error codes: a small set
    fig["request_status"] = _rows(
        requests.groupBy("status", "reason")
        .agg(F.count("*").alias("requests"))
        .orderBy("status", F.coalesce("reason", F.lit("")))
    )
    by_status = {s: 0 for s in ("answered", "callee-error", "broker-error", "never-answered")}
    for r in fig["request_status"]:
        by_status[r["status"]] = by_status.get(r["status"], 0) + r["requests"]
    fig["requests"] = {"total": sum(by_status.values()), **by_status}
    step("capture: requests never answered")
    fig["never_answered_by_target"] = _top(
        requests.where(F.col("status") == "never-answered")
        .groupBy("target", "command", "reason")
        .agg(F.count("*").alias("requests")),
        top,
        desc("requests"),
        "target",
        "command",
        "reason",
    )
    failed = (
        requests.where(F.col("status") != "answered")
        .groupBy("broker_instance", "caller", "caller_name", "status", "reason")
        .agg(F.count("*").alias("requests"))
    )
    tables["failed_requests_by_caller"] = failed
    fig["failed_requests_by_caller"] = _top(
        failed, top, desc("requests"), "broker_instance", "caller", "status", "reason"
    )

    step("capture: latency percentiles")
    pairs = latency_pairs(df).persist()
    latency = latency_table(pairs).persist()
    tables["latency"] = latency
    fig["latency"] = _top(latency, top, desc("replies"), "target", "command")
    overall = latency_overall(pairs).first()
    fig["latency_overall"] = overall.asDict() if overall is not None else {}
    # histogram: 10 log-spaced bins per decade from 1 µs; 0 goes in the first bin
    step("capture: latency histogram")
    bin_col = F.floor(F.log10(F.greatest(F.col("latency_ms"), F.lit(0.001))) * 10).cast("int")
    fig["latency_histogram"] = _rows(
        pairs.groupBy(bin_col.alias("bin")).agg(F.count("*").alias("n")).orderBy("bin")
    )

    step("capture: errors")
    party = (
        F.when(F.col("sender") != BROKER, F.lit("callee"))
        .when(F.col("on_behalf_of").isNotNull(), F.lit("broker-for-callee"))
        .otherwise(F.lit("broker"))
    )
    errors = frames.where(F.col("kind") == "error").withColumn("party", party)
    by_code = errors.groupBy("code").agg(
        F.count("*").alias("errors"),
        F.sum(F.when(F.col("party") == "callee", 1).otherwise(0)).alias("from_callees"),
        F.sum(F.when(F.col("party") != "callee", 1).otherwise(0)).alias("from_broker"),
    )
    tables["errors_by_code"] = by_code
    fig["errors_by_code"] = _top(by_code, top, desc("errors"), "code")
    by_party = (
        errors.groupBy("code", "party", "broker_instance", "sender", "sender_name", "on_behalf_of")
        .agg(F.count("*").alias("errors"))
        .persist()
    )
    tables["errors_by_party"] = by_party
    fig["errors_by_party"] = _top(
        by_party, top, desc("errors"), "code", "party", "broker_instance", "sender", "on_behalf_of"
    )

    step("capture: slow consumers")
    slow = slow_consumer_signals(df)
    tables["slow_consumers_per_second"] = slow
    per_client = (
        slow.groupBy("signal", "broker_instance", "client")
        .agg(
            F.sum("count").alias("count"),
            F.min("second").alias("first_second"),
            F.max("second").alias("last_second"),
        )
        .persist()
    )
    tables["slow_consumers"] = per_client
    fig["slow_consumers"] = _top(
        per_client, top, desc("count"), "signal", "broker_instance", "client"
    )
    fig["slow_consumer_signals"] = _rows(
        per_client.groupBy("signal")
        .agg(F.sum("count").alias("count"), F.count("*").alias("clients"))
        .orderBy("signal")
    )
    return tables, fig


def latency_overall(pairs: DataFrame) -> DataFrame:
    """One row over every callee reply: replies, p50/p95/p99/max latency in ms."""
    from pyspark.sql import functions as F

    return pairs.agg(
        F.count("*").alias("replies"),
        F.percentile_approx("latency_ms", [0.5, 0.95, 0.99], PERCENTILE_ACCURACY).alias("p"),
        F.max("latency_ms").alias("max_ms"),
    ).select(
        "replies",
        F.col("p")[0].alias("p50_ms"),
        F.col("p")[1].alias("p95_ms"),
        F.col("p")[2].alias("p99_ms"),
        "max_ms",
    )


def slow_consumer_signals(df: DataFrame) -> DataFrame:
    """Per second, broker instance and client: what the capture shows of slow consumers.
    Signals:
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
        .when(
            (F.col("kind") == "membership")
            & (F.col("event") == "disconnected")
            & (reason == "slow-consumer"),
            F.lit("slow-consumer"),
        )
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
        df.withColumn("signal", signal)
        .where(F.col("signal").isNotNull())
        .groupBy("second", "signal", "broker_instance", client.alias("client"))
        .agg(F.sum(amount).alias("count"))
    )
