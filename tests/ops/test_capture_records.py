"""The capture's fast record encoder writes exactly what the general one writes."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from msgq_trio.ops.capture import Captured, encode_line, make_record, record_line

names = st.text(max_size=40)
captured = st.builds(
    Captured,
    ts=st.floats(min_value=0, max_value=4e9, allow_nan=False),
    kind=st.sampled_from(["message", "command", "answer", "error", "notification",
                          "membership"]),
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


@given(captured, st.integers(1, 2**40), st.sampled_from(["none", "json", "base64"]),
       st.sampled_from([65_536, 300]))
def test_record_line_matches_the_general_encoder(
    c: Captured, seq: int, body_mode: str, max_bytes: int
) -> None:
    """Byte for byte the same line as ``encode_line(make_record(...))``, for every kind,
    sender, target, body mode and line bound, and it parses as one JSON object."""
    line = record_line(seq, c, body_mode, max_bytes)
    assert line == encode_line(make_record(seq, c, body_mode), max_bytes)
    assert line.endswith(b"\n")
    assert isinstance(json.loads(line), dict)
