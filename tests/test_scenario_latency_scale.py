"""``--latency-scale``: the latency bounds of a scenario file, relaxed for a busy machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from msgq_trio.scenario.model import ScenarioError, load_scenario, with_latency_scale

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


def test_the_latency_bounds_are_multiplied_and_nothing_else() -> None:
    sc = load_scenario(SCENARIOS / "limit-frame-size.toml")
    assert sc.expect.latency_p99_ms == 100 and sc.expect.latency_max_ms == 1000
    scaled = with_latency_scale(sc, 5)
    assert scaled.expect.latency_p99_ms == 500
    assert scaled.expect.latency_max_ms == 5000
    assert scaled.expect.log == sc.expect.log
    assert scaled.expect.counts == sc.expect.counts
    assert scaled.clients == sc.clients
    assert with_latency_scale(sc, 1).expect == sc.expect


def test_an_unset_bound_stays_unset() -> None:
    sc = next(
        s
        for s in map(load_scenario, sorted(SCENARIOS.glob("*.toml")))
        if s.expect.latency_p99_ms is None
    )
    assert with_latency_scale(sc, 3).expect.latency_p99_ms is None


@pytest.mark.parametrize("scale", [0.5, 0.0, -1.0, float("nan")])
def test_a_scale_that_would_tighten_the_promise_is_refused(scale: float) -> None:
    sc = load_scenario(SCENARIOS / "limit-frame-size.toml")
    with pytest.raises(ScenarioError, match="at least 1"):
        with_latency_scale(sc, scale)


def test_the_cli_refuses_it_with_status_2() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "msgq_trio",
            "scenario",
            "run",
            "--latency-scale",
            "0.5",
            str(SCENARIOS / "limit-frame-size.toml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2, r
    assert "latency scale 0.5: must be at least 1" in r.stderr
