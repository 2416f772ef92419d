"""The broker's table of traced hops (core/traces.py): what it keeps of traced frames,
its two bounds, and that a sender's bad trace context costs nothing but its hop."""

from __future__ import annotations

import cbor2

from msgq_trio.core.peers import Peer
from msgq_trio.core.traces import Traces
from msgq_trio.protocol.codes import Flag, FrameType
from msgq_trio.protocol.framing import Frame, FrameParser, encode_frame


def peer(n: int) -> Peer:
    return Peer(n, f"p{n}", pid=n, uid=0, gid=0, now=0.0)


def frame(
    trace: int,
    span: int,
    *,
    ftype: int = FrameType.REQUEST,
    header: bytes | None = None,
    target: str = "G",
    rid: int = 1,
) -> Frame:
    if header is None:
        h: dict[str, object] = {"traceparent": f"00-{trace:032x}-{span:016x}-01"}
        if ftype == FrameType.REQUEST:
            h["cmd"] = "echo"
        header = cbor2.dumps(h)
    data = b"".join(
        bytes(p)
        for p in encode_frame(
            ftype,
            target=target,
            request_id=rid if ftype == FrameType.REQUEST else 0,
            flags=int(Flag.TRACED),
            header=header,
        )
    )
    parser = FrameParser()
    parser.feed(data)
    f = parser.next_frame()
    assert f is not None
    return f


def test_the_oldest_trace_goes_first_with_its_open_calls() -> None:
    t = Traces(max_traces=2, max_hops=10)
    a, b = peer(1), peer(2)
    for trace in (1, 2, 3):
        t.delivered_to = [b]
        t.frame(a, frame(trace, 10 + trace, rid=trace), "delivered", float(trace))
    assert len(t) == 2
    assert t.hops(f"{1:032x}")["hops"] == []
    assert [h["span"] for h in t.hops(f"{3:032x}")["hops"]] == [f"{13:016x}"]
    # The evicted trace's open call went with it; the others wait for their answers.
    assert set(t.calls) == {("l.1", 2), ("l.1", 3)}
    answer = frame(0, 0, ftype=FrameType.REPLY, header=b"", target="l.1")
    t.answer(a, b, answer._replace(request_id=3), 5.0)
    hops = t.hops(f"{3:032x}")["hops"]
    assert [(h["kind"], h["cause"], h["at"]) for h in hops] == [
        ("request", None, 0.0),
        ("reply", f"{13:016x}", 2.0),
    ]
    assert set(t.calls) == {("l.1", 2)}


def test_hops_past_the_bound_are_counted_only() -> None:
    t = Traces(max_traces=4, max_hops=3)
    for span in range(1, 6):
        t.frame(peer(1), frame(7, span, ftype=FrameType.MESSAGE), "delivered", 0.0)
    got = t.hops(f"{7:032x}")
    assert len(got["hops"]) == 3 and got["dropped"] == 2


def test_bad_trace_context_is_only_not_recorded() -> None:
    t = Traces(max_traces=4, max_hops=4)
    for header in (
        b"\xff\xff",  # not CBOR
        cbor2.dumps({"traceparent": 5}),
        cbor2.dumps({"traceparent": "00-zz"}),
        cbor2.dumps({"traceparent": "00-" + "g" * 32 + "-" + "1" * 16 + "-01"}),
    ):
        t.frame(peer(1), frame(1, 1, ftype=FrameType.MESSAGE, header=header), "delivered", 0.0)
    assert len(t) == 0


def test_a_hop_keeps_bounded_names() -> None:
    t = Traces(max_traces=1, max_hops=1)
    long = "x" * 60_000
    t.frame(peer(1), frame(1, 1, ftype=FrameType.MESSAGE, target=long), "delivered", 0.0)
    (hop,) = t.hops(f"{1:032x}")["hops"]
    assert len(hop["to"]) == 200
