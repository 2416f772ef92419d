"""The long-haul backlog run (benchmarks/longhaul_backlog.py), tiny: a 2 MiB backlog on
the power-loss disk (tests/storage/powerloss_fs.py) drained through one plugin SIGKILL
and one broker SIGKILL, each followed by a power loss. Real broker, real plugin, real
FUSE daemon; the 4 GiB run is recorded in docs/FAULTS.md ("Long-haul runs")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.longhaul_backlog import run_longhaul

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "storage"))
from powerloss_fs import fuse_missing

pytestmark = pytest.mark.skipif(fuse_missing() is not None, reason=str(fuse_missing()))


@pytest.mark.slow
def test_backlog_survives_kills_and_power_losses(tmp_path: Path) -> None:
    res = run_longhaul(0.002, 256 * 1024, 2, tmp_path / "run")
    assert res["violations"] == []
    assert res["passed"]
    assert res["acked"] == 8 and res["left_in_queue"] == 0
    assert res["kills"] == {"plugin": 1, "broker": 1}
    assert res["delivered"] >= res["acked"]
