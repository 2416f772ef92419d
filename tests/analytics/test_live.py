"""``msgq-trio analyze live`` follows a capture directory while a real broker writes it.

The broker captures into files of 4 KiB (so they rotate every few dozen records, and
the file being written grows between micro-batches). The live query starts after a
first round of traffic, a second round runs while it is running, then the capture
stops; once the dashboard has taken in every record on disk the command gets SIGINT
(Ctrl-C). Its per-minute figures must equal those computed here from the records in
plain Python, and it must end cleanly: exit status 0, no ERROR or traceback.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio
from analytics_helpers import drawn, nearest_rank, parse_report, poll, table_rows

import msgq_trio

#: Generous: the live command's JVM starts on a machine shared with other tests.
WAIT_S = 300.0
ROUNDS = 4


async def _traffic(caller: msgq_trio.Bus, answered: int, failed: int, messages: int) -> None:
    for i in range(answered):
        assert await caller.call("Svc", "ok", i) == i
    for i in range(failed):
        try:
            await caller.call("Svc", "bad", i)
        except msgq_trio.RemoteError as exc:
            assert exc.code == "bad-zone"
        else:
            raise AssertionError("bad did not fail")
    for i in range(messages):
        await caller.send("Svc", {"i": i})


def _capture_stopped(bus: msgq_trio.Bus) -> Any:
    async def stopped() -> bool:
        return bool((await bus.call("msgq", "capture-status"))["state"] == "stopped")

    return stopped


def _on_disk(cap: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(cap.glob("capture-*.jsonl")):
        data = f.read_bytes()
        out += [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]
    return out


async def _live_records(out: Path, want: int, proc: subprocess.Popen[str]) -> dict[str, Any]:
    """live.json once it has taken in ``want`` records (it is replaced in one step);
    fails at once if the live command ended."""
    seen: dict[str, Any] = {}

    def done() -> bool:
        if proc.poll() is not None:
            _, err = proc.communicate()
            raise AssertionError(f"analyze live exited ({proc.returncode}):\n{err[-4000:]}")
        try:
            seen.update(json.loads((out / "live.json").read_text()))
        except FileNotFoundError:
            return False
        return bool(seen["records"] >= want)

    await poll(done, WAIT_S, interval=0.2)
    return seen


def _expected(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The live figures per minute, computed from the records in plain Python."""
    minutes: dict[int, dict[str, Any]] = {}

    def row(ts: float) -> dict[str, Any]:
        m = math.floor(ts / 60) * 60
        return minutes.setdefault(m, {"frames": {}, "requests": 0, "errors": {}, "latency": []})

    sent = {}
    for r in records:
        x = row(r["ts"])
        x["frames"][r["kind"]] = x["frames"].get(r["kind"], 0) + 1
        if r["kind"] == "command":
            x["requests"] += 1
            sent[(r["broker_instance"], r["sender"], r["request_id"])] = r
        elif r["kind"] == "error":
            x["errors"][r["code"]] = x["errors"].get(r["code"], 0) + 1
    for r in records:
        c = sent.get((r["broker_instance"], r["target"], r["reply_to"]))
        if (
            r["kind"] in ("answer", "error")
            and c is not None
            and (r["sender"] != "l.0" or c["outcome"] == "broker")
        ):
            row(c["ts"])["latency"].append(round(max(r["ts"] - c["ts"], 0.0) * 1000.0, 3))
    return minutes


async def test_live_dashboard_follows_a_broker_writing(broker: Any, short_tmp: Path) -> None:
    cap, out = short_tmp / "cap", short_tmp / "live"
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

        await caller.call(
            "msgq", "capture-start", {"dir": str(cap), "max_bytes": 4096, "max_files": 100_000}
        )
        await _traffic(caller, 25, 4, 10)
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable}
        proc = await trio.to_thread.run_sync(
            lambda: subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "msgq_trio",
                    "analyze",
                    "live",
                    str(cap),
                    "--out",
                    str(out),
                    "--trigger",
                    "1",
                    "--master",
                    "local[1]",
                    "--conf",
                    "spark.sql.shuffle.partitions=2",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                env=env,
                text=True,
            )
        )
        try:
            # the query has taken in the first round...
            await _live_records(out, 25 + 4 + 10, proc)
            # ...and more is written while it runs, in steps the query takes in one by
            # one, so files grow between micro-batches (the case Spark's own file
            # source gets wrong: it reads a file once)
            await _traffic(caller, 0, 5, 0)
            grew: set[str] = set()
            sizes = {f.name: f.stat().st_size for f in cap.glob("capture-*.jsonl")}
            for _ in range(ROUNDS):
                before = len(_on_disk(cap))
                await _traffic(caller, 2, 0, 2)  # 6 records
                await poll(lambda n=before + 6: len(_on_disk(cap)) >= n, 10)  # every 0.5 s
                await _live_records(out, len(_on_disk(cap)), proc)
                now = {f.name: f.stat().st_size for f in cap.glob("capture-*.jsonl")}
                grew |= {n for n, size in now.items() if 0 < sizes.get(n, 0) < size}
                sizes = now
            assert grew, "no file grew between two micro-batches"
            await caller.call("msgq", "capture-stop")
            await poll(_capture_stopped(caller), 10)
            records = _on_disk(cap)
            fig = await _live_records(out, len(records), proc)
            proc.send_signal(signal.SIGINT)
            stdout, stderr = await trio.to_thread.run_sync(lambda: proc.communicate(timeout=120))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()

    assert proc.returncode == 0, stderr[-4000:]
    assert "stopped:" in stdout
    assert "Traceback" not in stderr
    assert not [line for line in stderr.splitlines() if " ERROR " in line], stderr[-4000:]
    assert len(list(cap.glob("capture-*.jsonl"))) >= 5  # the files rotated under the query
    assert fig["records"] == len(records) and fig["batches"] >= ROUNDS

    expected = _expected(records)
    got = {m["minute"]: m for m in fig["minutes"]}
    assert sorted(got) == sorted(expected)
    for minute, want in expected.items():
        row = got[minute]
        assert row["frames"] == want["frames"], minute
        assert row["requests"] == want["requests"] and row["refused"] == 0
        assert row["errors"] == want["errors"]
        assert row["slow"] == {}
        lat = want["latency"]
        assert row["latency"] == {
            "replies": len(lat),
            "p50_ms": nearest_rank(lat, 0.5),
            "p95_ms": nearest_rank(lat, 0.95),
            "p99_ms": nearest_rank(lat, 0.99),
            "max_ms": max(lat),
        }, minute
    total = {
        k: sum(m["frames"].get(k, 0) for m in expected.values())
        for k in ("command", "answer", "error", "message")
    }
    assert total["error"] == 4 + 5 and total["message"] == 10 + 2 * ROUNDS

    doc = parse_report(out / "dashboard.html")
    assert len(table_rows(doc, "live-minutes")) == len(expected)
    assert drawn(doc, "live-frames", "series") == sorted(
        {k for m in expected.values() for k in m["frames"]}
    )
    assert drawn(doc, "live-latency", "series") == ["p50", "p95", "p99"]
    assert drawn(doc, "live-errors", "series") == ["bad-zone"]
