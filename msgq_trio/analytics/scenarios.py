"""Scenario results analysis (record format: ``ScenarioResult.record()``, docs/FAULTS.md).

Per scenario and result set (``current``, and ``baseline`` when given): runs, pass rate,
the distribution (min, p25, p50, p75, max) of broker RSS peak, of the healthy clients'
p99 latency and of the run's duration, per msgq_trio version too; the checks that failed
and how often; and, with a baseline, the regressions of the current set against it.

A regression is, for a scenario present in both sets: a lower pass rate; a median broker
RSS peak more than ``rss_ratio`` (default 20 %) and 2 MiB above the baseline's; a median
p99 latency more than ``latency_ratio`` (default 50 %) and 1 ms above the baseline's.
Medians are ``percentile_approx`` (exact below 10,000 runs per scenario).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .capture import PERCENTILE_ACCURACY, expand_paths
from .storage import is_local

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

#: metrics key -> report name of the figures whose distributions are reported
FIGURES = {
    "broker.rss_peak_mib": "rss_peak_mib",
    "latency.p99_ms": "latency_p99_ms",
    "scenario.duration_s": "duration_s",
}
RSS_MIN_DELTA_MIB = 2.0
LATENCY_MIN_DELTA_MS = 1.0


def record_schema() -> Any:
    """The Spark schema of the fields of a result record this analysis reads."""
    from pyspark.sql import types as T

    s, d = T.StringType(), T.DoubleType()
    check = T.StructType(
        [
            T.StructField("check", s),
            T.StructField("expected", s),
            T.StructField("actual", s),
            T.StructField("ok", T.BooleanType()),
        ]
    )
    return T.StructType(
        [
            T.StructField("schema", s),
            T.StructField("scenario", s),
            T.StructField("file", s),
            T.StructField("passed", T.BooleanType()),
            T.StructField("started_at", s),
            T.StructField("duration_s", d),
            T.StructField("msgq_trio_version", s),
            T.StructField("machine", T.MapType(s, s)),
            T.StructField("metrics", T.MapType(s, d)),
            T.StructField("key_figures", T.MapType(s, d)),
            T.StructField("checks", T.ArrayType(check)),
            T.StructField("problems", T.ArrayType(s)),
        ]
    )


def read_results(spark: SparkSession, paths: Sequence[str], result_set: str) -> DataFrame:
    """The records of ``paths`` (JSON Lines files, directories of ``*.jsonl``, globs),
    with column ``result_set`` and ``version`` (msgq_trio_version, ``unknown`` if
    absent). Lines that are not records (no ``scenario``) are dropped."""
    from pyspark.sql import functions as F

    uris = expand_paths(paths)
    reader = spark.read.schema(record_schema()).option("mode", "PERMISSIVE")
    if not all(is_local(u) for u in uris):  # a remote directory: its *.jsonl files
        reader = reader.option("pathGlobFilter", "*.jsonl")
    df = reader.json(uris)
    return (
        df.where(F.col("scenario").isNotNull())
        .withColumn("result_set", F.lit(result_set))
        .withColumn("version", F.coalesce(F.col("msgq_trio_version"), F.lit("unknown")))
    )


def _quantiles(col: Column, name: str) -> list[Column]:
    from pyspark.sql import functions as F

    q = F.percentile_approx(col, [0.25, 0.5, 0.75], PERCENTILE_ACCURACY)
    return [
        F.min(col).alias(f"{name}_min"),
        q[0].alias(f"{name}_p25"),
        q[1].alias(f"{name}_p50"),
        q[2].alias(f"{name}_p75"),
        F.max(col).alias(f"{name}_max"),
    ]


def per_scenario(df: DataFrame, keys: Sequence[str]) -> DataFrame:
    """Per ``keys`` (e.g. result_set, scenario): runs, passed, pass_rate and the
    distribution of each of :data:`FIGURES`."""
    from pyspark.sql import functions as F

    aggs = [
        F.count("*").alias("runs"),
        F.sum(F.col("passed").cast("int")).alias("passed"),
        F.countDistinct("version").alias("versions"),
    ]
    for metric, name in FIGURES.items():
        aggs += _quantiles(F.col("metrics")[metric], name)
    return (
        df.groupBy(*keys)
        .agg(*aggs)
        .withColumn("pass_rate", F.round(F.col("passed") / F.col("runs"), 4))
        .orderBy(*keys)
    )


def failed_checks(df: DataFrame) -> DataFrame:
    """Per result set, scenario and check: how many runs failed it."""
    from pyspark.sql import functions as F

    return (
        df.select("result_set", "scenario", F.explode("checks").alias("c"))
        .where(~F.col("c.ok"))
        .groupBy("result_set", "scenario", F.col("c.check").alias("check"))
        .agg(F.count("*").alias("failures"))
        .orderBy(F.desc("failures"), "scenario", "check")
    )


def regressions(
    summary: DataFrame, rss_ratio: float = 0.2, latency_ratio: float = 0.5
) -> DataFrame:
    """Current vs baseline per scenario (``summary`` from :func:`per_scenario` keyed by
    result_set, scenario): both sets' pass rate and medians, and ``regression``: a
    comma-separated list of ``pass-rate``, ``rss``, ``latency`` (empty: none)."""
    from pyspark.sql import functions as F

    cols = ["scenario", "runs", "pass_rate", "rss_peak_mib_p50", "latency_p99_ms_p50"]
    cur = summary.where(F.col("result_set") == "current").select(
        *[F.col(c).alias(c if c == "scenario" else f"{c}_current") for c in cols]
    )
    base = summary.where(F.col("result_set") == "baseline").select(
        *[F.col(c).alias(c if c == "scenario" else f"{c}_baseline") for c in cols]
    )
    j = cur.join(base, "scenario", "inner")
    rss_c, rss_b = F.col("rss_peak_mib_p50_current"), F.col("rss_peak_mib_p50_baseline")
    lat_c, lat_b = F.col("latency_p99_ms_p50_current"), F.col("latency_p99_ms_p50_baseline")
    flags = F.array(
        F.when(F.col("pass_rate_current") < F.col("pass_rate_baseline"), F.lit("pass-rate")),
        F.when(
            (rss_c > rss_b * (1 + rss_ratio)) & (rss_c - rss_b > RSS_MIN_DELTA_MIB), F.lit("rss")
        ),
        F.when(
            (lat_c > lat_b * (1 + latency_ratio)) & (lat_c - lat_b > LATENCY_MIN_DELTA_MS),
            F.lit("latency"),
        ),
    )
    return j.withColumn("regression", F.concat_ws(",", flags)).orderBy("scenario")


def analyze_scenarios(
    current: DataFrame,
    baseline: DataFrame | None = None,
    *,
    rss_ratio: float = 0.2,
    latency_ratio: float = 0.5,
    step: Callable[[str], None] | None = None,
) -> tuple[dict[str, DataFrame], dict[str, Any]]:
    """The report's tables and figures. Every table is an aggregate per scenario (and
    version, check): small whatever the number of runs, so the figures hold them all;
    ``tables`` maps a table name to its DataFrame (for Spark to write), ``figures``
    holds their collected rows and the totals."""
    from pyspark.sql import functions as F

    step = step or current.sparkSession.sparkContext.setJobDescription
    df = current if baseline is None else current.unionByName(baseline)
    df = df.persist()
    fig: dict[str, Any] = {}
    step("scenarios: per scenario")
    summary = per_scenario(df, ["result_set", "scenario"])
    fig["per_scenario"] = [r.asDict() for r in summary.collect()]
    step("scenarios: per version")
    by_version = per_scenario(df, ["result_set", "scenario", "version"])
    fig["per_version"] = [r.asDict() for r in by_version.collect()]
    step("scenarios: totals")
    totals = (
        df.groupBy("result_set")
        .agg(
            F.count("*").alias("runs"),
            F.sum(F.col("passed").cast("int")).alias("passed"),
            F.countDistinct("scenario").alias("scenarios"),
            F.countDistinct("version").alias("versions"),
            F.min("started_at").alias("first_run"),
            F.max("started_at").alias("last_run"),
        )
        .orderBy("result_set")
        .collect()
    )
    fig["totals"] = [r.asDict() for r in totals]
    step("scenarios: failed checks")
    fails = failed_checks(df)
    fig["failed_checks"] = [r.asDict() for r in fails.collect()]
    if baseline is not None:
        step("scenarios: regressions")
        reg = regressions(summary, rss_ratio, latency_ratio)
        fig["regressions"] = [r.asDict() for r in reg.collect()]
    tables = {"per_scenario": summary, "per_version": by_version, "failed_checks": fails}
    if baseline is not None:
        tables["regressions"] = reg
    return tables, fig
