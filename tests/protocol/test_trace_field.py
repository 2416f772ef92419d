"""The trace context on the wire (docs/PROTOCOL.md, "Trace context"): a frame with the
TRACED flag and a ``traceparent`` header parses the same through the compiled scan and
its Python reference, keeps its flag and header, and is never folded into a run of
plain messages (the broker records each traced frame's hop)."""

from __future__ import annotations

import cbor2
import pytest

from msgq_trio.protocol import framing
from msgq_trio.protocol.codes import Flag, FrameType
from msgq_trio.protocol.framing import Frame, Run, encode_frame, encode_small_bytes

try:
    from msgq_trio.protocol import _speedups
except ImportError:
    _speedups = None  # type: ignore[assignment]
else:
    # As tests/protocol/test_speedups.py: also under MSGQ_TRIO_PURE_PYTHON=1, where the
    # package does not wire the extension (init records the fallbacks, installs nothing).
    _speedups.init(
        Frame,
        Run,
        framing._VALID_MASK,
        int(FrameType.MESSAGE),
        framing._body_py,
        framing._encode_small_bytes_py,
    )

STAMP = b"l.7\0sender"
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def traced(target: str = "grp", ftype: int = FrameType.MESSAGE) -> bytes:
    header = {"traceparent": TP, "tracecause": "00f067aa0ba902b7"}
    if ftype == FrameType.REQUEST:
        header["cmd"] = "echo"
    return b"".join(
        bytes(p)
        for p in encode_frame(
            ftype,
            target=target,
            request_id=5 if ftype == FrameType.REQUEST else 0,
            flags=int(Flag.TRACED),
            header=cbor2.dumps(header),
            body=cbor2.dumps(b"payload"),
            source=STAMP,
        )
    )


def plain(target: str = "grp") -> bytes:
    return encode_small_bytes(int(FrameType.MESSAGE), target.encode(), b"payload", STAMP)


def scans() -> list[object]:
    impls: list[object] = [framing._scan_loop_py]
    if _speedups is not None:
        impls.append(_speedups.scan)
    return impls


@pytest.mark.parametrize("impl", scans())
def test_a_traced_message_breaks_a_run(impl: object) -> None:
    stream = plain() + plain() + traced() + plain() + plain() + traced(ftype=FrameType.REQUEST)
    out: list[Frame | Run] = []
    pos, _seen, bad = impl(  # type: ignore[operator]
        bytearray(stream), 0, framing.DEFAULT_MAX_FRAME_SIZE - 4, STAMP, out, 0
    )
    assert (pos, bad) == (len(stream), False)
    assert [type(x).__name__ for x in out] == ["Run", "Frame", "Run", "Frame"]
    assert [x.count for x in out if isinstance(x, Run)] == [2, 2]
    for f in (out[1], out[3]):
        assert isinstance(f, Frame)
        assert f.flags == int(Flag.TRACED)
        h = f.header()
        assert h["traceparent"] == TP and h["tracecause"] == "00f067aa0ba902b7"
        assert f.body() == b"payload"
    assert out[3].header()["cmd"] == "echo"  # type: ignore[union-attr]


@pytest.mark.skipif(_speedups is None, reason="the C extension is not built here")
def test_both_builds_agree_on_traced_frames() -> None:
    stream = bytearray(traced() + plain() + traced("other") + plain("other"))
    results = []
    for impl in scans():
        out: list[Frame | Run] = []
        r = impl(stream, 0, framing.DEFAULT_MAX_FRAME_SIZE - 4, STAMP, out, 0)  # type: ignore[operator]
        results.append((r, [(type(x), tuple(x) if isinstance(x, Frame) else x.raw) for x in out]))
    assert results[0] == results[1]


def test_the_parser_hands_over_traced_frames_whole() -> None:
    """Through the FrameParser (whichever scan is installed), as a client receives."""
    parser = framing.FrameParser(framing.DEFAULT_MAX_FRAME_SIZE)
    data = traced() + plain()
    parser.feed(data)
    frames = []
    while (f := parser.next_frame()) is not None:
        frames.append(f)
    assert [f.flags for f in frames] == [int(Flag.TRACED), 0]
    assert frames[0].header()["traceparent"] == TP
