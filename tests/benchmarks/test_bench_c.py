"""The C client's benchmark row (msgq_trio-c) runs end to end with tiny counts.

libmsgq and its worker (clients/c/bench/msgq_bench.c) are built with meson into a
temporary directory, as the harness builds them on first use; a missing compiler or
meson fails these tests with the reason (as tests/c does), it never skips them.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import cbuild
from benchmarks.run import smoke
from benchmarks.workloads import QUICK

WORKLOADS = ("one-way", "fan-out", "req-reply", "concurrent")


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The msgq-bench of a fresh build (the harness's build cache pointed away)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MSGQ_BENCH_C_BUILD", str(tmp_path_factory.mktemp("bench-c") / "build"))
        cbuild.c_worker.cache_clear()
        try:
            yield cbuild.c_worker()
        finally:
            cbuild.c_worker.cache_clear()


@pytest.fixture(scope="module")
def report(worker: str) -> dict[str, Any]:
    return smoke(systems=("msgq_trio-c",), workloads=WORKLOADS, sections=("main",))


def test_c_row_measures_streams_and_calls(report: dict[str, Any]) -> None:
    """Every message the C publisher sends reaches every C subscriber once, every C
    call is answered by the C responder with its own request, and each figure is the
    one those counts and the measured span give, with client and broker CPU per
    message; a worker that reported nothing would leave the row without a status ok."""
    results = report["results"]["msgq_trio-c"]
    for workload in WORKLOADS:
        result = results[workload]
        assert result["status"] == "ok", (workload, result)
        (run,) = result["runs"]
        p = QUICK[workload]
        if workload in ("one-way", "fan-out"):
            assert run["received"] == [p["n"]] * p["subs"], run
            assert run["value"] == pytest.approx((sum(run["received"]) - 1) / run["span_seconds"])
        else:
            assert run["calls"] == p["calls"] * p["conc"] * p["procs"], run
            if workload == "req-reply":
                assert 0 < run["p50_us"] <= run["p99_us"] <= run["max_us"], run
                assert run["value"] == run["p50_us"]
            else:
                assert run["value"] == pytest.approx(run["calls"] / run["span_seconds"])
        cpu = run["cpu_us_per_unit"]
        assert cpu["clients"] > 0 and cpu["broker"] is not None, (workload, cpu)


@pytest.mark.parametrize(
    "spec",
    [
        "not json",
        "{}",
        '{"role": "sub", "addr": {"socket": "/nonexistent/bus.sock"}, '
        '"deadline": 2, "n": 1, "size": 10}',
        '{"role": "dance", "addr": {"socket": "x"}, "deadline": 2}',
    ],
)
def test_c_worker_reports_bad_spec_or_broker_as_error(worker: str, spec: str) -> None:
    """A spec the C worker cannot use, or a broker that is not there, ends the worker
    with status 1 and an ``error`` RESULT naming the problem (never a crash or silence)."""
    r = subprocess.run([worker, spec], capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), r.stdout
    assert json.loads(last[len("RESULT ") :])["error"], last


def test_worker_module_without_a_binary_reports_an_error(tmp_path: Path) -> None:
    """The Python entry point reports, as a RESULT, a spec that names no C worker or
    one that cannot be executed."""
    import sys

    for addr in ({}, {"c_worker": str(tmp_path / "missing")}):
        spec = json.dumps({"role": "sub", "addr": addr, "deadline": 2})
        r = subprocess.run(
            [sys.executable, "-m", "benchmarks.worker_msgq_c", spec],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
            cwd=cbuild.ROOT,
        )
        assert r.returncode != 0
        assert json.loads(r.stdout.split("RESULT ", 1)[1])["error"], r.stdout
