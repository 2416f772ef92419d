"""``msgq-trio analyze scenarios`` on real scenario results: a small scenario is run twice
by the runner (real broker, real client processes) and its records are the baseline;
the current set is the same two records as a later version would report them with one
run failing and broker RSS 40 MiB higher. The report must show the pass rates, the
distributions and exactly those regressions."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from analytics_helpers import cell, drawn, nearest_rank, parse_report, table_rows

from msgq_trio.scenario.runner import run_scenario

TINY = """
summary = "A publisher and a subscriber for half a second."
fault = "none"
broker_does = "routes"
timeout = 30
key_figures = ["sub.received"]
[[clients]]
name = "sub"
role = "subscriber"
[[clients]]
name = "pub"
role = "publisher"
params = { rate = 200.0, duration = 0.5 }
[expect.counts]
"sub.received" = "== pub.sent"
"""


@pytest.fixture(scope="module")
def results(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, Path, list[dict[str, Any]], list[dict[str, Any]]]:
    """(baseline.jsonl, current.jsonl, baseline records, current records)."""
    d = tmp_path_factory.mktemp("results")
    sc = d / "tiny.toml"
    sc.write_text(TINY)
    base = []
    for _ in range(2):
        result = run_scenario(sc)
        assert result.passed, result.explain()
        base.append(result.record())
    cur = copy.deepcopy(base)
    for r in cur:
        r["msgq_trio_version"] = "0.2.0"
        r["metrics"]["broker.rss_peak_mib"] += 40.0
    cur[1]["passed"] = False
    cur[1]["checks"][0]["ok"] = False
    (d / "baseline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in base))
    (d / "current.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cur))
    return d / "baseline.jsonl", d / "current.jsonl", base, cur


def _dist(records: list[dict[str, Any]], metric: str) -> dict[str, float]:
    v = [r["metrics"][metric] for r in records]
    return {"min": min(v), "p50": nearest_rank(v, 0.5), "max": max(v)}


def test_scenario_report_pass_rates_distributions_regressions(
    spark: Any, results: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from msgq_trio.cli import main

    baseline, current, base, cur = results
    out = tmp_path / "report"
    assert (
        main(["analyze", "scenarios", str(current), "--baseline", str(baseline), "--out", str(out)])
        == 0
    )
    std = capsys.readouterr()
    assert "regressions: 1" in std.out and "scenarios: per scenario" in std.err
    fig = json.loads((out / "summary.json").read_text())

    assert {
        r["result_set"]: (r["runs"], r["passed"], r["scenarios"], r["versions"])
        for r in fig["totals"]
    } == {"baseline": (2, 2, 1, 1), "current": (2, 1, 1, 1)}
    per = {r["result_set"]: r for r in fig["per_scenario"]}
    for name, records in (("baseline", base), ("current", cur)):
        row = per[name]
        assert row["scenario"] == "tiny" and row["runs"] == 2
        assert row["pass_rate"] == (1.0 if name == "baseline" else 0.5)
        for metric, key in (
            ("broker.rss_peak_mib", "rss_peak_mib"),
            ("latency.p99_ms", "latency_p99_ms"),
        ):
            d = _dist(records, metric)
            assert (row[f"{key}_min"], row[f"{key}_p50"], row[f"{key}_max"]) == (
                d["min"],
                d["p50"],
                d["max"],
            ), (name, metric)
    assert {(r["result_set"], r["version"]) for r in fig["per_version"]} == {
        ("baseline", base[0]["msgq_trio_version"]),
        ("current", "0.2.0"),
    }
    assert fig["failed_checks"] == [
        {
            "result_set": "current",
            "scenario": "tiny",
            "check": cur[1]["checks"][0]["check"],
            "failures": 1,
        }
    ]
    (reg,) = fig["regressions"]
    assert reg["regression"] == "pass-rate,rss"
    assert reg["rss_peak_mib_p50_current"] == reg["rss_peak_mib_p50_baseline"] + 40.0
    assert reg["latency_p99_ms_p50_current"] == reg["latency_p99_ms_p50_baseline"]

    doc = parse_report(out / "report.html")
    (shown,) = table_rows(doc, "regressions")
    assert shown["regression"] == "pass-rate,rss"
    assert shown["pass_rate_current"] == cell(0.5) and shown["pass_rate_baseline"] == cell(1.0)
    rows = {r["result_set"]: r for r in table_rows(doc, "per-scenario")}
    assert rows["current"]["rss_peak_mib_p50"] == cell(per["current"]["rss_peak_mib_p50"])
    assert rows["baseline"]["latency_p99_ms_max"] == cell(per["baseline"]["latency_p99_ms_max"])
    # one box per (scenario, result set) in each matplotlib box chart
    assert drawn(doc, "box-rss_peak_mib", "series") == ["0", "1"]
    assert drawn(doc, "box-latency_p99_ms", "series") == ["0", "1"]
    assert spark.read.parquet(str(out / "tables" / "regressions")).count() == 1
    table = spark.read.parquet(str(out / "tables" / "per_scenario"))
    assert table.count() == 2


def test_scenario_report_without_baseline(spark: Any, results: Any, tmp_path: Path) -> None:
    """One set: no regressions table; pass rate over every run given."""
    from msgq_trio.analytics.cli import run_scenarios

    baseline, current, _, _ = results
    fig = run_scenarios(spark, [str(baseline), str(current)], tmp_path)
    assert "regressions" not in fig
    (row,) = fig["per_scenario"]
    assert (row["runs"], row["passed"], row["pass_rate"], row["versions"]) == (4, 3, 0.75, 2)
    doc = parse_report(tmp_path / "report.html")
    assert not [t for t in doc.iter("table") if t.get("id") == "regressions"]
    assert table_rows(doc, "per-scenario")[0]["pass_rate"] == cell(0.75)
