"""The history checker on hand-made histories (msgq_trio/scenario/history.py): each
invariant holds on a clean history and each broken one is caught, naming the
operations that break it."""

from __future__ import annotations

from typing import Any

import pytest

from msgq_trio.scenario.history import (
    HistoryError,
    Op,
    Recorder,
    check,
    check_answered_once,
    check_lost,
    check_no_duplicates,
    check_order,
    check_reaches_each,
    check_silence,
    merge,
    parse,
)


class H:
    """Writes a history the way roles do (through Recorder) and parses it back."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.recs: dict[str, Recorder] = {}
        self.t = 0.0

    def _r(self, process: str) -> Recorder:
        return self.recs.setdefault(process, Recorder(process))

    def tick(self, dt: float = 0.01) -> float:
        self.t += dt
        return self.t

    def send(self, p: str, seq: int, outcome: str = "ok", **kw: Any) -> None:
        key = f"{p}:{seq}"
        op_id, line = self._r(p).invoke("send", self.tick(), key=key, producer=p, seq=seq)
        self.lines.append(line)
        self.lines.append(self._r(p).complete(op_id, outcome, "send", self.tick(), key=key, **kw))

    def deliver(self, c: str, p: str, seq: int) -> None:
        self.lines.append(
            self._r(c).event("deliver", self.tick(), key=f"{p}:{seq}", producer=p, seq=seq)
        )

    def call(self, p: str, *outcomes: tuple[str, str | None]) -> None:
        op_id, line = self._r(p).invoke("call", self.tick())
        self.lines.append(line)
        for outcome, error in outcomes:
            # Written by hand: Recorder refuses a second completion (as it should).
            self.lines.append(
                Recorder(p)._line(
                    outcome, "call", op_id, self.tick(), {"error": error} if error else {}
                )
            )

    def ops(self) -> list[Op]:
        return parse(self.lines, "test")


def clean() -> H:
    h = H()
    for seq in (1, 2, 3):
        h.send("p0", seq)
        h.deliver("c0", "p0", seq)
    h.call("p1", ("ok", None))
    h.call("p1", ("fail", "recipient-gone"))
    return h


def test_a_clean_history_keeps_every_invariant() -> None:
    ops = clean().ops()
    assert (
        check(ops, order=True, allowed_errors=["recipient-gone"], silence=1.0, until=ops[-1].time)
        == []
    )


def test_a_lost_ack_is_named() -> None:
    h = clean()
    h.send("p0", 4)  # acked, never delivered
    h.send("p0", 5, "info")  # outcome unknown: may be lost, not a violation
    h.send("p0", 6, "fail", error="queue-full")  # refused: nothing was promised
    [v] = check_lost(h.ops())
    assert v.check == "lost" and "1 acked messages were never delivered" in v.message
    assert "p0 ok send p0:4" in v.message
    assert [h.ops()[i].key for i in v.ops] == ["p0:4"]


def test_a_duplicate_is_named_with_both_deliveries() -> None:
    h = clean()
    h.deliver("c1", "p0", 2)  # a second consumer got it too
    [v] = check_no_duplicates(h.ops())
    assert "message p0:2 delivered 2 times" in v.message
    assert "c0 ok deliver p0:2" in v.message and "c1 ok deliver p0:2" in v.message
    # Members of a group each get every message: only a second copy to one is wrong.
    assert check_no_duplicates(h.ops(), per="process") == []
    h.deliver("c1", "p0", 2)
    [v] = check_no_duplicates(h.ops(), per="process")
    assert len(v.ops) == 2 and {h.ops()[i].process for i in v.ops} == {"c1"}


def test_duplicates_per_session_allow_a_redelivery_after_a_crash() -> None:
    """A consumer that reconnected (a new session) may get a message again (at least
    once); twice within one session is a duplicate."""
    h = H()
    h.send("p0", 1)
    for session in (1, 2, 2):
        h.lines.append(
            Recorder("c0").event(
                "deliver", h.tick(), key="p0:1", producer="p0", seq=1, value={"session": session}
            )
        )
    [v] = check_no_duplicates(h.ops(), per="session")
    assert [h.ops()[i].value["session"] for i in v.ops] == [2, 2]
    assert len(check_no_duplicates(h.ops(), per="process")[0].ops) == 3
    with pytest.raises(ValueError, match="per must be"):
        check_no_duplicates(h.ops(), per="member")


def test_a_reorder_is_named() -> None:
    h = H()
    for seq in (1, 3, 2, 4):
        h.send("p0", seq)
        h.deliver("c0", "p0", seq)
    h.deliver("c1", "p0", 2)  # another consumer: its own order, gaps fine
    [v] = check_order(h.ops())
    assert "c0 got p0's seq 2 after seq 3" in v.message
    assert [h.ops()[i].seq for i in v.ops] == [3, 2]


def test_a_double_answer_a_missing_one_and_an_undocumented_error() -> None:
    h = clean()
    h.call("p1", ("ok", None), ("fail", "timeout"))
    h.call("p2")  # never answered
    h.call("p3", ("fail", "internal-error"))
    found = check_answered_once(h.ops(), allowed_errors=["recipient-gone", "timeout"])
    messages = [v.message for v in found]
    assert any("call completed 2 times" in m and "p1 fail call (timeout)" in m for m in messages), (
        messages
    )
    assert any("call never completed" in m and "p2 invoke call" in m for m in messages)
    assert any("undocumented error 'internal-error'" in m for m in messages)
    assert len(found) == 3
    # A process the scenario killed may leave an operation open.
    assert (
        len(
            check_answered_once(
                h.ops(),
                allowed_errors=["recipient-gone", "timeout", "internal-error"],
                ended=["p2"],
            )
        )
        == 1
    )


def test_silence_between_operations_and_at_the_end() -> None:
    h = clean()
    h.t += 5.0
    h.send("p0", 4)
    h.deliver("c0", "p0", 4)
    ops = h.ops()
    found = check_silence(ops, 2.0, until=ops[-1].time + 3.0)
    messages = [v.message for v in found]
    assert any(m.startswith("p0 was silent for 5.0") for m in messages), messages
    assert any(m.startswith("c0 was silent for 5.0") for m in messages), messages
    assert any("p1 was silent for the last" in m for m in messages), messages
    assert not any(
        "p1 was silent for the last" in v.message
        for v in check_silence(ops, 2.0, until=ops[-1].time + 3.0, ended=["p1"])
    )


def test_merge_orders_by_time_and_reindexes() -> None:
    a = parse([Recorder("a").event("deliver", 2.0, key="k2")], "a")
    b = parse([Recorder("b").event("deliver", 1.0, key="k1")], "b")
    merged = merge([a, b])
    assert [(op.index, op.key) for op in merged] == [(0, "k1"), (1, "k2")]


@pytest.mark.parametrize(
    "line, why",
    [
        ("{not json", "not JSON"),
        ("[1]", "not a JSON object"),
        ('{"process":"p","type":"done","f":"x","id":1,"time":0}', "type 'done'"),
        ('{"process":"p","type":"ok","f":"x","time":0}', "'id' is missing"),
        ('{"process":"p","type":"ok","f":"x","id":1,"time":0,"seq":"3"}', "'seq' is not"),
    ],
)
def test_malformed_lines_are_refused_with_their_place(line: str, why: str) -> None:
    with pytest.raises(HistoryError, match=why) as info:
        parse(["", line], "roles/p.jsonl")
    assert str(info.value).startswith("roles/p.jsonl:2:")


def test_the_recorder_refuses_a_second_completion() -> None:
    r = Recorder("p")
    op_id, _ = r.invoke("call", 0.0)
    r.complete(op_id, "ok", "call", 1.0)
    with pytest.raises(ValueError, match="not open"):
        r.complete(op_id, "fail", "call", 2.0)


def test_a_broadcast_that_missed_a_live_member_is_named() -> None:
    """Acked config versions reach every member running from the send to the end; one
    killed (ended) or started after the send is not owed it."""
    h = H()
    for p in ("auth-0", "auth-1", "auth-2"):
        h.lines.append(Recorder(p).event("start", h.tick()))
    h.send("cfg", 1)
    for p in ("auth-0", "auth-1", "auth-2"):
        h.deliver(p, "cfg", 1)
    h.send("cfg", 2)
    h.deliver("auth-0", "cfg", 2)  # auth-1 missed it, auth-2 was killed
    h.lines.append(Recorder("auth-3").event("start", h.tick()))  # started after: not owed
    [v] = check_reaches_each(h.ops(), ["auth-"], ended=["auth-2"])
    assert "cfg:2 was acked but never reached auth-1:" in v.message
    assert check_reaches_each(h.ops(), ["auth-"], ended=["auth-1", "auth-2"]) == []
    assert check_reaches_each(h.ops(), ["stats-"]) == []
