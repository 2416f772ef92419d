"""The backlog benchmark's harness measures what it claims: a real broker and queue
plugin, a SIGKILL, a restart on the same store, a drain that checks every message."""

from __future__ import annotations

from pathlib import Path

from msgq_trio.bench.backlog import run_backlog
from msgq_trio.bench.run import render, run_bench


def test_backlog_harness_fills_restarts_and_drains(tmp_path: Path) -> None:
    n = 20_000
    res = run_backlog(n, 1024, tmp_path / "run")
    assert res["messages"] == n and res["depth_after"] == 0
    # 20 MiB of bodies went through the store file, which outlives the SIGKILL
    assert res["store_gib"] * (1 << 30) > n * 1024
    assert res["fill_peak_rss_mib"] > 0 and res["drain_rss_mib"] > 0
    assert res["restart_with_backlog_s"] > 0 and res["drain_msgs_per_s"] > 0
    assert not (tmp_path / "run").exists()


def test_backlog_section_in_the_report() -> None:
    report = run_bench(
        [],
        [],
        quick=True,
        repeat=1,
        timeout=60,
        install=False,
        say=lambda _line: None,
        sections=["backlog"],
        backlog_messages=5_000,
    )
    assert report["backlog"]["status"] == "ok", report["backlog"]
    assert report["backlog"]["messages"] == 5_000
    assert "backlog: 5,000 x 1024 B" in render(report)
