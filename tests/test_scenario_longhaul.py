"""Long-haul scenarios, run small: the soak (``[soak]``, msgq_trio/scenario/soak.py:
the fault schedule drawn from the pool, the RSS/fds flatness verdict,
scenarios/soak-mixed-60min.toml run for 20 s) and the million hostile frames
(scenarios/hostile-frames-1m.toml with a few hundred), by the real runner (a real
broker, real clients, real faults).

The full runs are not part of the suite: docs/FAULTS.md ("Long-haul runs") records
them with their commands.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from msgq_trio.scenario import cli as scenario_cli
from msgq_trio.scenario.model import ScenarioError, load_scenario, with_params
from msgq_trio.scenario.runner import run_scenario
from msgq_trio.scenario.soak import expand, flatness, scaled, schedule

SOAK = Path(__file__).resolve().parent.parent / "scenarios" / "soak-mixed-60min.toml"
#: Seconds of traffic of the short run: three faults strike (3, 6 and 9 s).
SHORT = 12.0


def test_schedule_is_seeded_and_undoes_what_it_stops() -> None:
    spec = load_scenario(SOAK).soak
    assert spec is not None
    assert spec.duration == 3600 and spec.fault_every == 30
    a, b = schedule(spec, 7), schedule(spec, 7)
    assert a == b
    assert schedule(spec, 8) != a
    main = [f for f in a if not f.name.endswith(("-sigcont", "-cont-broker", "-clear"))]
    # One fault every 30 s while at least 15 s of traffic remain after it.
    assert [f.at for f in main] == [30.0 * n for n in range(1, 120)]
    assert len({f.action + str(f.target) + str(f.proxy) for f in main}) >= 10
    by_name = {f.name: f for f in a}
    for f in main:
        n = f.name.split("-", 1)[0]
        if f.action == "sigstop":
            undo = by_name[f"{n}-sigcont"]
            assert (undo.target, undo.index, undo.at) == (f.target, f.index, f.at + 5)
        elif f.action == "stop-broker":
            assert by_name[f"{n}-cont-broker"].at == f.at + 5
        elif f.action == "net-proxy" and f.proxy != "clear":
            assert by_name[f"{n}-clear"].proxy == "clear"


def test_expand_sets_durations_and_counts() -> None:
    sc = expand(load_scenario(SOAK), seed=1, duration=100)
    assert sc.soak is not None and sc.soak.duration == 100
    assert sc.timeout == 100 + load_scenario(SOAK).timeout
    assert sc.client("pub").params["duration"] == 100
    assert sc.client("rpc").params["duration"] == 100
    # {count:10}: 10 a second over the duration.
    assert "1000" in sc.client("producer").params["command"]
    assert "1000" in sc.client("consumer").params["command"]
    # A short run keeps a reference and an end window, and several faults.
    assert sc.soak.warmup == sc.soak.window == 25
    assert len([f for f in sc.faults if f.at < 100]) >= 3


def _samples(growth: float, duration: float = 100.0) -> list[dict[str, float]]:
    """A sample a second; RSS rising linearly by ``growth`` over the run; a broker
    restart at t=50 whose first seconds are small (it must not count)."""
    out = []
    for t in range(int(duration)):
        age = t if t < 50 else t - 50
        rss = 40e6 * (1 + growth * t / duration)
        if t >= 50 and age < 5:
            rss = 10e6
        out.append({"t": t, "age": age, "rss_bytes": rss, "fds": 30, "connections": 10})
    return out


def test_flatness_compares_settled_medians() -> None:
    spec = scaled(load_scenario(SOAK).soak, 100)  # type: ignore[arg-type]
    flat = flatness(_samples(0.0), spec)
    assert flat["soak.rss_growth_pct"] == 0
    assert flat["soak.fds_growth_pct"] == 0
    leak = flatness(_samples(0.5), spec)
    assert leak["soak.rss_growth_pct"] > 10
    fds = _samples(0.0)
    for s in fds:
        s["fds"] += s["t"] // 10  # one descriptor more every 10 s
    assert flatness(fds, spec)["soak.fds_growth_pct"] > 10


def test_duration_is_for_soaks_only(tmp_path: Path) -> None:
    other = SOAK.parent / "garbage-frames.toml"
    with pytest.raises(ScenarioError, match="soak"):
        run_scenario(other, duration=5)
    bad = tmp_path / "bad.toml"
    bad.write_text(SOAK.read_text().replace('target = "sub#0"', 'target = "nobody"'))
    with pytest.raises(ScenarioError, match=r"soak\.faults\[0\]\.target"):
        load_scenario(bad)


@pytest.mark.slow
def test_soak_short_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The soak for SHORT seconds through the command line: every check passes (no acked
    message lost, no duplicate within a session, RSS and fds flat), the faults struck,
    and the checkpoint file has the samples as they were taken."""
    ck = tmp_path / "ck.jsonl"
    results = tmp_path / "r.jsonl"
    status = scenario_cli.main(
        [
            "run",
            str(SOAK),
            "--duration",
            str(SHORT),
            "--seed",
            "1",
            "--checkpoint",
            str(ck),
            "--results",
            str(results),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    rec = json.loads(results.read_text())
    m = rec["metrics"]
    assert m["soak.faults"] >= 3
    assert m["history.ok.send"] >= 1 and m["history.ok.deliver"] >= m["history.ok.send"]
    assert m["soak.rss_growth_pct"] < 10
    lines = [json.loads(x) for x in ck.read_text().splitlines()]
    assert len(lines) >= 10
    assert {"t", "pid", "age", "rss_bytes", "fds", "connections", "faults"} <= set(lines[0])
    assert "history_ops" in lines[0]
    assert lines[-1]["faults"] >= 3


HOSTILE = SOAK.parent / "hostile-frames-1m.toml"


def test_param_replaces_a_client_parameter() -> None:
    sc = load_scenario(HOSTILE)
    assert sc.long_haul and sc.client("garbage").params["repeat"] * 24 * 2 >= 1_000_000
    small = with_params(sc, ["garbage.repeat=5", "garbage.kinds=['mutated']"])
    assert small.client("garbage").params["repeat"] == 5
    assert small.client("garbage").params["kinds"] == ["mutated"]
    for bad, match in (
        ("garbage.repeat=-1", "must be >= 0"),
        ("garbage.repeat='many'", "expected int"),
        ("garbage.nope=1", "no parameter 'nope'"),
        ("nobody.repeat=1", "no client named"),
        ("repeat", "CLIENT.KEY=VALUE"),
    ):
        with pytest.raises(ScenarioError, match=match):
            with_params(sc, [bad])


@pytest.mark.slow
def test_hostile_frames_small() -> None:
    """The million-frame scenario with 5 rounds per garbage client (240 frames): every
    check holds (no crash, no hang, the bystanders' stream whole and in order, fds and
    tasks back to the baseline), and the bystanders stopped once the garbage was done."""
    result = run_scenario(HOSTILE, seed=3, params=["garbage.repeat=5"])
    assert result.passed, result.explain()
    m = result.metrics
    assert m["garbage.sent"] == 240
    assert m["sub.received"] == m["pub.sent"] > 0
    assert m["fault.pubstop.at_ms"] > 0


def test_regenerated_faults_md_keeps_the_long_haul_section(tmp_path: Path) -> None:
    """``report`` / ``run --faults-md`` rewrite FAULTS.md from records; the hand-written
    long-haul section (runs too long for the matrix) survives, once, before the guide."""
    rec = {
        "scenario": "tiny",
        "passed": True,
        "summary": "s",
        "fault": "f",
        "broker_does": "b",
        "metrics": {},
        "checks": [],
    }
    results = tmp_path / "r.jsonl"
    results.write_text(json.dumps(rec) + "\n")
    md = tmp_path / "FAULTS.md"
    section = "## Long-haul runs\n\nThe soak: `msgq-trio scenario run soak-mixed-60min`.\n"
    md.write_text("# old\n\n" + section + "\n## Running the scenarios\n\nold guide\n")
    for _ in range(2):
        assert scenario_cli.main(["report", str(results), "--faults-md", str(md)]) == 0
        text = md.read_text()
        assert text.count("## Long-haul runs") == 1
        assert "The soak: `msgq-trio scenario run soak-mixed-60min`." in text
        assert text.index("## Long-haul runs") < text.index("## Running the scenarios")
    assert "old guide" not in text


REPEATED_RESTARTS = """
summary = "A subscriber restarted three times."
fault = "restart x3"
broker_does = "nothing special"
timeout = 60

[[clients]]
name = "sub"
role = "subscriber"
params = { group = "Feed", reconnect = true }

[[clients]]
name = "pub"
role = "publisher"
params = { group = "Feed", rate = 200.0, duration = 2.5, reconnect = true }

[[faults]]
at = 0.5
action = "restart"
target = "sub#0"

[[faults]]
at = 1.0
action = "restart"
target = "sub#0"

[[faults]]
at = 1.5
action = "restart"
target = "sub"

[expect.counts]
"sub.restarts" = "== 3"
"sub.reports" = "== 1"
"""


def test_repeated_restarts_strike_the_current_process(tmp_path: Path) -> None:
    """A soak restarts the same client again and again: each ``restart`` replaces the
    process running now, not every process that ever ran under that name (which would
    double them at each restart)."""
    path = tmp_path / "restarts.toml"
    path.write_text(REPEATED_RESTARTS)
    result = run_scenario(path, seed=1)
    assert result.passed, result.explain()
    assert [len(f["pids"]) for f in result.faults] == [1, 1, 1]
