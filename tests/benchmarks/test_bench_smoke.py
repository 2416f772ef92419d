"""The benchmark harness runs end to end with tiny counts (the full run is not a test).

One quick run (msgq_trio's trio and direct clients and the raw-socket ceiling, no peers,
nothing installed) is shared by the tests below, the longest part of this file. The
asyncio clients (msgq_trio.aio, nats-py, redis.asyncio) have a quick run of their own,
and so do the durable workload's NATS and Redis producers; those need the servers
installed. RabbitMQ's are left out: its server's start (an Erlang node) would cost more
than the rest of the file.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import durable
from benchmarks.report import TIMES, asyncio_systems, cell, goal_table
from benchmarks.run import build_parser, main, render, smoke
from benchmarks.workloads import PUBSUB, QUICK, WORKLOADS
from msgq_trio import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return smoke()


def _check_counts_and_figure(workload: str, run: dict[str, Any]) -> None:
    """Every message or call the quick mode sends was received or answered exactly once,
    and the figure is the one computed from those counts and the measured span (what a
    benchmark that lost, duplicated or miscounted messages would get wrong)."""
    p = QUICK[workload]
    if WORKLOADS[workload].pattern == PUBSUB:
        assert run["received"] == [p["n"]] * p["subs"], run
        total, span = sum(run["received"]), run["span_seconds"]
        assert span > 0, run
        want = (p["n"] - 1) * p["size"] / span / 1e6 if workload == "large" else (total - 1) / span
    else:
        assert run["calls"] == p["calls"] * p["conc"] * p["procs"], run
        if workload == "req-reply":
            assert 0 < run["p50_us"] <= run["p99_us"] <= run["max_us"], run
            want = run["p50_us"]
        else:
            want = run["calls"] / run["span_seconds"]
    assert run["value"] == pytest.approx(want), (workload, run)


def test_bench_smoke_measures_every_workload(report: dict[str, Any]) -> None:
    """Quick mode measures every workload for msgq_trio and the raw-socket ceiling, so
    `python -m benchmarks` cannot rot unnoticed: every message arrives exactly once, every
    call is answered, and each figure (the median of the one run) is computed from those
    counts."""
    for system in ("msgq_trio", "raw-unix"):
        for workload in WORKLOADS:
            result = report["results"][system][workload]
            if result["status"] == "n/a" and system != "msgq_trio":
                continue  # a workload a ceiling does not implement
            assert result["status"] == "ok", (system, workload, result)
            (run,) = result["runs"]
            _check_counts_and_figure(workload, run)
            assert result["median"] == run["value"], (system, workload, result)


def test_bench_smoke_measures_the_direct_client(report: dict[str, Any]) -> None:
    """msgq_trio-direct (the blocking client) answers both request/reply workloads with
    every call checked, and is n/a (with its reason) on the streaming ones; the goal
    table names the direct client where its figure is the one compared."""
    results = report["results"]["msgq_trio-direct"]
    for workload in ("req-reply", "concurrent"):
        assert results[workload]["status"] == "ok", (workload, results[workload])
        _check_counts_and_figure(workload, results[workload]["runs"][0])
    for workload in ("one-way", "fan-out", "large"):
        assert results[workload]["status"] == "n/a", (workload, results[workload])
    rr = {n: report["results"][n]["req-reply"]["median"] for n in ("msgq_trio", "msgq_trio-direct")}
    rows = [line for line in goal_table(report).splitlines() if "req/reply" in line]
    assert ("(direct client)" in rows[0]) == (rr["msgq_trio-direct"] < rr["msgq_trio"]), rows
    assert "busy polling off" not in rows[0]


def test_bench_smoke_measures_the_def_handler_row(report: dict[str, Any]) -> None:
    """msgq_trio-def-handler (the trio responder's handler a plain ``def``, beside
    msgq_trio's ``async def``) answers both request/reply workloads with every call
    checked, and is n/a with its reason on the streaming ones."""
    results = report["results"]["msgq_trio-def-handler"]
    for workload in ("req-reply", "concurrent"):
        assert results[workload]["status"] == "ok", (workload, results[workload])
        _check_counts_and_figure(workload, results[workload]["runs"][0])
    for workload in ("one-way", "fan-out", "large"):
        assert results[workload]["status"] == "n/a", (workload, results[workload])
        assert "calls only" in results[workload]["reason"], results[workload]


def test_asyncio_table_needs_an_asyncio_peer_beside_msgq_trio() -> None:
    """The asyncio table holds the asyncio clients of the run, in run order, and only
    when an asyncio peer ran beside an asyncio client of msgq_trio's."""
    run = ["msgq_trio", "msgq_trio-asyncio", "redis", "nats", "redis-asyncio", "zeromq"]
    assert asyncio_systems(run) == ["msgq_trio-asyncio", "nats", "redis-asyncio"]
    assert asyncio_systems(["msgq_trio-asyncio", "msgq_trio-asyncio-def-handler"]) == []
    assert asyncio_systems(["msgq_trio", "nats", "redis-asyncio"]) == []
    # Its ratios are against the best asyncio peer, though a sync peer did better.
    results = {
        name: {"req-reply": {"status": "ok", "median": p50, "min": p50, "max": p50}}
        for name, p50 in (("msgq_trio-asyncio", 200.0), ("redis", 100.0), ("nats", 400.0))
    }
    assert cell(results, "msgq_trio-asyncio", "req-reply").endswith(f"(2.0{TIMES} redis)")
    assert cell(results, "msgq_trio-asyncio", "req-reply", asyncio=True).endswith(
        f"(0.5{TIMES} nats)"
    )


def test_bench_smoke_asyncio_clients_side_by_side() -> None:
    """The asyncio clients (msgq_trio.aio with an ``async def`` and a plain ``def``
    responder, nats-py, redis.asyncio) run every workload they are meant to with every
    message and call checked, and the report sets them side by side, each ratio against
    the best other asyncio peer. Needs nats-server and redis-server (installed for the
    suite: see the durable producer test)."""
    for binary in ("nats-server", "redis-server"):
        assert shutil.which(binary), f"{binary} is not installed (apt-get install {binary})"
    aio = ["msgq_trio-asyncio", "msgq_trio-asyncio-def-handler", "nats", "redis-asyncio"]
    report = smoke(systems=aio, sections=("main",))
    results = report["results"]
    for system in aio:
        for workload in WORKLOADS:
            result = results[system][workload]
            if system.endswith("-def-handler") and workload not in ("req-reply", "concurrent"):
                assert result["status"] == "n/a", (system, workload, result)
                continue
            assert result["status"] == "ok", (system, workload, result)
            _check_counts_and_figure(workload, result["runs"][0])
    text = render(report)
    assert "asyncio clients side by side" in text
    # The asyncio table repeats the main table's rows, and the ratio names the best
    # asyncio peer of the column (lowest p50 of nats and redis-asyncio).
    best = min(("nats", "redis-asyncio"), key=lambda n: results[n]["req-reply"]["median"])
    want = cell(results, "msgq_trio-asyncio", "req-reply", asyncio=True)
    assert f"{TIMES} {best})" in want, want
    # Counted by row: the def-handler row may show the same figure and ratio.
    rows = [line for line in text.splitlines() if line.startswith("msgq_trio-asyncio ")]
    assert sum(want in row for row in rows) == 2, text


def test_bench_smoke_measures_the_broker_without_busy_polling(report: dict[str, Any]) -> None:
    """The broker started with --busy-poll 0 answers the call workloads; the goal table
    shows its figure in a row of its own, after the default configuration's."""
    results = report["results"]["msgq_trio-direct-no-busy-poll"]
    for workload in ("req-reply", "concurrent"):
        assert results[workload]["status"] == "ok", (workload, results[workload])
        _check_counts_and_figure(workload, results[workload]["runs"][0])
    assert results["one-way"]["status"] == "n/a"
    rows = [line for line in goal_table(report).splitlines() if "req/reply" in line]
    assert len(rows) == 2 and "busy polling off" in rows[1], rows
    assert f"{results['req-reply']['median']:,.0f}" in rows[1], rows


def test_bench_smoke_measures_the_msgq_only_figures(report: dict[str, Any]) -> None:
    """SIGKILL to recipient-gone, capture on/off and idle-client RSS are measured: every
    kill ends the pending call with recipient-gone, the capture wrote a record for
    every message, and an idle client costs the broker a bounded amount of memory (the
    benchmark measures about 16 KiB; 256 KiB is a margin no allocator noise reaches, but a
    per-connection buffer of the receive size would)."""
    only = report["msgq_only"]
    assert set(only) == {"kill", "capture", "idle-50"}
    for key, summary in only.items():
        assert summary["status"] == "ok", (key, summary)
    kill = only["kill"]["runs"][0]
    assert kill["codes"] == {"recipient-gone": report["msgq_only_params"]["kills"]}
    assert kill["p99_us"] >= kill["p50_us"] > 0
    capture = only["capture"]["runs"][0]
    assert capture["on"] > 0 and capture["off"] > 0
    n = report["msgq_only_params"]["capture_n"]
    assert capture["records_written"] + capture["records_dropped"] >= n
    idle = only["idle-50"]["runs"][0]
    assert idle["broker_rss_after_kib"] >= idle["broker_rss_before_kib"] > 0, idle
    assert idle["value"] < 256, idle


def test_bench_smoke_measures_the_durable_msgq_rows(report: dict[str, Any]) -> None:
    """The durable workload's msgq_trio rows (queue plugin, ack after fsync) are measured,
    with ack latencies and fsyncs; no peer row runs without --peers. Group commit (README):
    the producer's batches are committed together, so there are far fewer fsyncs than
    messages (at least 10 messages per fsync on average, where one per batch of 500 is
    the design), and without a consumer at least one."""
    rows = report["durable"]
    assert set(rows) == {"msgq_trio", "msgq_trio +consumer"}
    n = report["durable_params"]["n"]
    for row, summary in rows.items():
        assert summary["status"] == "ok", (row, summary)  # "ok": all n acked in time
        run = summary["runs"][0]
        assert summary["median"] == run["value"] > 0, (row, summary)
        assert run["p99_us"] >= run["p50_us"] > 0, (row, run)
        # With a consumer online, a message taken before its commit is never written, so
        # no fsync at all is possible there.
        assert (0 if "consumer" in row else 1) <= run["fsyncs"] <= n // 10, (row, run)


@pytest.mark.parametrize("peer", ["nats", "redis"])
def test_bench_smoke_durable_peer_producers(peer: str) -> None:
    """The durable workload's JetStream and Redis Streams (AOF) producers publish every
    message and get every ack. The suite needs the servers (README; .ci/run installs
    them) and the peers' clients (benchmarks/requirements.txt): a missing one fails here
    rather than skip silently."""
    binary = {"nats": "nats-server", "redis": "redis-server"}[peer]
    assert shutil.which(binary), f"{binary} is not installed (apt-get install {binary})"
    module = {"nats": "nats", "redis": "redis"}[peer]
    assert importlib.util.find_spec(module), (
        f"{module} missing: pip install -r benchmarks/requirements.txt"
    )
    res = durable.run_durable_one(peer, durable.DURABLE_QUICK, 20.0, seed=0)
    assert res["status"] == "ok", res
    assert res["acked"] == durable.DURABLE_QUICK["n"]
    assert res["value"] > 0 and res["p99_us"] >= res["p50_us"] > 0


def test_python_m_benchmarks_takes_the_run_options(
    report: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m benchmarks --peers --rabbitmq ...`` (BENCHMARKS.md's command) runs from
    the checkout and parses the run's flags; a leading ``--`` still works; a usage error
    is exit status 2 naming the option. The installed ``msgq-trio`` has no ``bench``."""
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report, default=str))
    flags = ["--peers", "--rabbitmq", "--no-install", "--render", str(path)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "msgq_trio only" in proc.stdout and "durable acked publish" in proc.stdout
    args = build_parser().parse_args(["--peers", "--rabbitmq", "--json", str(path)])
    assert args.peers and args.rabbitmq and args.json == path
    assert main(["--", "--peers", "--render", str(path), "--markdown"]) == 0
    assert "| msgq_trio |" in capsys.readouterr().out
    md = tmp_path / "tables.md"
    assert main(["--render", str(path), "--markdown", str(md)]) == 0
    assert "| msgq_trio |" not in capsys.readouterr().out
    assert "| msgq_trio |" in md.read_text() and "| msgq_trio +consumer |" in md.read_text()
    with pytest.raises(SystemExit) as exc:
        main(["--peers", "--no-such-option"])
    assert exc.value.code == 2
    assert "--no-such-option" in capsys.readouterr().err
    assert cli.main(["bench", "--peers"]) == 2


def test_bench_report_renders_several_repetitions(report: dict[str, Any]) -> None:
    """A report of three repetitions (the full run's shape: several runs per figure,
    figures some rows lack, like the share of writes skipped without a consumer) renders
    as text and Markdown."""
    tripled = copy.deepcopy(report)
    tripled["config"]["repeat"] = 3
    for section in (*tripled["results"].values(), tripled["msgq_only"], tripled["durable"]):
        for summary in section.values():
            summary["runs"] = summary["runs"] * 3
    text = render(tripled)
    assert "msgq_trio +consumer" in text and "median of 3" in text
    assert "| msgq_trio |" in render(tripled, markdown=True)


def test_clientcpu_measures_both_clients() -> None:
    """``python -m benchmarks.clientcpu`` runs a real broker, publisher and
    subscriber: every message arrives with its 100-byte body (the subscriber checks each
    and would report no RESULT), and both sides report their CPU per message."""
    from benchmarks.clientcpu import run_once

    r = run_once(3000)
    assert r["pub"]["cpu_us"] > 0 and r["sub"]["cpu_us"] > 0
    assert r["sub"]["receives"] >= 1 and len(r["sub"]["gc_ms"]) == 3


def test_rtparts_measures_every_pair_of_client_kinds() -> None:
    """``python -m benchmarks.rtparts`` runs a real broker and, for every kind of
    responder, every kind of requester (the floor ones included): each checks its echo
    answers (a wrong one reports no RESULT and fails the run) and reports a p50 and its
    CPU per call."""
    from benchmarks.rtparts import REQUESTERS, RESPONDERS, run

    rows = run(calls=200, rounds=1, timeout=120)
    assert {(r["responder"], r["requester"]) for r in rows} == {
        (a, b) for a in RESPONDERS for b in REQUESTERS
    }
    # Each requester spent CPU on its calls (getrusage: user + system cannot both round
    # to zero, unlike the clock ticks of os.times()).
    assert all(r["p50_us"] > 0 and r["user_us"] + r["sys_us"] > 0 for r in rows), rows
    assert all(r["user_us"] >= 0 and r["sys_us"] >= 0 for r in rows), rows
