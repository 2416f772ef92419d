"""Unit tests of msgq_trio.core.rpc.PendingReplies: the registry of calls awaiting answers."""

from __future__ import annotations

import pytest

from msgq_trio.core.peers import Peer
from msgq_trio.core.rpc import PendingReplies


def peer(n: int) -> Peer:
    return Peer(n, f"p{n}", pid=n, uid=0, gid=0, now=0.0)


@pytest.fixture
def reg() -> PendingReplies:
    return PendingReplies()


def test_add_and_answer(reg: PendingReplies) -> None:
    """A single-callee call is pending until its callee answers; the answer returns the
    caller, frees the slot and the peers' links."""
    caller, callee = peer(1), peer(2)
    reg.add(caller, 7, [callee], 10.0, "G", "cmd")
    assert reg.is_pending(caller, 7)
    assert len(reg) == 1
    assert caller.pending_out == {(1, 7)} and callee.pending_in == {(1, 7)}
    assert reg.answer(callee, 1, 7) is caller
    assert not reg.is_pending(caller, 7)
    assert len(reg) == 0
    assert caller.pending_out == set() and callee.pending_in == set()
    reg.check_empty()


def test_duplicate_and_late_answers_are_dropped(reg: PendingReplies) -> None:
    """A second answer from the same callee, or an answer after the slot is gone, is None."""
    caller, callee = peer(1), peer(2)
    reg.add(caller, 1, [callee], 10.0, "G", "cmd")
    assert reg.answer(callee, 1, 1) is caller
    assert reg.answer(callee, 1, 1) is None
    assert reg.answer(callee, 1, 999) is None


def test_forged_answers_are_ignored(reg: PendingReplies) -> None:
    """An answer from a peer that was never asked (or naming the wrong caller) is ignored
    and leaves the real call pending."""
    caller, callee, intruder = peer(1), peer(2), peer(3)
    reg.add(caller, 5, [callee], 10.0, "G", "cmd")
    assert reg.answer(intruder, 1, 5) is None
    assert reg.answer(callee, 3, 5) is None  # right callee, wrong caller id
    assert reg.is_pending(caller, 5)
    assert reg.answer(callee, 1, 5) is caller


def test_multi_callee_slot_freed_after_last_answer(reg: PendingReplies) -> None:
    """An ALL call stays pending until every callee answered; each callee answers once."""
    caller = peer(1)
    callees = [peer(i) for i in (2, 3, 4)]
    reg.add(caller, 1, callees, 10.0, "G", "cmd")
    assert reg.answer(callees[1], 1, 1) is caller
    assert reg.answer(callees[1], 1, 1) is None
    assert reg.is_pending(caller, 1)
    assert reg.answer(callees[0], 1, 1) is caller
    assert reg.answer(callees[2], 1, 1) is caller
    assert not reg.is_pending(caller, 1)
    reg.check_empty()


def test_callee_gone_fails_its_pending_calls(reg: PendingReplies) -> None:
    """When a callee disconnects every call waiting on it fails with recipient-gone,
    one Failure per (caller, request), and the registry is empty afterwards."""
    c1, c2, callee, other = peer(1), peer(2), peer(3), peer(4)
    reg.add(c1, 1, [callee], 10.0, "G", "a")
    reg.add(c1, 2, [callee], 10.0, "G", "b")
    reg.add(c2, 1, [callee, other], 10.0, "G", "c")
    failures = reg.peer_gone(callee)
    got = sorted(
        (f.caller.lname, f.request_id, f.callee.lname, f.reason, f.command) for f in failures
    )
    assert got == [
        ("l.1", 1, "l.3", "recipient-gone", "a"),
        ("l.1", 2, "l.3", "recipient-gone", "b"),
        ("l.2", 1, "l.3", "recipient-gone", "c"),
    ]
    # The multi call still waits for `other`.
    assert reg.is_pending(c2, 1)
    assert not reg.is_pending(c1, 1) and not reg.is_pending(c1, 2)
    assert callee.pending_in == set()
    assert reg.answer(other, 2, 1) is c2
    reg.check_empty()


