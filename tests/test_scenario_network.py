"""The fault runner's network topology: brokers listening on TCP/TLS, more brokers in
``[brokers.NAME]`` (optionally in a network namespace), the ``net-*`` faults, and how a
scenario this machine cannot run is reported (skipped with the reason, never passed).

The scenarios that use all this (tcp-broker-restart-reconnect, tls-callee-stalled-
heartbeat, link-netns-cut-restart, link-netns-lossy) run in tests/test_scenario_matrix_*.py.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from msgq_trio.scenario import cli as scenario_cli
from msgq_trio.scenario.model import ScenarioError, load_scenario
from msgq_trio.scenario.network import missing_tools
from msgq_trio.scenario.runner import run_scenario

HEAD = """
summary = "s"
fault = "f"
broker_does = "b"
[[clients]]
name = "sub"
role = "subscriber"
"""

TWO_BROKERS = (
    HEAD
    + """
[brokers.b]
listen = "tls"
netns = true
plugins = ["queue"]
tcp = { heartbeat_interval = 0.5 }

[[faults]]
at = 1
action = "net-netem"
target = "b"
netem = "delay 50ms 20ms loss 5%"

[[faults]]
at = 2
action = "restart-broker"
target = "b"
"""
)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "sc.toml"
    p.write_text(text)
    return p


def test_brokers_listen_and_net_faults_are_read(tmp_path: Path) -> None:
    sc = load_scenario(_write(tmp_path, TWO_BROKERS))
    b = sc.brokers["b"]
    assert (b.listen, b.netns, b.tcp, list(b.plugins)) == (
        "tls",
        True,
        {"heartbeat_interval": 0.5},
        ["queue"],
    )
    assert sc.broker.listen == "unix" and not sc.broker.netns
    assert [(f.action, f.target, f.netem) for f in sc.faults] == [
        ("net-netem", "b", "delay 50ms 20ms loss 5%"),
        ("restart-broker", "b", None),
    ]
    assert sc.needs_root == "broker 'b' runs in a network namespace"


@pytest.mark.parametrize(
    ("old", "new", "where"),
    [
        ('listen = "tls"', 'listen = "udp"', "brokers.b.listen: must be unix, tcp or tls"),
        ('listen = "tls"', 'listen = "tcp"', 'brokers.b.netns: needs listen = "tls"'),
        ("tcp = { heartbeat_interval = 0.5 }", 'tcp = { listen = ["0.0.0.0:1"] }', "tcp.listen"),
        ("tcp = { heartbeat_interval = 0.5 }", "tcp = { tokens = {} }", "the runner sets it"),
        ('target = "b"\nnetem', 'target = "c"\nnetem', "faults[0].target: 'net-netem' needs"),
        ('netem = "delay 50ms 20ms loss 5%"', "", "faults[0].netem: net-netem needs it"),
        ('netem = "delay 50ms 20ms loss 5%"', 'netem = "delay 1ms; rm -rf /"', "not a netem"),
        (
            'broker"\ntarget = "b"',
            'broker"\ntarget = "nobody"',
            "faults[1].target: no broker 'nobody'",
        ),
        ("[brokers.b]", "[brokers.b]\nqueue_disk = 8388608", "only the scenario's own broker"),
        ("[brokers.b]", "[broker]\nnetns = true\n[brokers.b]", "broker.netns: only the brokers"),
        ("[brokers.b]", "[broker]\ntcp = { heartbeat_misses = 2 }\n[brokers.b]", "broker.tcp"),
        ("[brokers.b]", "[brokers.b]\nspeed = 1", "brokers.b.speed: unknown key"),
    ],
)
def test_invalid_topologies_name_the_key(tmp_path: Path, old: str, new: str, where: str) -> None:
    assert old in TWO_BROKERS
    with pytest.raises(ScenarioError) as info:
        load_scenario(_write(tmp_path, TWO_BROKERS.replace(old, new, 1)))
    assert where in str(info.value)


TLS_ONLY = HEAD + '\n[broker]\nlisten = "tls"\n'


def test_a_scenario_the_machine_cannot_run_is_skipped_never_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without openssl on PATH a TLS scenario does not run: the result says why and has
    not passed; ``scenario run`` prints SKIP, exits 0 (nothing failed), writes no record
    to --results and a ``skipped`` testcase to --junit."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert missing_tools(tls=True, netns=False) == (
        "TLS needs the openssl command (Debian: openssl)"
    )
    p = _write(tmp_path, TLS_ONLY)
    result = run_scenario(p)
    assert result.skipped == "TLS needs the openssl command (Debian: openssl)"
    assert not result.passed and not result.failures
    assert result.line().startswith("SKIP")

    results, junit = tmp_path / "r.jsonl", tmp_path / "j.xml"
    status = scenario_cli.main(["run", str(p), "--results", str(results), "--junit", str(junit)])
    out = capsys.readouterr().out
    assert status == 0
    assert "SKIP  sc" in out and "0 passed, 0 failed, 1 skipped (sc)" in out
    assert not results.exists() or not results.read_text().strip()
    suite = ET.parse(junit).getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("1", "0", "1")
    (case,) = suite.findall("testcase")
    skipped = case.find("skipped")
    assert skipped is not None and "openssl" in (skipped.get("message") or "")


def test_the_runner_gives_tcp_clients_a_token_and_an_access_rule(tmp_path: Path) -> None:
    """A scenario broker listening on TCP: its clients connect with the run's token (a
    TCP client without a rule may do nothing but ping), publish and receive over TCP."""
    text = (
        HEAD.replace('role = "subscriber"', 'role = "subscriber"\nparams = { group = "G" }')
        + """
[broker]
listen = "tcp"

[[clients]]
name = "pub"
role = "publisher"
params = { group = "G", count = 50, rate = 500.0 }

[expect.counts]
"sub.received" = "== 50"
"pub.connections.tcp" = "== 1"
"sub.connections.tcp" = "== 1"
"""
    )
    result = run_scenario(_write(tmp_path, text))
    assert result.passed, result.explain()
