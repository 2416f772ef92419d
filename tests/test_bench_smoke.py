"""The benchmark harness runs end to end with tiny counts (the full run is not a test).

One quick run (msgq_trio and the raw-socket ceiling, no peers, nothing installed) is
shared by the tests below; it takes 15-25 s on the 2-CPU machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from msgq_trio import cli
from msgq_trio.bench.run import smoke
from msgq_trio.bench.workloads import WORKLOADS


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return smoke()


def test_bench_smoke_measures_every_workload(report: dict[str, Any]) -> None:
    """Quick mode measures every workload for msgq_trio and the raw-socket ceiling, each
    figure positive, so `msgq-trio bench` cannot rot unnoticed."""
    for system in ("msgq_trio", "raw-unix"):
        for workload in WORKLOADS:
            result = report["results"][system][workload]
            if result["status"] == "n/a" and system != "msgq_trio":
                continue  # a workload a ceiling does not implement
            assert result["status"] == "ok", (system, workload, result)
            assert result["median"] > 0, (system, workload, result)


def test_bench_smoke_measures_the_msgq_only_figures(report: dict[str, Any]) -> None:
    """SIGKILL to recipient-gone, capture on/off and idle-client RSS are measured: every
    kill ends the pending call with recipient-gone, and the capture wrote a record for
    every message."""
    only = report["msgq_only"]
    assert set(only) == {"kill", "capture", "idle-50"}
    for key, summary in only.items():
        assert summary["status"] == "ok", (key, summary)
    kill = only["kill"]["runs"][0]
    assert kill["codes"] == {"recipient-gone": report["msgq_only_params"]["kills"]}
    assert kill["p99_us"] >= kill["p50_us"] > 0
    capture = only["capture"]["runs"][0]
    assert capture["on"] > 0 and capture["off"] > 0
    n = report["config"]["params"]["one-way"]["n"]
    assert capture["records_written"] + capture["records_dropped"] >= n
    idle = only["idle-50"]["runs"][0]
    assert idle["broker_rss_after_kib"] > 0


def test_bench_smoke_durable_rows_are_measured_or_na_with_a_reason(
    report: dict[str, Any],
) -> None:
    """The durable workload's msgq_trio rows are measured, or n/a with the reason when
    the queue plugin's harness is missing; no peer row runs without --peers."""
    durable = report["durable"]
    assert set(durable) == {"msgq_trio", "msgq_trio +consumer"}
    for row, summary in durable.items():
        if summary["status"] == "n/a":
            assert summary["reason"] == "queue plugin not available", (row, summary)
        else:
            assert summary["status"] == "ok", (row, summary)
            assert summary["median"] > 0


def test_cli_bench_takes_options_without_a_double_dash(
    report: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`msgq-trio bench --peers ...` reaches the bench parser as is (argparse's REMAINDER
    would reject an option as its first item); `--` in front still works."""
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report, default=str))
    assert cli.main(["bench", "--peers", "--no-install", "--render", str(path)]) == 0
    out = capsys.readouterr().out
    assert "msgq_trio only" in out and "durable acked publish" in out
    assert cli.main(["bench", "--", "--peers", "--render", str(path), "--markdown"]) == 0
    assert "| msgq_trio |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--peers", "--no-such-option"])
    assert exc.value.code == 2
