"""The benchmark harness runs end to end with tiny counts (the full run is not a test)."""

from __future__ import annotations

from msgq_trio.bench.run import smoke
from msgq_trio.bench.workloads import WORKLOADS


def test_bench_smoke_measures_every_workload() -> None:
    """Quick mode measures every workload for msgq_trio and the raw-socket ceiling, each
    figure positive, so `msgq-trio bench` cannot rot unnoticed."""
    report = smoke()
    for system in ("msgq_trio", "raw-unix"):
        for workload in WORKLOADS:
            result = report["results"][system][workload]
            if result["status"] == "n/a" and system != "msgq_trio":
                continue  # a workload a ceiling does not implement
            assert result["status"] == "ok", (system, workload, result)
            assert result["median"] > 0, (system, workload, result)
