"""The scale workloads (benchmarks/scale.py) at tiny sizes: each produces its figures,
a system without wildcards is reported n/a rather than failed, and the command the docs
give runs. Behaviour only: no figure is compared with a speed."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks import run, scale

ROOT = Path(__file__).resolve().parents[2]

TINY: dict[str, dict[str, Any]] = {
    "calls": {"clients": 6, "active": 2, "rate": 100, "seconds": 0.5, "idle": 10},
    "fan-out": {"subs": 5, "n": 20},
    "routing": {"clients": 4, "per": 5, "wild": 0.2, "n": 100},
    "cost": {"clients": [5], "active": 2, "n": 100},
    "large-cold": {"n": 6, "cold": 3},
}


def positive(*values: Any) -> bool:
    return all(isinstance(v, (int, float)) and v > 0 for v in values)


def test_msgq_trio_calls_fan_out_and_large_cold(tmp_path: Path) -> None:
    res = scale.run_all(["calls", "fan-out", "large-cold"], ["msgq_trio"], TINY, 60, say=str)
    calls = res["calls"]["msgq_trio"]
    assert calls["status"] == "ok", calls
    for idle in ("idle=0", "idle=10"):
        c = calls[idle]
        assert c["errors"] == 0
        assert positive(c["p50_us"], c["p99_us"], c["p999_us"], c["calls_per_s"])
        assert c["p50_us"] <= c["p99_us"] <= c["p999_us"]
    fan = res["fan-out"]["msgq_trio"]
    assert fan["status"] == "ok", fan
    assert fan["delivered"] == fan["expected"] == 5 * 20
    assert positive(fan["deliveries_per_s"])
    assert fan["slowest_lag_ms"] >= 0
    large = res["large-cold"]["msgq_trio"]
    assert large["status"] == "ok", large
    assert large["messages"] == 6 and positive(large["cold_mb_s"], large["warm_mb_s"])
    # Page faults per message, cold and warm, for the broker and the receiver: counts.
    faults = [large[f"{p}_faults_{w}"] for p in ("broker", "receiver") for w in ("cold", "warm")]
    assert all(isinstance(f, float) and f >= 0 for f in faults), faults
    # A fresh receiver touches a 4 MiB body's pages at least once for its first messages.
    assert large["receiver_faults_cold"] > 0
    text = scale.tables(res)
    assert "### calls" in text and "msgq_trio idle=10" in text and "cold_mb_s" in text


def test_msgq_trio_routing_and_cost_curve(tmp_path: Path) -> None:
    res = scale.run_all(["routing", "cost"], ["msgq_trio"], TINY, 60, say=str)
    routing = res["routing"]["msgq_trio"]
    assert routing["status"] == "ok", routing
    literal = routing["wild=0%"]
    assert literal["subscriptions"] == 20 and literal["wildcards"] == 0
    assert positive(literal["routed_per_s"])
    # With wildcards: figures once the broker matches patterns, else n/a with the reason
    # (never a failure or a hang).
    wild = routing["wild=20%"]
    if wild.get("status") == "n/a":
        assert "pattern subscription" in wild["why"]
    else:
        assert wild["wildcards"] == 4 and positive(wild["routed_per_s"])
    curve = res["cost"]["msgq_trio"]
    assert curve["status"] == "ok", curve
    assert curve["5"]["delivered"] == 100
    if importlib.util.find_spec("matplotlib") is not None:
        written = scale.plot(res, tmp_path)
        assert [p.name for p in written] == ["scale-cost.png"]


@pytest.mark.skipif(
    shutil.which("nats-server") is None or importlib.util.find_spec("nats") is None,
    reason="needs nats-server and nats-py",
)
def test_nats_routes_the_wildcard_share() -> None:
    tiny = {**TINY, "routing": {**TINY["routing"], "wild": 0.4}}
    res = scale.run_all(["routing"], ["nats"], tiny, 60, say=str)
    wild = res["routing"]["nats"]["wild=40%"]
    assert wild["wildcards"] == 8 and positive(wild["routed_per_s"]), wild


@pytest.mark.skipif(importlib.util.find_spec("zmq") is None, reason="needs pyzmq")
def test_zeromq_where_it_has_the_pattern() -> None:
    """ZeroMQ through its proxy: fan-out and routing (prefix filters, the patterns as
    prefixes) on XSUB/XPUB, calls on ROUTER/DEALER with idle ZMTP connections; every
    message arrives (a publisher that sent before the subscriptions reached it would
    lose some, and the run would time out)."""
    workloads = ["fan-out", "routing", "cost", "calls", "large-cold"]
    res = scale.run_all(workloads, ["zeromq"], TINY, 60, say=str)
    fan = res["fan-out"]["zeromq"]
    assert fan["status"] == "ok", fan
    assert fan["delivered"] == fan["expected"] == 5 * 20
    routing = res["routing"]["zeromq"]
    assert routing["status"] == "ok", routing
    assert routing["wild=20%"]["wildcards"] == 4
    assert positive(routing["wild=0%"]["routed_per_s"], routing["wild=20%"]["routed_per_s"])
    cost = res["cost"]["zeromq"]
    assert cost["status"] == "ok", cost
    assert cost["5"]["delivered"] == 100
    calls = res["calls"]["zeromq"]
    assert calls["status"] == "ok", calls
    for idle in ("idle=0", "idle=10"):
        assert calls[idle]["errors"] == 0 and positive(calls[idle]["calls_per_s"])
    assert res["large-cold"]["zeromq"]["status"] == "n/a"


def test_the_documented_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run.main(["--scale", "--help"])
    assert exc.value.code == 0
    assert "--workloads" in capsys.readouterr().out
    assert run.main(["--scale", "--workloads", "nonsense"]) == 2
    assert run.main(["--scale", "--sizes", '{"nonsense": {}}']) == 2
    assert "python -m benchmarks --scale" in (ROOT / "BENCHMARKS.md").read_text()
    doc = (ROOT / "docs/bench/scale.md").read_text()
    assert "python -m benchmarks --scale" in doc
    for workload in scale.WORKLOADS:
        assert f"| `{workload}` |" in doc, workload
    for name, params in scale.FULL.items():
        assert name in scale.QUICK and params.keys() == scale.QUICK[name].keys()


def test_a_size_of_the_cost_curve_that_times_out_leaves_the_others(tmp_path: Path) -> None:
    """Each size runs on its own broker and is recorded on its own: one that times out (here
    every one, with no time at all) is a row with its status, and the tables and the plot
    still come out."""
    sizes = {"cost": {**TINY["cost"], "clients": [3, 5]}}
    res = scale.run_all(["cost"], ["msgq_trio"], sizes, 0.001, say=str)
    curve = res["cost"]["msgq_trio"]
    assert curve["status"] == "ok", curve
    for size in ("3", "5"):
        assert curve[size]["status"] == "timeout", curve
    assert "| msgq_trio 5 |" in scale.tables(res)
    if importlib.util.find_spec("matplotlib") is not None:
        scale.plot(res, tmp_path)  # no point to draw: no error either
