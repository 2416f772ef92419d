"""Property tests of the codec: streams split anywhere decode to the same frames, and no
input whatsoever makes the parser or the connection raise anything but RemoteProtocolError.
"""

from __future__ import annotations

import struct
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msgq_trio.protocol.codes import PROTOCOL_VERSION, FrameType
from msgq_trio.protocol.connection import EOF, NEED_DATA, Connection, Role
from msgq_trio.protocol.errors import RemoteProtocolError
from msgq_trio.protocol.framing import Frame, FrameParser, encode_cbor, encode_frame

FUZZ_MAX_FRAME = 1024 * 1024
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: The properties over streams of whole random frames: each example draws up to six
#: frames of nested CBOR (drawing them is most of the cost) and checks every split point
#: drawn, so 150 examples are about 900 frames per build and run. They run once per
#: build here and again in .ci/run's pure-Python and sanitizer steps, each run with new
#: random examples; the seeded differential fuzz (tests/protocol/test_differential.py)
#: compares both decoders over its own 2,000 streams (MSGQ_TRIO_FUZZ_COUNT).
STREAM_SETTINGS = settings(SETTINGS, max_examples=150)

cbor_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)


@st.composite
def frame_specs(draw: st.DrawFn, allow_big: bool = True) -> dict[str, Any]:
    return {
        "type": draw(st.sampled_from(list(FrameType))),
        "flags": draw(st.integers(0, 255)),
        "request_id": draw(st.integers(0, 2**64 - 1)),
        "target": draw(st.text(max_size=30)),
        "source": draw(st.binary(max_size=30)),
        "header": draw(st.none() | st.dictionaries(st.text(max_size=8), cbor_values, max_size=4)),
        "body": draw(st.none() | cbor_values),
        "blobs": draw(st.lists(st.binary(max_size=64), max_size=4)),
        # A > 256 KiB blob appended at encoding time: the parser's large-frame path.
        "big": allow_big and draw(st.integers(0, 15)) == 0,
        "n_fds": draw(st.integers(0, 3)),
    }


BIG_BLOB = bytes(range(256)) * 1200


def encode_spec(spec: dict[str, Any]) -> bytes:
    return b"".join(
        bytes(p)
        for p in encode_frame(
            spec["type"],
            target=spec["target"],
            request_id=spec["request_id"],
            flags=spec["flags"],
            source=spec["source"],
            header=encode_cbor(spec["header"]) if spec["header"] else b"",
            body=encode_cbor(spec["body"]) if spec["body"] is not None else b"",
            blobs=[*spec["blobs"], BIG_BLOB] if spec["big"] else spec["blobs"],
            n_fds=spec["n_fds"],
        )
    )


def expected(spec: dict[str, Any]) -> dict[str, Any]:
    """What decoding the encoded spec must give (an empty header map encodes as nothing)."""
    return {**spec, "header": spec["header"] or None}


def decoded(f: Frame) -> dict[str, Any]:
    blobs = [bytes(b) for b in f.blobs()]
    big = bool(blobs) and blobs[-1] == BIG_BLOB
    return {
        "type": f.type,
        "flags": f.flags,
        "request_id": f.request_id,
        "target": f.target,
        "source": f.source,
        "header": f.header() or None,
        "body": f.body(),
        "blobs": blobs[:-1] if big else blobs,
        "big": big,
        "n_fds": f.n_fds,
    }


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, prev = [], 0
    for p in [*points, len(data)]:
        pieces.append(data[prev:p])
        prev = p
    return [p for p in pieces if p]


