"""A capture directory that spans a broker restart is analysed without mis-pairing.

A real broker process captures into a directory, is stopped (SIGTERM) with requests
still pending on a callee, and a new broker process starts on the same socket with the
same capture directory (its files continue the numbering). The same clients connect in
the same order, so the new broker hands out the same lnames, and the caller's request
ids start again at 1: the second lifetime answers request ids that the first lifetime
left pending. Keyed by lname and request id alone, those answers would pair with the
dead broker's requests; keyed by broker instance, the figures are exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import trio
from analytics_helpers import nearest_rank, poll

import msgq_trio

N1, HOLD, N2 = 6, 3, 14  # N2 > N1 + HOLD: lifetime 2 reuses every request id of lifetime 1


async def _lifetime(
    path: Path, spawn_client: Any, calls: int, hold: int, stop_broker: Any = None
) -> dict[str, str]:
    """Holder (a helper process), Svc and Caller connect in this order; Caller makes
    ``calls`` answered requests to Svc, then ``hold`` requests Holder never answers; with
    ``stop_broker`` the broker is stopped while those are pending."""
    holder = spawn_client(path, name="Holder", groups=["Holder"], commands={"hold": "hang"})
    async with (
        msgq_trio.connect(path, name="Svc") as svc,
        msgq_trio.connect(path, name="Caller") as caller,
    ):
        await svc.subscribe("Svc")

        @svc.command("ok")
        def ok(params: Any) -> Any:
            return params

        for i in range(calls):
            assert await caller.call("Svc", "ok", i) == i
        failed: list[str] = []

        async def call_holder(i: int) -> None:
            try:
                await caller.call("Holder", "hold", i)
            except msgq_trio.MsgqError as exc:  # the broker went away under it
                failed.append(type(exc).__name__)

        if hold:
            async with trio.open_nursery() as n:
                for i in range(hold):
                    n.start_soon(call_holder, i)
                for _ in range(hold):  # every request reached the holder's handler
                    assert (await holder.areadline()).startswith("got ")
                await trio.to_thread.run_sync(stop_broker)
            assert len(failed) == hold
        lnames = {"holder": holder.lname, "svc": svc.lname, "caller": caller.lname}
        if stop_broker is None:
            await caller.call("msgq", "capture-stop")

            async def stopped() -> bool:
                return bool((await caller.call("msgq", "capture-status"))["state"] == "stopped")

            await poll(stopped, 10)
    holder.close()
    return lnames


def _records(cap: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for f in sorted(cap.glob("capture-*.jsonl"))
        for line in f.read_text().splitlines()
    ]


async def test_capture_across_broker_restart_pairs_exactly(
    broker_factory: Any, spawn_client: Any, spark: Any, short_tmp: Path
) -> None:
    from msgq_trio.analytics.cli import run_capture

    cap, sock = short_tmp / "cap", short_tmp / "b.sock"
    first = broker_factory("--capture-dir", str(cap), path=sock)
    life1 = await _lifetime(sock, spawn_client, N1, HOLD, stop_broker=first.stop)
    assert not sock.exists()
    broker_factory("--capture-dir", str(cap), path=sock)
    life2 = await _lifetime(sock, spawn_client, N2, 0)

    records = _records(cap)
    instances = sorted({r["broker_instance"] for r in records})
    assert len(instances) == 2 and all(len(i) == 16 for i in instances)
    # the hazard is real: same lnames, and lifetime 2 answered request ids that were
    # still pending in lifetime 1
    assert life1 == life2
    held = {
        (r["sender"], r["request_id"])
        for r in records
        if r["kind"] == "command" and r["command"] == "hold"
    }
    answered_later = {
        (r["target"], r["reply_to"])
        for r in records
        if r["kind"] == "answer" and r["sender"] == life2["svc"]
    }
    assert len(held) == HOLD and held <= answered_later
    assert len({f.name for f in cap.glob("capture-*.jsonl")}) >= 2  # numbering went on

    fig = await trio.to_thread.run_sync(lambda: run_capture(spark, [str(cap)], short_tmp / "out"))
    assert fig["broker_instances"] == 2
    # each lifetime also has two subscribe requests (Holder's and Svc's, to the broker)
    assert fig["requests"] == {
        "total": N1 + HOLD + N2 + 4,
        "answered": N1 + N2 + 4,
        "callee-error": 0,
        "broker-error": 0,
        "never-answered": HOLD,
    }
    # whether the stopping broker answered the held requests recipient-gone (on the
    # holder's behalf) before its capture closed depends on its shutdown order: the
    # reasons follow the records, the count is exact either way
    gone = sum(
        1
        for r in records
        if r["kind"] == "error"
        and r["code"] == "recipient-gone"
        and r["on_behalf_of"] == life1["holder"]
    )
    expected = {
        ("Holder", "hold", "recipient-gone"): gone,
        ("Holder", "hold", "no-reply-in-capture"): HOLD - gone,
    }
    assert {
        (r["target"], r["command"], r["reason"]): r["requests"]
        for r in fig["never_answered_by_target"]
    } == {k: v for k, v in expected.items() if v}
    # latency of Svc's answers: paired within each lifetime, as computed here by hand
    sent = {
        (r["broker_instance"], r["sender"], r["request_id"]): r["ts"]
        for r in records
        if r["kind"] == "command" and r["command"] == "ok"
    }
    values = [
        round(
            max(r["ts"] - sent[(r["broker_instance"], r["target"], r["reply_to"])], 0.0) * 1000.0, 3
        )
        for r in records
        if r["kind"] == "answer" and r["sender"] == life1["svc"]
    ]
    assert len(values) == N1 + N2
    (row,) = [r for r in fig["latency"] if r["command"] == "ok"]
    assert row["replies"] == N1 + N2
    assert (row["p50_ms"], row["p99_ms"], row["max_ms"]) == (
        nearest_rank(values, 0.5),
        nearest_rank(values, 0.99),
        max(values),
    )
    # the caller is two connections, one per broker lifetime
    callers = {
        (r["broker_instance"], r["frames"])
        for r in fig["top_senders"]
        if r["sender"] == life1["caller"]
    }
    by_instance = {r["broker_instance"]: r["broker_started"] for r in fig["brokers"]}
    first_instance = min(by_instance, key=lambda i: by_instance[i])
    assert callers == {
        (first_instance, N1 + HOLD),
        (next(i for i in instances if i != first_instance), N2),
    }
