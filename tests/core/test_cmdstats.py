"""Unit tests of the per-command statistics (core/cmdstats.py) and of how the pending
calls (core/rpc.py) count each call's outcome into them."""

from __future__ import annotations

from msgq_trio.core.cmdstats import LATENCY_BUCKETS, OTHER, CommandStats
from msgq_trio.core.peers import Peer
from msgq_trio.core.rpc import PendingReplies


def peer(n: int) -> Peer:
    return Peer(n, f"p{n}", pid=n, uid=0, gid=0, now=0.0)


def test_entry_counts_requests_per_pair() -> None:
    t = CommandStats()
    a = t.entry("Zone", "reload")
    assert t.entry("Zone", "reload") is a
    b = t.entry("Zone", "count")
    assert a.requests == 2 and b.requests == 1
    assert [(s.group, s.command) for s in t.rows()] == [("Zone", "reload"), ("Zone", "count")]


def test_pairs_past_the_bound_go_to_other_and_count_as_overflow() -> None:
    """Past max_pairs no pair is created: its requests are counted under other/other and
    as overflow, and pairs already tracked keep counting."""
    t = CommandStats(max_pairs=2)
    t.entry("G", "a")
    t.entry("G", "b")
    for i in range(5):
        s = t.entry("G", f"made-up-{i}")
        assert s is t.other
    t.entry("G", "a")
    assert len(t.pairs) == 2
    assert t.overflow == 5 and t.other.requests == 5
    assert (t.other.group, t.other.command) == (OTHER, OTHER)
    snap = t.snapshot()
    assert snap["pairs"] == 2 and snap["max_pairs"] == 2 and snap["overflow"] == 5
    assert [(r["group"], r["command"], r["requests"]) for r in snap["commands"]] == [
        (OTHER, OTHER, 5),
        ("G", "a", 2),
        ("G", "b", 1),
    ]
    assert [r["command"] for r in t.snapshot(top=1)["commands"]] == [OTHER]


def test_error_codes_per_pair_are_bounded() -> None:
    t = CommandStats(max_codes=2)
    s = t.entry("G", "c")
    for code in ("x", "y", "z", "x", "w"):
        t.answered_error(s, 0.001, code)
    assert s.error == 5
    assert s.errors == {"x": 2, "y": 1, OTHER: 2}


def test_latency_buckets_and_quantiles() -> None:
    """A latency lands in the first bucket whose bound it does not exceed (Prometheus le)."""
    t = CommandStats()
    s = t.entry("G", "c")
    assert s.quantile(0.5) is None
    t.answered_ok(s, LATENCY_BUCKETS[0])  # on the bound: that bucket
    t.answered_ok(s, 0.0003)  # (0.00025, 0.0005]
    t.answered_ok(s, 0.0004)
    t.answered_error(s, 1000.0, "slow")  # past the last bound
    assert s.buckets[0] == 1
    assert s.buckets[LATENCY_BUCKETS.index(0.0005)] == 2
    assert s.buckets[-1] == 1
    assert sum(s.buckets) == 4
    assert s.quantile(0.5) == 0.0005
    assert s.quantile(0.99) == float("inf")
    row = s.as_dict()
    assert row["outcomes"]["ok"] == 3 and row["outcomes"]["error"] == 1
    assert row["latency"]["count"] == 4
    assert abs(row["latency"]["sum"] - (LATENCY_BUCKETS[0] + 0.0007 + 1000.0)) < 1e-9


def test_pending_calls_count_each_outcome() -> None:
    """Answers (ok, error by code), a callee gone, a deadline and a caller gone are each
    counted once per callee asked, into the pair the call was registered with."""
    reg = PendingReplies()
    caller, callee = peer(1), peer(2)
    stat = reg.stats.entry("G", "c")
    for rid in range(1, 4):
        if rid > 1:
            reg.stats.entry("G", "c")
        reg.add(caller, rid, [callee], 100.0, "G", "c", stat, now=1.0)
    assert reg.answer(callee, 1, 1, now=1.5) is caller
    assert reg.answer(callee, 1, 2, now=1.25, error="busy") is caller
    # A duplicate (late) answer is not counted.
    assert reg.answer(callee, 1, 2, now=1.3, error="busy") is None
    assert (stat.ok, stat.error, stat.errors) == (1, 1, {"busy": 1})
    assert stat.latency_sum == 0.75
    # Recipient gone: the callee disconnects with request 3 pending.
    assert len(reg.peer_gone(callee)) == 1
    assert stat.recipient_gone == 1
    # Timeout: an ALL call to two callees counts one timeout each.
    c2, c3 = peer(3), peer(4)
    reg.stats.entry("G", "c")
    reg.add(caller, 9, [c2, c3], 5.0, "G", "c", stat, now=1.0)
    assert len(reg.expire(5.0)) == 2
    assert stat.timeout == 2
    # Cancelled: the caller leaves with a call pending.
    reg.stats.entry("G", "c")
    reg.add(caller, 10, [c2], 50.0, "G", "c", stat, now=1.0)
    reg.peer_gone(caller)
    assert stat.cancelled == 1
    assert stat.requests == 5
    assert sum(stat.outcomes().values()) == 6  # the ALL call had two recipients
    reg.check_empty()


def test_add_without_a_stat_takes_the_target_pair() -> None:
    reg = PendingReplies(CommandStats(max_pairs=4))
    caller, callee = peer(1), peer(2)
    reg.add(caller, 1, [callee], 10.0, "G", "cmd")
    assert reg.stats.pairs[("G", "cmd")].requests == 1
    reg.answer(callee, 1, 1)
    assert reg.stats.pairs[("G", "cmd")].ok == 1