@STREAM_SETTINGS
@given(
    specs=st.lists(frame_specs(), min_size=1, max_size=6),
    cuts=st.lists(st.integers(0, 2**31), max_size=12),
)
def test_split_stream_decodes_to_the_same_frames(
    specs: list[dict[str, Any]], cuts: list[int]
) -> None:
    """Random frames, encoded and concatenated, then split at random points and fed piece
    by piece, decode to exactly the original frames (next_frame, frames() and Connection)."""
    data = b"".join(encode_spec(s) for s in specs)
    want = [expected(s) for s in specs]
    pieces = split(data, cuts)
    assert b"".join(pieces) == data

    p = FrameParser()
    got = []
    for piece in pieces:
        p.feed(piece)
        while (f := p.next_frame()) is not None:
            got.append(decoded(f))
    assert got == want
    assert p.buffered == 0

    p = FrameParser()
    got = []
    for piece in pieces:
        p.feed(piece)
        got.extend(decoded(f) for f in p.frames())
    assert got == want

    # Through a client connection in READY, restricted to what a broker may send (and to
    # frames without file descriptors: those must arrive alongside via SCM_RIGHTS).
    allowed = [
        s
        for s in specs
        if s["type"] not in (FrameType.HELLO, FrameType.WELCOME, FrameType.GOODBYE)
        and not s["n_fds"]
    ]
    if allowed:
        c = Connection(Role.CLIENT)
        c.hello("fuzz")
        c.receive_data(b"".join(encode_frame(FrameType.WELCOME)))
        assert isinstance(c.next_event(), Frame)
        stream = b"".join(encode_spec(s) for s in allowed)
        got = []
        for piece in split(stream, cuts):
            c.receive_data(piece)
            while (ev := c.next_event()) is not NEED_DATA:
                assert isinstance(ev, Frame)
                got.append(decoded(ev))
        assert got == [expected(s) for s in allowed]


def touch(f: Frame) -> None:
    """Decode every section; a section error must be a RemoteProtocolError."""
    assert isinstance(f.target, str)
    for fn in (f.header, f.body):
        try:
            fn()
        except RemoteProtocolError:
            pass
    for b in f.blobs():
        bytes(b)


def feed_parser(pieces: list[bytes], batch: bool) -> tuple[list[bytes], object]:
    """Feed to a FrameParser; returns (raw frames, error code or None). Only
    RemoteProtocolError is tolerated: anything else propagates and fails the test."""
    p = FrameParser(FUZZ_MAX_FRAME)
    out: list[bytes] = []
    try:
        for piece in pieces:
            p.feed(piece)
            if batch:
                for f in p.frames():
                    touch(f)
                    out.append(bytes(f.raw))
            else:
                while (f := p.next_frame()) is not None:
                    touch(f)
                    out.append(bytes(f.raw))
        if batch:
            for f in p.frames():  # errors after valid frames surface on the next call
                touch(f)
                out.append(bytes(f.raw))
    except RemoteProtocolError as exc:
        return out, exc.code
    return out, None


def feed_connection(pieces: list[bytes], role: Role, batch: bool) -> None:
    c = Connection(role, FUZZ_MAX_FRAME)
    if role is Role.CLIENT:
        c.hello("fuzz")
    try:
        for piece in [*pieces, b""]:
            c.receive_data(piece)
            while True:
                if batch:
                    evs = c.events()
                    for ev in evs:
                        if isinstance(ev, Frame):
                            touch(ev)
                    if not evs or evs[-1] is EOF:
                        break
                else:
                    ev = c.next_event()
                    if ev is NEED_DATA or ev is EOF:
                        break
                    assert isinstance(ev, Frame)
                    touch(ev)
                if role is Role.BROKER and c.state.value == "HELLO_RECEIVED":
                    c.send(FrameType.WELCOME)
            if c._eof:
                break
    except RemoteProtocolError:
        pass


def check_only_remote_errors(pieces: list[bytes]) -> None:
    plain = feed_parser(pieces, batch=False)
    assert feed_parser(pieces, batch=True) == plain, "frames() and next_frame() disagree"
    for role in Role:
        feed_connection(pieces, role, batch=False)
        feed_connection(pieces, role, batch=True)


@SETTINGS
@given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(0, 2**31), max_size=6))
def test_random_bytes_raise_only_remote_protocol_error(data: bytes, cuts: list[int]) -> None:
    """Arbitrary bytes make FrameParser and Connection raise RemoteProtocolError or nothing."""
    check_only_remote_errors(split(data, cuts))


