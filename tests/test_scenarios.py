"""Fault scenarios (scenarios/*.toml) run by the scenario runner, one test each.

Each test starts a real broker process and real client processes (see
msgq_trio/scenario/runner.py); scenarios with ``slow = true`` carry the ``slow`` marker.
``MSGQ_TRIO_SCENARIO_RESULTS=path.jsonl`` appends every run's JSON record to that file.

Also here: the scenario file validation (errors name the key), the check expressions and
the ``msgq-trio scenario`` command line (exit status, JSON Lines record, FAULTS.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from msgq_trio.scenario import cli as scenario_cli
from msgq_trio.scenario.model import ScenarioError, is_slow, load_scenario
from msgq_trio.scenario.report import faults_markdown
from msgq_trio.scenario.runner import _evaluate_expr, run_scenario

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"
SCENARIOS = sorted(SCENARIO_DIR.glob("*.toml"))


def _param(path: Path) -> object:
    marks = [pytest.mark.slow] if is_slow(path) else []
    return pytest.param(path, id=path.stem, marks=marks)


def test_there_are_enough_scenarios() -> None:
    assert len(SCENARIOS) >= 15


@pytest.mark.parametrize("path", [_param(p) for p in SCENARIOS])
def test_scenario(path: Path) -> None:
    result = run_scenario(path)
    out = os.environ.get("MSGQ_TRIO_SCENARIO_RESULTS")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(result.record()) + "\n")
    assert result.passed, result.explain()


# -- scenario files: validation ------------------------------------------------------------------
MINIMAL = """
summary = "s"
fault = "f"
broker_does = "b"
[[clients]]
name = "sub"
role = "subscriber"
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "sc.toml"
    p.write_text(text)
    return p


def test_every_scenario_file_is_valid() -> None:
    for p in SCENARIOS:
        sc = load_scenario(p)
        assert sc.name == p.stem
        assert sc.summary and sc.fault and sc.broker_does


def test_minimal_scenario_gets_defaults(tmp_path: Path) -> None:
    sc = load_scenario(_write(tmp_path, MINIMAL))
    (c,) = sc.clients
    assert c.params["group"] == "Feed" and c.params["reconnect"] is False
    assert c.healthy and sc.expect.fds_baseline and not sc.slow


@pytest.mark.parametrize(
    ("extra", "where"),
    [
        (
            "[broker]\nflags = { out-soft-limt = 1 }",
            "broker.flags.out-soft-limt: unknown serve flag",
        ),
        (
            '[broker]\nflags = { out-soft-limit = "2 MiB", out-hard-limit = "1 MiB" }',
            "broker.flags: the broker would refuse them",
        ),
        (
            '[[clients]]\nname = "p"\nrole = "publisher"\nparams = { rate = "fast" }',
            "clients[1].params.rate: expected int/float",
        ),
        (
            '[[clients]]\nname = "p"\nrole = "publisher"\nparams = { speed = 1 }',
            "clients[1].params.speed: unknown key",
        ),
        ('[[clients]]\nname = "p"\nrole = "teleporter"', "clients[1].role: unknown role"),
        ('[[clients]]\nname = "sub"\nrole = "subscriber"', "duplicate client name"),
        (
            '[[faults]]\nat = 1\naction = "sigkill"\ntarget = "nobody"',
            "faults[0].target: no client named 'nobody'",
        ),
        (
            '[[faults]]\nat = 1\naction = "sigkill"\ntarget = "sub#3"',
            "faults[0].target: 'sub' has only 1 process(es)",
        ),
        ('[[faults]]\nat = 1\naction = "explode"', "faults[0].action: unknown action"),
        ('[[faults]]\naction = "kill-broker"', "faults[0].at: required key is missing"),
        ('[expect.counts]\n"sub.received" = "about 5"', "expect.counts.'sub.received'"),
        ('[expect.counts]\n"nobody.x" = 1', "unknown metric namespace 'nobody'"),
        ("[expect]\nrss_max = 5", "expect.rss_max: unknown key"),
        ('colour = "blue"', "colour: unknown key"),
    ],
)
def test_invalid_scenarios_name_the_key(tmp_path: Path, extra: str, where: str) -> None:
    with pytest.raises(ScenarioError) as info:
        load_scenario(_write(tmp_path, MINIMAL + "\n" + extra + "\n"))
    assert where in str(info.value)
    assert str(tmp_path / "sc.toml") in str(info.value)


def test_unreadable_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.toml")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(_write(tmp_path, "summary = "))
    with pytest.raises(ScenarioError, match="summary: required key is missing"):
        load_scenario(_write(tmp_path, "fault = 'x'"))


def test_expressions() -> None:
    m = {"pub.sent": 10.0, "fault.kill.at_ms": 1000.0}
    clients = {"pub", "sub"}
    assert _evaluate_expr("pub.sent * 2 + 1", m, clients) == 21
    assert _evaluate_expr("fault.kill.at_ms + 200 - pub.sent / 2", m, clients) == 1195
    assert _evaluate_expr("sub.err.timeout", m, clients) == 0  # a count never reported
    with pytest.raises(KeyError):
        _evaluate_expr("sub.latency.p99_ms", m, clients)  # not a count: must exist
    with pytest.raises(KeyError):
        _evaluate_expr("broker.nonsense", m, clients)


# -- the command line --------------------------------------------------------------------------
TINY = """
summary = "A publisher and a subscriber for one second."
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


def test_cli_run_writes_records_and_faults_md(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ok = tmp_path / "tiny.toml"
    ok.write_text(TINY)
    bad = tmp_path / "tiny-fails.toml"
    bad.write_text(TINY.replace('"== pub.sent"', '"== pub.sent + 1"'))
    results = tmp_path / "results.jsonl"
    md = tmp_path / "FAULTS.md"
    status = scenario_cli.main(
        ["run", str(ok), str(bad), "--results", str(results), "--faults-md", str(md)]
    )
    out = capsys.readouterr().out
    assert status == 1
    assert "PASS  tiny " in out and "FAIL  tiny-fails " in out
    assert "check failed: sub.received == pub.sent + 1" in out
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["passed"] for r in records] == [True, False]
    rec = records[0]
    for key in (
        "schema",
        "scenario",
        "msgq_trio_version",
        "machine",
        "metrics",
        "checks",
        "clients",
        "faults",
        "key_figures",
        "started_at",
        "duration_s",
        "problems",
    ):
        assert key in rec
    assert set(rec["machine"]) >= {"hostname", "nproc", "cpu_model", "python"}
    assert rec["metrics"]["sub.received"] == rec["metrics"]["pub.sent"] > 0
    assert rec["metrics"]["broker.fds_end"] == rec["metrics"]["broker.fds_baseline"]
    text = md.read_text()
    assert "| [tiny](" in text and "**FAIL**" in text and "## Result records" in text
    assert faults_markdown(records) == text


def test_cli_usage_and_invalid_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert scenario_cli.main(["run"]) == 2
    bad = _write(tmp_path, "summary = 1")
    assert scenario_cli.main(["run", str(bad)]) == 2
    assert scenario_cli.main(["check", str(bad)]) == 2
    assert scenario_cli.main(["check", *map(str, SCENARIOS)]) == 0
    assert scenario_cli.main(["list", "--dir", str(SCENARIO_DIR)]) == 0
    assert "callee-sigkill-mid-call" in capsys.readouterr().out
