"""The backlog benchmark's harness measures what it claims: a real broker and queue
plugin, a SIGKILL, a restart on the same store, a drain that checks every message."""

from __future__ import annotations

from pathlib import Path

from benchmarks.backlog import run_backlog
from benchmarks.run import render, run_bench


def test_backlog_lives_on_disk_not_in_the_plugins_memory(tmp_path: Path) -> None:
    """What the README promises of the queue plugin (a 4 GiB backlog in 62 MiB of plugin
    memory), at a size a test can afford: a backlog of 200,000 x 1 KiB (195 MiB), larger
    than the bound, fills, survives a SIGKILL of the broker, and drains every message
    once and in order, while the plugin's peak RSS stays under 100 MiB while filling and
    its anonymous memory while draining too (a plugin holding the backlog in memory would
    need twice that). The mapped pages of the store it touched are released as it goes,
    so its whole RSS during the drain also stays under the backlog's size. The 4 GiB run
    and the restart time are benchmark figures (``python -m benchmarks.backlog
    --messages 4000000``, BENCHMARKS.md "Backlog"): a test asserts no speed."""
    n, size = 200_000, 1024
    res = run_backlog(n, size, tmp_path / "run")
    backlog_mib = n * size / (1 << 20)
    assert res["messages"] == n and res["depth_after"] == 0
    # the bodies went through the store file, which outlives the SIGKILL
    assert res["store_gib"] * (1 << 30) > n * size
    assert 0 < res["fill_peak_rss_mib"] < 100 < backlog_mib, res
    assert 0 < res["drain_rss_anon_mib"] < 100, res
    assert res["drain_rss_mib"] < backlog_mib, res
    assert res["restart_with_backlog_s"] > 0 and res["drain_msgs_per_s"] > 0
    assert not (tmp_path / "run").exists()


def test_backlog_section_in_the_report() -> None:
    """``--sections backlog`` runs the backlog through the harness and the report shows
    it with its message count and size."""
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