@st.composite
def prefix_then_noise(draw: st.DrawFn) -> bytes:
    """A structurally plausible prefix (small length, random fields) followed by noise."""
    body = draw(st.binary(max_size=300))
    ftype = draw(st.integers(0, 12))
    tlen, slen, hlen = (draw(st.integers(0, 40)) for _ in range(3))
    blen = max(0, len(body) - tlen - slen - hlen - draw(st.integers(0, 8)))
    nblobs = draw(st.integers(0, 3))
    prefix = struct.pack(
        ">IBBHHHHHQII",
        28 + len(body),
        ftype,
        draw(st.integers(0, 255)),
        tlen,
        slen,
        nblobs,
        draw(st.integers(0, 2)),
        draw(st.sampled_from([0, 0, 0, 1])),
        draw(st.integers(0, 2**64 - 1)),
        hlen,
        blen,
    )
    return prefix + body


@SETTINGS
@given(
    frames=st.lists(prefix_then_noise(), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 2**31), max_size=6),
)
def test_plausible_prefixes_raise_only_remote_protocol_error(
    frames: list[bytes], cuts: list[int]
) -> None:
    """Frames with plausible prefixes and random sections (random CBOR, random blob tables,
    random UTF-8 or not) only ever raise RemoteProtocolError."""
    check_only_remote_errors(split(b"".join(frames), cuts))


@st.composite
def mutated_stream(draw: st.DrawFn) -> bytes:
    hello = b"".join(
        encode_frame(
            FrameType.HELLO, header=encode_cbor({"version": PROTOCOL_VERSION, "name": "fuzz"})
        )
    )
    specs = draw(st.lists(frame_specs(allow_big=False), min_size=1, max_size=4))
    data = bytearray(hello + b"".join(encode_spec(s) for s in specs))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.integers(0, 4))
        pos = draw(st.integers(0, len(data)))
        if kind == 0 and pos < len(data):
            data[pos] = draw(st.integers(0, 255))
        elif kind == 1:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == 2:
            del data[pos : pos + draw(st.integers(1, 16))]
        elif kind == 3 and pos + 4 <= len(data):
            struct.pack_into(">I", data, pos, draw(st.integers(0, 2**32 - 1)))
        elif kind == 4 and pos + 2 <= len(data):
            struct.pack_into(">H", data, pos, draw(st.integers(0, 2**16 - 1)))
    return bytes(data)


@STREAM_SETTINGS
@given(data=mutated_stream(), cuts=st.lists(st.integers(0, 2**31), max_size=6))
def test_mutated_valid_frames_raise_only_remote_protocol_error(
    data: bytes, cuts: list[int]
) -> None:
    """Valid frames (after a HELLO) with random byte flips, insertions, deletions and
    overwritten length fields only ever raise RemoteProtocolError."""
    check_only_remote_errors(split(data, cuts))


@STREAM_SETTINGS
@given(
    specs=st.lists(frame_specs(), min_size=1, max_size=6),
    # Receives of at least 512 bytes: byte-sized ones are the feed path's (tested
    # above) and would make each example take seconds.
    sizes=st.lists(st.integers(512, 600_000), min_size=1, max_size=12),
)
def test_receiving_in_place_decodes_to_the_same_frames(
    specs: list[dict[str, Any]], sizes: list[int]
) -> None:
    """As the I/O layer does: while a large frame is in progress, bytes are received
    straight into the view ``receive_buffer()`` lends (then ``advance``), otherwise fed;
    receives of random sizes (cycled) decode to exactly the original frames."""
    data = b"".join(encode_spec(s) for s in specs)
    p = FrameParser()
    got: list[dict[str, Any]] = []
    pos, i = 0, 0
    while pos < len(data):
        size = sizes[i % len(sizes)]
        i += 1
        view = p.receive_buffer()
        if view is None:
            p.feed(data[pos : pos + size])
            pos += min(size, len(data) - pos)
        else:
            n = min(size, len(view), len(data) - pos)
            view[:n] = data[pos : pos + n]
            view.release()
            p.advance(n)
            pos += n
        got.extend(decoded(f) for f in p.frames())
    assert got == [expected(s) for s in specs]
    assert p.buffered == 0 and p.receive_buffer() is None
