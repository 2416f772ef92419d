"""The capture's fast record encoder writes exactly what the general one writes."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from msgq_trio.ops.capture import Captured, encode_line, make_record, record_line, record_lines

names = st.text(max_size=40)
captured = st.builds(
    Captured,
    ts=st.floats(min_value=0, max_value=4e9, allow_nan=False),
    kind=st.sampled_from(["message", "command", "answer", "error", "notification", "membership"]),
    sender=names,
    sender_name=names,
    source=st.sampled_from([b"", b"l.0\0msgq", b"l.7\0auth", b"l.\xff\0x"]),
    target=names,
    ftype=st.integers(0, 9),
    flags=st.integers(0, 255),
    request_id=st.integers(0, 2**63),
    size=st.integers(32, 2**26),
    outcome=st.sampled_from(["delivered", "no-recipient", "refused", "held", "ok"]),
    recipients=st.integers(0, 10_000),
    header=st.sampled_from([b"", b"\xa1ccmdcget", b"\xa1dcodecbad"]),
    body=st.one_of(st.none(), st.binary(max_size=20)),
    n_blobs=st.integers(0, 5),
    n_fds=st.integers(0, 253),
)


@given(
    captured,
    st.integers(1, 2**40),
    st.sampled_from(["none", "json", "base64"]),
    st.sampled_from([65_536, 300]),
)
def test_record_line_matches_the_general_encoder(
    c: Captured, seq: int, body_mode: str, max_bytes: int
) -> None:
    """Byte for byte the same line as ``encode_line(make_record(...))``, for every kind,
    sender, target, body mode and line bound, and it parses as one JSON object."""
    line = record_line(seq, c, body_mode, max_bytes)
    assert line == encode_line(make_record(seq, c, body_mode), max_bytes)
    assert line.endswith(b"\n")
    assert isinstance(json.loads(line), dict)


@given(
    st.lists(st.tuples(captured, st.integers(1, 2**40)), max_size=8),
    st.lists(st.integers(0, 7), max_size=30),
    st.sampled_from(["none", "json"]),
    st.sampled_from([65_536, 300]),
    st.floats(0, 4e9, allow_nan=False),
    st.integers(32, 2**20),
)
def test_record_lines_matches_record_line_on_runs(
    base: list[tuple[Captured, int]],
    picks: list[int],
    body_mode: str,
    max_bytes: int,
    ts: float,
    size: int,
) -> None:
    """The batch encoder writes exactly record_line's lines, also for runs of records that
    share everything but seq, ts and size (its cache) and for records that differ in any
    one field from the one before."""
    if not base:
        return
    items = []
    for i, k in enumerate(picks):
        c, seq = base[k % len(base)]
        if i % 3 == 0:  # same record as a neighbour but a new ts and size
            c = c._replace(ts=ts, size=size + i)
        items.append((seq + i, c))
    assert record_lines(items, body_mode, max_bytes) == [
        record_line(seq, c, body_mode, max_bytes) for seq, c in items
    ]


def test_tap_run_shows_the_same_records_as_tapping_each_frame() -> None:
    """A run of one-way MESSAGEs (some with a user header) is captured as the same records
    (all but the timestamp) as its frames tapped one by one, through the same filter."""
    from msgq_trio.config import Limits
    from msgq_trio.core.broker import Broker
    from msgq_trio.ops.capture import TapHub, TrafficFilter
    from msgq_trio.protocol.codes import FrameType
    from msgq_trio.protocol.framing import FrameParser, Run, encode_cbor, encode_simple

    core = Broker(Limits(), version="test")
    peer = core.connect("pub", pid=1, uid=0, gid=0, now=0.0)
    hub = TapHub(core, lambda: None, lambda: 0)
    data = b"".join(
        encode_simple(
            FrameType.MESSAGE,
            b"Stats",
            encode_cbor(i),
            encode_cbor({"n": i}) if i % 4 == 0 else b"",
            flags=i % 2,
            source=peer.stamp,
        )
        for i in range(40)
    )
    parser = FrameParser()
    parser.feed(data)
    [run] = parser.frames_and_runs(peer.stamp)
    assert isinstance(run, Run) and run.count == 40
    for flt, expect in ((TrafficFilter(), 40), (TrafficFilter(targets=["Other"]), 0)):
        by_run: list[Captured] = []
        by_frame: list[Captured] = []
        hub._sinks = [(flt.match, by_run.append)]
        hub._tap_run(peer, run, "delivered", 3)
        hub._sinks = [(flt.match, by_frame.append)]
        for frame in run.frames():
            hub._tap(peer, frame, "delivered", 3)
        assert len(by_run) == expect
        assert [c._replace(ts=0.0) for c in by_run] == [c._replace(ts=0.0) for c in by_frame]
