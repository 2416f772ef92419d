"""``msgq-trio analyze capture`` on a capture made by a real broker during the test.

Known traffic: N requests answered, M answered with a handler error, P sent to nobody
(the broker answers no-recipient), K pending on a callee that is SIGKILLed (the broker
answers recipient-gone on its behalf), U still pending when the capture stops, and
MESSAGES one-way messages. The report must show exactly those figures: in summary.json,
in the HTML report (parsed strictly) and in the Parquet tables.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

import pytest
import trio
from analytics_helpers import cell, drawn, nearest_rank, parse_report, table_rows

import msgq_trio

N, M, P, K, U, MESSAGES = 30, 7, 4, 5, 2, 20
_XLINK = "{http://www.w3.org/1999/xlink}href"


async def _stop_capture(bus: msgq_trio.Bus) -> None:
    """capture-stop, then wait until the capture wrote its buffer and closed its file."""
    await bus.call("msgq", "capture-stop")
    with trio.fail_after(10):
        for _ in range(1000):  # polling the broker: there is no event to wait on
            if (await bus.call("msgq", "capture-status"))["state"] in ("stopped", "failed"):
                return
            await trio.sleep(0.05)


async def make_capture(broker: Any, spawn_client: Any, cap: Path) -> dict[str, str]:
    """Run the known traffic with a capture on; returns the lnames of the parties."""
    victim = spawn_client(broker.path, name="Victim", groups=["Victim"], commands={"slow": "hang"})
    holder = spawn_client(broker.path, name="Holder", groups=["Holder"], commands={"hold": "hang"})
    async with (
        msgq_trio.connect(broker.path, name="Svc") as svc,
        msgq_trio.connect(broker.path, name="Caller") as caller,
    ):
        await svc.subscribe("Svc")

        @svc.command("ok")
        def ok(params: Any) -> Any:
            return params

        @svc.command("bad")
        def bad(params: Any) -> Any:
            raise msgq_trio.CommandFailed("bad-zone", f"no zone {params}")

        await caller.call("msgq", "capture-start", {"dir": str(cap)})
        for i in range(N):
            assert await caller.call("Svc", "ok", i) == i
        for i in range(M):
            with pytest.raises(msgq_trio.RemoteError) as ei:
                await caller.call("Svc", "bad", i)
            assert ei.value.code == "bad-zone"
        for i in range(P):
            with pytest.raises(msgq_trio.NoRecipient):
                await caller.call("Nobody", "anything", i)
        for i in range(MESSAGES):
            await caller.send("Svc", {"i": i})
        for _ in range(MESSAGES):
            await svc.receive(timeout=10)

        gone: list[str] = []

        async def call_victim(i: int) -> None:
            with pytest.raises(msgq_trio.RecipientGone) as ei:
                await caller.call("Victim", "slow", i)
            gone.append(ei.value.code)

        async def call_holder(i: int) -> None:
            await caller.call("Holder", "hold", i)  # cancelled after the capture stopped

        async with trio.open_nursery() as outer:
            for i in range(U):
                outer.start_soon(call_holder, i)
            for _ in range(U):
                assert (await holder.areadline()).startswith("got ")
            async with trio.open_nursery() as n:
                for i in range(K):
                    n.start_soon(call_victim, i)
                for _ in range(K):  # every request reached the victim's handler
                    assert (await victim.areadline()).startswith("got ")
                victim.sigkill()
            assert gone == ["recipient-gone"] * K
            await _stop_capture(caller)
            outer.cancel_scope.cancel()
        return {"caller": caller.lname, "svc": svc.lname, "victim": victim.lname}


@pytest.fixture
async def capture(broker: Any, spawn_client: Any, short_tmp: Path) -> tuple[Path, dict[str, str]]:
    cap = short_tmp / "cap"
    parties = await make_capture(broker, spawn_client, cap)
    return cap, parties


def _records(cap: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(cap.glob("capture-*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError as exc:
                raise AssertionError(f"{f}: not JSON: {line!r}") from exc
    return out


def _expected_latencies(records: list[dict[str, Any]], command: str) -> list[float]:
    """Callee reply ts - request ts in ms, paired by (caller, request id), from the raw
    records in plain Python (the same rounding as the report: 3 decimals)."""
    cmds = {
        (r["sender"], r["request_id"]): r
        for r in records
        if r["kind"] == "command" and r["command"] == command
    }
    out = []
    for r in records:
        if r["kind"] in ("answer", "error") and r["sender"] != "l.0":
            c = cmds.get((r["target"], r["reply_to"]))
            if c is not None:
                out.append(round(max(r["ts"] - c["ts"], 0.0) * 1000.0, 3))
    return out


async def test_capture_report_figures_are_exact(spark: Any, capture: Any, short_tmp: Path) -> None:
    from msgq_trio.analytics.cli import run_capture

    cap, parties = capture
    out = short_tmp / "report"
    fig = await trio.to_thread.run_sync(lambda: run_capture(spark, [str(cap)], out))
    records = _records(cap)
    assert fig["records"] == len(records)

    # requests: the capture-start request (answered by the broker) plus the known traffic
    total = 1 + N + M + P + K + U
    assert fig["requests"] == {
        "total": total,
        "answered": 1 + N,
        "callee-error": M,
        "broker-error": P,
        "never-answered": K + U,
    }
    assert {(r["status"], r["reason"]): r["requests"] for r in fig["request_status"]} == {
        ("answered", None): 1 + N,
        ("callee-error", "bad-zone"): M,
        ("broker-error", "no-recipient"): P,
        ("never-answered", "recipient-gone"): K,
        ("never-answered", "no-reply-in-capture"): U,
    }
    assert {
        (r["target"], r["command"], r["reason"]): r["requests"]
        for r in fig["never_answered_by_target"]
    } == {("Victim", "slow", "recipient-gone"): K, ("Holder", "hold", "no-reply-in-capture"): U}

    # errors by code and by party
    assert {
        r["code"]: (r["errors"], r["from_callees"], r["from_broker"]) for r in fig["errors_by_code"]
    } == {"bad-zone": (M, M, 0), "no-recipient": (P, 0, P), "recipient-gone": (K, 0, K)}
    assert {
        (r["code"], r["party"], r["sender_name"], r["on_behalf_of"]): r["errors"]
        for r in fig["errors_by_party"]
    } == {
        ("bad-zone", "callee", "Svc", None): M,
        ("no-recipient", "broker", "msgq", None): P,
        ("recipient-gone", "broker-for-callee", "msgq", parties["victim"]): K,
    }

    # latency per (target, command): the callee's replies only, nearest-rank percentiles
    lat = {(r["target"], r["command"]): r for r in fig["latency"]}
    assert set(lat) == {("Svc", "ok"), ("Svc", "bad"), ("msgq", "capture-start")}
    for command, n in (("ok", N), ("bad", M)):
        values = _expected_latencies(records, command)
        assert len(values) == n
        row = lat[("Svc", command)]
        assert row["replies"] == n
        assert row["p50_ms"] == nearest_rank(values, 0.5)
        assert row["p95_ms"] == nearest_rank(values, 0.95)
        assert row["p99_ms"] == nearest_rank(values, 0.99)
        assert row["max_ms"] == max(values)
    assert sum(r["n"] for r in fig["latency_histogram"]) == N + M + 1

    # traffic per kind and top talkers
    kinds = {r["kind"]: r["frames"] for r in fig["per_kind"]}
    assert kinds == {"command": total, "answer": 1 + N, "error": M + P + K, "message": MESSAGES}
    senders = {r["sender_name"]: r["frames"] for r in fig["top_senders"]}
    assert senders == {"Caller": total + MESSAGES, "Svc": N + M, "msgq": 1 + P + K}
    assert sum(r["frames"] for r in fig["traffic_series"]) == fig["records"]
    assert fig["slow_consumers"] == []

    # the HTML report shows the same figures; it parses strictly and has its plots
    doc = parse_report(out / "report.html")
    # the broker table shows times as UTC dates, not Unix seconds
    (broker,) = fig["brokers"]
    (shown,) = table_rows(doc, "brokers")
    for key in ("broker_started", "first_ts", "last_ts"):
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} UTC", shown[key]), shown
        stamp = dt.datetime.strptime(shown[key], "%Y-%m-%d %H:%M:%S.%f UTC")
        assert stamp.replace(tzinfo=dt.UTC).timestamp() == pytest.approx(broker[key], abs=0.001)
    assert shown["records"] == cell(fig["records"])
    assert table_rows(doc, "requests-summary") == [
        {
            "total": cell(total),
            "answered": cell(1 + N),
            "callee-error": cell(M),
            "broker-error": cell(P),
            "never-answered": cell(K + U),
        }
    ]
    shown_latency = {(r["target"], r["command"]): r for r in table_rows(doc, "latency")}
    for key, row in lat.items():
        assert shown_latency[key] == {k: cell(v) for k, v in row.items()}
    assert {r["code"]: r["errors"] for r in table_rows(doc, "errors-by-code")} == {
        "bad-zone": cell(M),
        "no-recipient": cell(P),
        "recipient-gone": cell(K),
    }
    assert {r["reason"]: r["requests"] for r in table_rows(doc, "never-answered")} == {
        "recipient-gone": cell(K),
        "no-reply-in-capture": cell(U),
    }
    # the matplotlib charts: one bar per histogram bin, one line per kind
    assert len(drawn(doc, "latency-histogram", "bar")) == len(fig["latency_histogram"])
    assert drawn(doc, "traffic-frames", "series") == ["answer", "command", "error", "message"]
    assert doc.find(".//script") is None  # self-contained: no scripts, no external files
    assert not [
        el
        for el in doc.iter()
        if el.get("src") or el.get("href") or "http" in str(el.get(_XLINK) or "")
    ]

    # the tables Spark wrote hold the same figures
    req = spark.read.parquet(str(out / "tables" / "requests"))
    assert req.count() == total
    never = spark.read.parquet(str(out / "tables" / "never_answered"))
    assert {(r["reason"], r["caller"]) for r in never.collect()} == {
        ("recipient-gone", parties["caller"]),
        ("no-reply-in-capture", parties["caller"]),
    }
    assert never.count() == K + U
    assert json.loads((out / "summary.json").read_text())["requests"] == fig["requests"]


def test_cli_prints_summary_and_progress(
    spark: Any, short_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``msgq-trio analyze capture`` through the top-level command line (in this process,
    so it reuses the test session's Spark) on a small hand-written capture: exit 0, the
    summary table on stdout, progress on stderr, report and CSV tables written; a missing
    input exits 2 before Spark is involved."""
    from msgq_trio.cli import main

    cap = short_tmp / "c"
    cap.mkdir()
    base = {
        "ts": 1700000000.25,
        "seq": 1,
        "kind": "command",
        "sender": "l.5",
        "sender_name": "bindctl",
        "on_behalf_of": None,
        "target": "ZoneMgr",
        "request_id": 1,
        "reply_to": None,
        "all": False,
        "size": 80,
        "attachments": 0,
        "fds": 0,
        "outcome": "delivered",
        "recipients": 1,
        "command": "get_zone_count",
        "event": None,
        "code": None,
        "error_message": None,
        "body": None,
        "body_encoding": None,
    }
    answer = {
        **base,
        "ts": 1700000000.5,
        "seq": 2,
        "kind": "answer",
        "sender": "l.4",
        "sender_name": "ZoneMgr",
        "target": "l.5",
        "reply_to": 1,
        "size": 40,
        "outcome": "forwarded",
        "recipients": True,
        "command": None,
    }
    (cap / "capture-000001.jsonl").write_text(json.dumps(base) + "\n" + json.dumps(answer) + "\n")
    out = short_tmp / "out"
    assert main(["analyze", "capture", str(cap), "--out", str(out), "--format", "csv"]) == 0
    std = capsys.readouterr()
    lines = std.out.splitlines()
    i = lines.index(next(x for x in lines if x.startswith("total")))
    assert lines[i + 1].split() == ["1", "1", "0", "0", "0"]
    assert any(x.split()[:4] == ["ZoneMgr", "get_zone_count", "1", "250.000"] for x in lines)
    assert "starting Spark" in std.err and "writing table requests" in std.err
    assert list((out / "tables" / "requests").glob("part-*.csv"))
    latency_csv = "".join(f.read_text() for f in (out / "tables" / "latency").glob("*.csv"))
    assert latency_csv.splitlines()[1].startswith(
        "ZoneMgr,get_zone_count,1,250.0,250.0,250.0,250.0"
    )
    parse_report(out / "report.html")
    assert main(["analyze", "capture", str(short_tmp / "nothing"), "--out", str(out)]) == 2
    assert "no *.jsonl files" in capsys.readouterr().err