def test_caller_gone_drops_its_calls_silently(reg: PendingReplies) -> None:
    """When a caller disconnects its calls are forgotten (no failures to report) and the
    callees' late answers are discarded."""
    caller, callee = peer(1), peer(2)
    reg.add(caller, 1, [callee], 10.0, "G", "cmd")
    reg.add(caller, 2, [callee], 10.0, "G", "cmd")
    caller.alive = False
    assert reg.peer_gone(caller) == []
    assert callee.pending_in == set()
    assert reg.answer(callee, 1, 1) is None
    assert reg.answer(callee, 1, 2) is None
    reg.check_empty()


def test_dead_caller_is_not_reported_when_callee_goes(reg: PendingReplies) -> None:
    """A callee leaving does not produce failures for callers already dead."""
    caller, callee = peer(1), peer(2)
    reg.add(caller, 1, [callee], 10.0, "G", "cmd")
    caller.alive = False
    assert reg.peer_gone(callee) == []
    assert reg.peer_gone(caller) == []
    reg.check_empty()


def test_self_call_cleanup(reg: PendingReplies) -> None:
    """A peer that called itself and then disconnects leaves nothing behind."""
    p = peer(1)
    reg.add(p, 1, [p], 10.0, "l.1", "cmd")
    p.alive = False
    assert reg.peer_gone(p) == []
    reg.check_empty()


def test_expire_and_next_deadline(reg: PendingReplies) -> None:
    """next_deadline() is the earliest pending deadline; expire(now) times out exactly the
    calls whose deadline is <= now, one Failure per unanswered callee."""
    caller = peer(1)
    a, b = peer(2), peer(3)
    assert reg.next_deadline() is None
    reg.add(caller, 1, [a], 5.0, "G", "slow")
    reg.add(caller, 2, [a, b], 3.0, "G", "all")
    reg.add(caller, 3, [b], 9.0, "G", "later")
    assert reg.next_deadline() == 3.0
    assert reg.answer(b, 1, 2) is caller  # b answered the ALL call, a did not
    assert reg.expire(2.999) == []
    failures = reg.expire(3.0)
    assert [(f.request_id, f.callee.lname, f.reason, f.command) for f in failures] == [
        (2, "l.2", "timeout", "all")
    ]
    assert reg.next_deadline() == 5.0
    assert [f.request_id for f in reg.expire(100.0)] == [1, 3]
    assert reg.next_deadline() is None
    assert a.pending_in == set() and b.pending_in == set() and caller.pending_out == set()
    reg.check_empty()


def test_answered_calls_do_not_expire(reg: PendingReplies) -> None:
    """A call answered before its deadline produces no timeout, and its stale deadline is
    skipped by next_deadline()."""
    caller, callee = peer(1), peer(2)
    reg.add(caller, 1, [callee], 1.0, "G", "cmd")
    reg.add(caller, 2, [callee], 2.0, "G", "cmd")
    reg.answer(callee, 1, 1)
    assert reg.next_deadline() == 2.0
    assert reg.expire(1.5) == []
    assert len(reg) == 1


def test_request_id_reuse_after_answer(reg: PendingReplies) -> None:
    """A caller may reuse a request id once the first call is finished; the old deadline
    does not time out the new call early."""
    caller, callee = peer(1), peer(2)
    reg.add(caller, 1, [callee], 1.0, "G", "first")
    reg.answer(callee, 1, 1)
    reg.add(caller, 1, [callee], 5.0, "G", "second")
    assert reg.next_deadline() == 5.0
    assert reg.expire(1.0) == []
    assert reg.is_pending(caller, 1)
    assert [f.command for f in reg.expire(5.0)] == ["second"]


def test_expired_call_ignores_late_answer(reg: PendingReplies) -> None:
    """After a timeout the callee's late answer is dropped."""
    caller, callee = peer(1), peer(2)
    reg.add(caller, 1, [callee], 1.0, "G", "cmd")
    assert len(reg.expire(1.0)) == 1
    assert reg.answer(callee, 1, 1) is None


def test_check_empty_reports_leaks(reg: PendingReplies) -> None:
    """check_empty() raises while any call is still pending."""
    caller, callee = peer(1), peer(2)
    reg.add(caller, 1, [callee], 1.0, "G", "cmd")
    with pytest.raises(AssertionError):
        reg.check_empty()
    reg.answer(callee, 1, 1)
    reg.check_empty()
