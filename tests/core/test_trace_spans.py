"""The spans of traced hops (core/traces.py with a SpanSink): a one-way hop's span starts
and ends as it is routed, a delivered request's stays open until its answer, its
failure or its trace's eviction, and the open spans stay bounded with the table."""

from __future__ import annotations

from typing import Any

from msgq_trio.core.traces import Traces
from msgq_trio.protocol.codes import FrameType
from tests.core.test_traces import frame, peer


class Sink:
    """Records what the table asks of a span sink."""

    def __init__(self) -> None:
        self.started: list[dict[str, Any]] = []
        self.ended: dict[int, tuple[dict[str, Any], str | None]] = {}

    def start(
        self, trace_id: str, parent_span: str, sampled: bool, name: str, attributes: dict[str, Any]
    ) -> int:
        self.started.append(
            {
                "trace": trace_id,
                "parent": parent_span,
                "sampled": sampled,
                "name": name,
                **attributes,
            }
        )
        return len(self.started) - 1

    def end(self, span: int, attributes: dict[str, Any], error: str | None) -> None:
        assert span not in self.ended, "a span ended twice"
        self.ended[span] = (attributes, error)


def test_one_way_hops_are_whole_spans_and_calls_wait_for_their_answer() -> None:
    t, sink = Traces(max_traces=4, max_hops=8), Sink()
    t.sink = sink
    a, b = peer(1), peer(2)
    t.frame(a, frame(1, 5, ftype=FrameType.NOTIFY, target="Zone"), "delivered", 0.0)
    assert sink.started[0]["parent"] == f"{5:016x}" and sink.started[0]["msgq.group"] == "Zone"
    assert sink.ended[0] == ({}, None)
    t.frame(a, frame(1, 6, ftype=FrameType.MESSAGE, target="Gone"), "no-recipient", 0.0)
    assert sink.ended[1] == ({}, "no-recipient")
    t.delivered_to = [b]
    t.frame(a, frame(1, 7, rid=9, target="Svc[0]"), "delivered", 0.0)
    call = sink.started[2]
    assert call["name"] == "msgq request echo" and call["msgq.group"] == "Svc"
    assert call["msgq.delivered_to"] == ["l.2"] and 2 not in sink.ended
    answer = frame(0, 0, ftype=FrameType.REPLY, header=b"", target="l.1")
    t.answer(a, b, answer._replace(request_id=9), 1.0)
    assert sink.ended[2] == ({"msgq.outcome": "answered", "msgq.answered_by": "l.2"}, None)
    assert not t.spans


def test_a_failed_call_and_an_evicted_trace_end_their_spans() -> None:
    t, sink = Traces(max_traces=1, max_hops=8), Sink()
    t.sink = sink
    a, b = peer(1), peer(2)
    t.delivered_to = [b]
    t.frame(a, frame(1, 7, rid=1), "delivered", 0.0)
    t.failed(a, 1, "recipient-gone", b)
    assert sink.ended[0][1] == "recipient-gone"
    t.delivered_to = [b]
    t.frame(a, frame(1, 8, rid=2), "delivered", 0.0)
    t.delivered_to = [b]
    t.frame(a, frame(2, 9, rid=3), "delivered", 0.0)  # trace 1 is forgotten
    assert sink.ended[1] == ({"msgq.outcome": "forgotten"}, None)
    assert set(t.spans) == {("l.1", 3)}


def test_open_calls_per_trace_stay_bounded() -> None:
    """Past max_hops a trace's requests get spans that end at once: the table of open
    ones never grows past the bound."""
    t, sink = Traces(max_traces=1, max_hops=2), Sink()
    t.sink = sink
    a, b = peer(1), peer(2)
    for rid in range(1, 6):
        t.delivered_to = [b]
        t.frame(a, frame(1, rid, rid=rid), "delivered", 0.0)
    assert len(t.spans) == 2 and len(sink.started) == 5
    assert sorted(sink.ended) == [2, 3, 4]


def test_without_a_sink_nothing_is_started() -> None:
    t = Traces(max_traces=1, max_hops=2)
    t.delivered_to = [peer(2)]
    t.frame(peer(1), frame(1, 1), "delivered", 0.0)
    t.failed(peer(1), 1, "timeout", peer(2))
    assert not t.spans
