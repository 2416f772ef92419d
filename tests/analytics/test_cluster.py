"""The capture analysis on a real multi-process cluster and through URIs.

One synthetic capture (msgq_trio.analytics.bench.generate: seeded, 300 short-lived
connections, one broker restart) is analysed twice: in this process on ``local[*]`` with
plain paths, and by ``spark-submit --master local-cluster[2,1,1024]`` (a driver and two
executor JVMs, the documented cluster command) with ``file://`` URIs for input and
output and ``--conf`` settings. Every figure must be the same. An ``hdfs://`` output
must reach Spark as it was given.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from analytics_helpers import TEST_JVM_OPTIONS

from msgq_trio.analytics import submit
from msgq_trio.analytics.bench import generate

RECORDS, CONNECTIONS, RESTARTS = 3000, 300, 1
#: Figures that name where the data came from or went, not what it says.
WHERE = ("sources", "source_count", "out", "files", "spark")


@pytest.fixture(scope="module")
def capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cluster") / "capture"
    generate(d, RECORDS, seed=25, connections=CONNECTIONS, restarts=RESTARTS)
    return d


@pytest.fixture(scope="module")
def local_figures(
    spark: Any, capture: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    from msgq_trio.analytics.cli import run_capture

    assert spark.sparkContext.master == "local[*]"
    out = tmp_path_factory.mktemp("local-out")
    fig = run_capture(spark, [str(capture)], str(out), top=5)
    return json.loads(json.dumps(fig, default=str))  # as summary.json has them


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in sorted(set(a) | set(b)):
        if key not in WHERE:
            assert a.get(key) == b.get(key), key


def spark_submit() -> str:
    """pyspark's spark-submit beside this Python (the README installs pyspark into the
    venv), else the one on PATH (a venv that sees pyspark in the system's packages)."""
    beside = Path(sys.executable).parent / "spark-submit"
    if beside.exists():
        return str(beside)
    found = shutil.which("spark-submit")
    if found is None:
        pytest.fail(f"no spark-submit beside {sys.executable} nor on PATH (is pyspark installed?)")
    return found


def test_local_cluster_via_spark_submit_gives_the_same_figures(
    capture: Path, local_figures: dict[str, Any], tmp_path: Path
) -> None:
    """spark-submit on two executor JVMs, file:// URIs in and out: exit 0, no ERROR
    lines (the session is stopped, so no executor relaunch at exit), every figure equal
    to the local run's, and the per-key tables written by Spark are complete."""
    out = tmp_path / "cluster-out"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    env.pop("PYSPARK_GATEWAY_PORT", None)
    argv = [
        spark_submit(),
        "--master",
        "local-cluster[2,1,1024]",
        "--conf",
        "spark.driver.memory=512m",
        "--conf",
        "spark.sql.shuffle.partitions=3",
        # the executor JVMs' JIT as the driver's (tests/analytics/conftest.py)
        "--conf",
        f"spark.executor.extraJavaOptions={TEST_JVM_OPTIONS}",
        submit.__file__,
        "capture",
        capture.as_uri(),
        "--out",
        out.as_uri(),
        "--top",
        "5",
        "--quiet",
    ]
    r = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    errors = [line for line in r.stderr.splitlines() if " ERROR " in line]
    assert not errors, "\n".join(errors[:20])
    cluster = json.loads((out / "summary.json").read_text())
    assert cluster["out"] == out.as_uri()
    # spark-submit's master and --conf settings were used, not the package's defaults
    assert cluster["spark"]["master"] == "local-cluster[2,1,1024]"
    assert cluster["spark"]["shuffle_partitions"] == "3"
    assert cluster["spark"]["driver_memory"] == "512m"
    _same(cluster, local_figures)
    assert cluster["broker_instances"] == RESTARTS + 1
    assert cluster["requests"]["total"] > 0 and cluster["latency"]
    # the driver got top-5 lists; the full per-connection table is Spark's Parquet
    assert len(cluster["top_senders"]) == 5
    import pyarrow.parquet as pq

    senders = pq.read_table(out / "tables" / "senders").to_pylist()
    assert len(senders) == len({(s["broker_instance"], s["sender"]) for s in senders})
    assert len(senders) > CONNECTIONS
    assert sum(s["frames"] for s in senders) == sum(r["frames"] for r in cluster["per_kind"])
    assert (out / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_file_uris_in_and_out(
    spark: Any, capture: Path, local_figures: dict[str, Any], tmp_path: Path
) -> None:
    """``msgq-trio analyze capture file:///... --out file:///...`` in this process: the
    same figures as plain paths, the report and tables at the URI's path."""
    from msgq_trio.analytics.cli import main

    out = tmp_path / "uri-out"
    assert main(["capture", capture.as_uri(), "--out", out.as_uri(), "--top", "5", "--quiet"]) == 0
    fig = json.loads((out / "summary.json").read_text())
    _same(fig, local_figures)
    assert fig["sources"][0].startswith("file:///") and fig["out"] == out.as_uri()
    # the driver got the first 5 senders; the table Spark wrote has every connection
    assert len(fig["top_senders"]) == 5
    assert spark.read.parquet(str(out / "tables" / "senders")).count() > CONNECTIONS
    assert list((out / "tables" / "requests").glob("part-*.parquet"))
    assert (out / "report.html").exists()


async def test_hdfs_output_uri_reaches_spark_unchanged(
    spark: Any, capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An hdfs:// output is handed to Spark's file system layer as given: it fails on the
    name node's host (nothing there), naming it, with exit status 4; a path that had
    gone through pathlib would have become ``hdfs:/nn...`` (no host)."""
    from msgq_trio.analytics.cli import main

    uri = "hdfs://nn.invalid:8020/reports/run-1"
    status = await trio.to_thread.run_sync(
        lambda: main(["capture", str(capture), "--out", uri, "--quiet"])
    )
    err = capsys.readouterr().err
    assert status == 4, err
    assert f"write {uri}:" in err
    reason = err.split(f"write {uri}:", 1)[1]
    assert "nn.invalid" in reason and "hdfs:/nn" not in err
