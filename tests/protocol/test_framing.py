"""Unit tests of the frame codec (msgq_trio.protocol.framing): layout, limits, malformed input."""

from __future__ import annotations

import random
import struct
import tracemalloc

import cbor2
import pytest

from msgq_trio.protocol import frame as frame_module
from msgq_trio.protocol import framing
from msgq_trio.protocol.codes import ErrorCode, Flag, FrameType
from msgq_trio.protocol.errors import LocalProtocolError, RemoteProtocolError
from msgq_trio.protocol.framing import (
    PREFIX,
    PREFIX_SIZE,
    Frame,
    FrameParser,
    encode_cbor,
    encode_frame,
    restamp,
)


def join(pieces: list[bytes | bytearray | memoryview]) -> bytes:
    return b"".join(bytes(p) for p in pieces)


def parse_all(data: bytes, max_frame_size: int = framing.DEFAULT_MAX_FRAME_SIZE) -> list[Frame]:
    p = FrameParser(max_frame_size)
    p.feed(data)
    out = []
    while (f := p.next_frame()) is not None:
        out.append(f)
    assert p.buffered == 0, "bytes left over after parsing whole frames"
    return out


def parse_one(data: bytes, max_frame_size: int = framing.DEFAULT_MAX_FRAME_SIZE) -> Frame:
    frames = parse_all(data, max_frame_size)
    assert len(frames) == 1
    return frames[0]


def valid_frame(**kw: object) -> bytearray:
    args: dict[str, object] = {
        "target": "Group",
        "request_id": 7,
        "header": encode_cbor({"cmd": "x"}),
        "body": encode_cbor([1, 2, 3]),
    }
    args.update(kw)
    return bytearray(join(encode_frame(FrameType.REQUEST, **args)))  # type: ignore[arg-type]


def expect_remote_error(
    data: bytes | bytearray,
    code: ErrorCode = ErrorCode.PROTOCOL_ERROR,
    max_frame_size: int = framing.DEFAULT_MAX_FRAME_SIZE,
) -> None:
    p = FrameParser(max_frame_size)
    p.feed(bytes(data))
    with pytest.raises(RemoteProtocolError) as ei:
        while p.next_frame() is not None:
            pass
    assert ei.value.code == code
    # The parser is poisoned: the same error again on every later call.
    with pytest.raises(RemoteProtocolError):
        p.next_frame()
    # The batch calls (their fast loop, pure or compiled, then the careful path) refuse
    # the same bytes with the same code: the frames before the bad one come first.
    for source in (None, b""):
        p = FrameParser(max_frame_size)
        p.feed(bytes(data))
        with pytest.raises(RemoteProtocolError) as ei:
            for _ in range(3):
                p.frames() if source is None else p.frames_and_runs(source)
        assert ei.value.code == code


# -- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("ftype", list(FrameType))
def test_round_trip_every_frame_type(ftype: FrameType) -> None:
    """Every FrameType survives encode -> parse with all sections (target, source, header,
    body, blobs, request id, flags, n_fds) intact and the raw bytes equal to the encoding."""
    header = {"cmd": "get", "n": 3, "nested": {"a": [1, 2]}}
    body = {"zone": "example.org", "data": b"\x00\x01", "list": list(range(10))}
    blobs = [b"", b"blob-one", bytes(range(256)) * 40]
    data = join(
        encode_frame(
            ftype,
            target="Zöne[3]",
            request_id=2**64 - 1,
            flags=int(Flag.ALL),
            header=encode_cbor(header),
            body=encode_cbor(body),
            blobs=blobs,
            source="l.42\0Zöne".encode(),
            n_fds=2,
        )
    )
    f = parse_one(data)
    assert f.type == ftype
    assert f.flags == Flag.ALL
    assert f.request_id == 2**64 - 1
    assert f.target == "Zöne[3]"
    assert f.source == "l.42\0Zöne".encode()
    assert f.n_fds == 2
    assert f.n_blobs == 3
    assert f.header() == header
    assert f.body() == body
    assert [bytes(b) for b in f.blobs()] == blobs
    assert bytes(f.raw) == data
    assert struct.unpack_from(">I", data)[0] == len(data) - 4


@pytest.mark.parametrize("ftype", list(FrameType))
def test_round_trip_empty_sections(ftype: FrameType) -> None:
    """A frame with every section empty parses to an empty header map, a None body, no
    blobs, and is exactly the 32-byte prefix."""
    data = join(encode_frame(ftype))
    assert len(data) == PREFIX_SIZE
    f = parse_one(data)
    assert (f.type, f.flags, f.request_id, f.target, f.source, f.n_fds) == (ftype, 0, 0, "", b"", 0)
    assert f.header() == {}
    assert f.body() is None
    assert f.blobs() == []


def test_encode_simple_matches_encode_frame() -> None:
    """The client's fast encoder produces exactly the bytes of encode_frame."""
    encode_simple = framing.encode_simple
    for target, body, header, rid, flags in [
        ("G", b"", b"", 0, 0),
        ("Grüppe[?]", encode_cbor({"a": 1}), encode_cbor({"cmd": "c"}), 99, 1),
        ("l.5", encode_cbor(b"x" * 300_000), b"", 1, 0),
    ]:
        fast = encode_simple(FrameType.MESSAGE, target.encode(), body, header, rid, flags)
        slow = join(
            encode_frame(
                FrameType.MESSAGE,
                target=target,
                body=body,
                header=header,
                request_id=rid,
                flags=flags,
            )
        )
        assert bytes(fast) == slow


@pytest.mark.parametrize("tail_size", [10, 300_000])
def test_restamp_replaces_only_the_source(tail_size: int) -> None:
    """restamp() swaps the source section (any length) and leaves every other section
    identical, for small frames and for frames whose tail is passed through uncopied."""
    body = encode_cbor(b"b" * tail_size)
    original = join(
        encode_frame(
            FrameType.MESSAGE,
            target="Tgt",
            request_id=5,
            flags=1,
            header=encode_cbor({"k": "v"}),
            body=body,
            blobs=[b"xyz", b""],
            source=b"forged-source-of-some-length",
        )
    )
    f = parse_one(original)
    for new_source in (b"", b"l.1\0a", b"l.123456\0a-much-longer-client-name"):
        g = parse_one(join(restamp(f, new_source)))
        assert g.source == new_source
        assert (g.type, g.flags, g.request_id, g.target) == (
            f.type,
            f.flags,
            f.request_id,
            f.target,
        )
        assert g.header() == {"k": "v"}
        assert bytes(g.body_bytes) == body
        assert [bytes(b) for b in g.blobs()] == [b"xyz", b""]


def test_many_frames_in_one_buffer_and_byte_by_byte() -> None:
    """Several frames concatenated parse in order whether fed at once or one byte at a time,
    and the parser reports NEED_DATA (None) and in_frame correctly in between."""
    frames = [
        join(encode_frame(FrameType.MESSAGE, target=f"t{i}", body=encode_cbor(i)))
        for i in range(20)
    ]
    data = b"".join(frames)
    assert [f.body() for f in parse_all(data)] == list(range(20))
    p = FrameParser()
    got = []
    for i in range(len(data)):
        p.feed(data[i : i + 1])
        f = p.next_frame()
        if f is not None:
            got.append(f.body())
            assert p.next_frame() is None
            assert not p.in_frame
        else:
            assert p.in_frame
    assert got == list(range(20))


def test_frames_batch_api_matches_next_frame() -> None:
    """FrameParser.frames() (the batch path) returns the same frames as next_frame()."""
    data = b"".join(
        join(
            encode_frame(
                FrameType.REQUEST,
                target=f"t{i}",
                request_id=i + 1,
                header=encode_cbor({"cmd": "c"}),
                body=encode_cbor("x" * i),
                blobs=[b"b" * i] if i % 3 == 0 else (),
                source=b"s" * (i % 2),
            )
        )
        for i in range(50)
    )
    expected = [
        (
            f.type,
            f.request_id,
            f.target,
            f.source,
            f.header(),
            f.body(),
            [bytes(b) for b in f.blobs()],
        )
        for f in parse_all(data)
    ]
    for chunk in (1, 7, 100, len(data)):
        p = FrameParser()
        got = []
        for i in range(0, len(data), chunk):
            p.feed(data[i : i + chunk])
            got.extend(
                (
                    f.type,
                    f.request_id,
                    f.target,
                    f.source,
                    f.header(),
                    f.body(),
                    [bytes(b) for b in f.blobs()],
                )
                for f in p.frames()
            )
        assert got == expected


def test_large_frame_in_64k_chunks() -> None:
    """A frame with a 5 MiB blob fed in 64 KiB chunks (followed by a small frame in the same
    stream) comes out intact, and the small frame after it too."""
    blob = bytes(range(256)) * (5 * 1024 * 1024 // 256)
    blob = blob[:-3] + b"END"
    big = join(
        encode_frame(
            FrameType.MESSAGE, target="Big", body=encode_cbor({"n": 1}), blobs=[b"head", blob]
        )
    )
    small = join(encode_frame(FrameType.MESSAGE, target="Small", body=encode_cbor("after")))
    data = big + small
    p = FrameParser()
    got: list[Frame] = []
    step = 64 * 1024
    for i in range(0, len(data), step):
        p.feed(data[i : i + step])
        while (f := p.next_frame()) is not None:
            got.append(f)
    assert [f.target for f in got] == ["Big", "Small"]
    blobs = got[0].blobs()
    assert bytes(blobs[0]) == b"head"
    assert len(blobs[1]) == len(blob)
    assert bytes(blobs[1]) == blob
    assert got[0].body() == {"n": 1}
    assert got[1].body() == "after"
    assert p.buffered == 0


@pytest.mark.parametrize("step", [1, 7, 4096, 64 * 1024, 256 * 1024])
def test_feed_copies_so_the_receive_buffer_can_be_reused(step: int) -> None:
    """The I/O layer receives into one reused buffer and passes the parser a view of it
    (transport/sockets.SocketReceiver): whatever ``feed`` keeps must be a copy, so overwriting the
    buffer after each feed (the next receive) changes no frame, small or large."""
    blob = bytes(range(256)) * (300 * 1024 // 256)  # above _LARGE_FRAME: assembled apart
    frames = [
        join(encode_frame(FrameType.MESSAGE, target="G", body=encode_cbor(i), source=b"l.1"))
        for i in range(50)
    ]
    frames.insert(20, join(encode_frame(FrameType.MESSAGE, target="Big", blobs=[blob])))
    data = b"".join(frames)
    scratch = bytearray(max(step, 1))
    p = FrameParser()
    got: list[Frame] = []
    for i in range(0, len(data), step):
        chunk = data[i : i + step]
        scratch[: len(chunk)] = chunk
        p.feed(memoryview(scratch)[: len(chunk)])
        scratch[:] = b"\xee" * len(scratch)  # the next receive overwrites it
        got.extend(p.frames())
    assert [bytes(f.raw) for f in got] == frames
    assert bytes(got[20].blobs()[0]) == blob


# -- limits -----------------------------------------------------------------------------------
def test_absurd_length_prefix_is_refused_without_allocating() -> None:
    """A 4 GiB length prefix is refused as FRAME_TOO_LARGE from the first 4 bytes alone, and
    the parser allocates nothing near the announced size."""
    p = FrameParser(1024 * 1024)
    tracemalloc.start()
    try:
        p.feed(struct.pack(">I", 0xFFFFFFF0))
        with pytest.raises(RemoteProtocolError) as ei:
            p.next_frame()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ei.value.code == ErrorCode.FRAME_TOO_LARGE
    assert peak < 256 * 1024
    with pytest.raises(RemoteProtocolError):
        p.next_frame()


def test_absurd_length_with_default_limit() -> None:
    """With the default 64 MiB limit, a prefix announcing 64 MiB + 1 byte is refused
    before any of the frame's body has arrived."""
    p = FrameParser()
    p.feed(struct.pack(">I", framing.DEFAULT_MAX_FRAME_SIZE - 3) + b"\x03")
    with pytest.raises(RemoteProtocolError) as ei:
        p.next_frame()
    assert ei.value.code == ErrorCode.FRAME_TOO_LARGE


def test_max_frame_size_boundary() -> None:
    """A frame of exactly max_frame_size bytes is accepted; one byte more is FRAME_TOO_LARGE."""
    limit = 4096
    overhead = len(join(encode_frame(FrameType.MESSAGE, target="t", blobs=[b""])))
    exact = join(encode_frame(FrameType.MESSAGE, target="t", blobs=[b"x" * (limit - overhead)]))
    assert len(exact) == limit
    assert bytes(parse_one(exact, limit).blobs()[0]) == b"x" * (limit - overhead)
    over = join(encode_frame(FrameType.MESSAGE, target="t", blobs=[b"x" * (limit - overhead + 1)]))
    expect_remote_error(over, ErrorCode.FRAME_TOO_LARGE, max_frame_size=limit)


def test_length_shorter_than_prefix() -> None:
    """A length field smaller than the fixed prefix is a protocol error (not too-large)."""
    data = valid_frame()
    struct.pack_into(">I", data, 0, 10)
    expect_remote_error(data, ErrorCode.PROTOCOL_ERROR)


def test_invalid_max_frame_size_argument() -> None:
    """FrameParser refuses a non-positive or > u32 max_frame_size."""
    for bad in (0, -1, 2**32):
        with pytest.raises(ValueError):
            FrameParser(bad)


def test_encode_refuses_oversized_sections() -> None:
    """Sections too long for their length fields are the caller's error (LocalProtocolError)."""
    with pytest.raises(LocalProtocolError):
        encode_frame(FrameType.MESSAGE, target="t" * 65536)
    with pytest.raises(LocalProtocolError):
        encode_frame(FrameType.MESSAGE, source=b"s" * 65536)
    with pytest.raises(LocalProtocolError):
        encode_frame(FrameType.MESSAGE, blobs=[b""] * 65536)
    with pytest.raises(LocalProtocolError):
        encode_cbor(object())


# -- malformed frames -------------------------------------------------------------------------
def test_reserved_field_must_be_zero() -> None:
    """A non-zero reserved prefix field (bytes 14-15) is a protocol error."""
    data = valid_frame()
    struct.pack_into(">H", data, 14, 1)
    expect_remote_error(data)


@pytest.mark.parametrize("bad_type", [0, 10, 99, 255])
def test_unknown_frame_type(bad_type: int) -> None:
    """A frame type outside the registry is a protocol error."""
    data = valid_frame()
    data[4] = bad_type
    expect_remote_error(data)


@pytest.mark.parametrize(
    "field_offset,delta",
    [
        (6, 1),  # target_len one too long
        (6, -1),  # target_len one too short
        (8, 3),  # source_len
        (24, 1),  # header_len
        (28, -2),  # body_len
    ],
)
def test_section_lengths_must_add_up(field_offset: int, delta: int) -> None:
    """Section lengths that do not add up to the frame length are a protocol error."""
    data = valid_frame(source=b"l.1\0x")
    fmt = ">H" if field_offset < 16 else ">I"
    (value,) = struct.unpack_from(fmt, data, field_offset)
    struct.pack_into(fmt, data, field_offset, value + delta)
    expect_remote_error(data)


def test_blob_lengths_must_add_up() -> None:
    """Blob length table entries that disagree with the frame length are a protocol error."""
    data = valid_frame(blobs=[b"abc", b"defg"])
    table = len(data) - 7 - 8
    (first,) = struct.unpack_from(">I", data, table)
    assert first == 3
    struct.pack_into(">I", data, table, 4)
    expect_remote_error(data)


def test_blob_count_beyond_frame() -> None:
    """An n_blobs whose length table would not fit in the frame is a protocol error."""
    data = valid_frame()
    struct.pack_into(">H", data, 10, 1000)
    expect_remote_error(data)


def test_target_must_be_utf8() -> None:
    """A target section that is not UTF-8 is a protocol error."""
    good = join(encode_frame(FrameType.MESSAGE, target="ab"))
    data = bytearray(good)
    data[PREFIX_SIZE : PREFIX_SIZE + 2] = b"\xff\xfe"
    expect_remote_error(data)


def test_non_utf8_target_after_a_valid_frame() -> None:
    """A bad target in the second frame of a batch: the first frame is still delivered,
    then the error is raised (by next_frame and by the batch API frames())."""
    good = join(encode_frame(FrameType.MESSAGE, target="ok"))
    bad = bytearray(join(encode_frame(FrameType.MESSAGE, target="ab")))
    bad[PREFIX_SIZE : PREFIX_SIZE + 2] = b"\xc3\x28"
    p = FrameParser()
    p.feed(good + bytes(bad))
    assert p.next_frame().target == "ok"  # type: ignore[union-attr]
    with pytest.raises(RemoteProtocolError):
        p.next_frame()
    p = FrameParser()
    p.feed(good + bytes(bad))
    assert [f.target for f in p.frames()] == ["ok"]
    with pytest.raises(RemoteProtocolError):
        p.frames()


def _frame_with_header_bytes(header: bytes, body: bytes = b"") -> Frame:
    return parse_one(join(encode_frame(FrameType.MESSAGE, target="t", header=header, body=body)))


def test_trailing_bytes_after_cbor_header() -> None:
    """A header section holding a CBOR map followed by extra bytes is a protocol error."""
    f = _frame_with_header_bytes(cbor2.dumps({"a": 1}) + b"\x00")
    with pytest.raises(RemoteProtocolError):
        f.header()


def test_trailing_bytes_after_cbor_body() -> None:
    """A body section with bytes after the CBOR value is a protocol error."""
    f = _frame_with_header_bytes(b"", cbor2.dumps([1]) + cbor2.dumps(2))
    with pytest.raises(RemoteProtocolError):
        f.body()


@pytest.mark.parametrize(
    "header",
    [
        cbor2.dumps([1, 2]),  # not a map
        cbor2.dumps("text"),  # not a map
        b"\xa1\x61",  # truncated map
        b"\xff",  # break code out of place
        b"\x1f",  # reserved additional info
        b"\x5b\xff\xff\xff\xff\xff\xff\xff\xff",  # absurd byte string length
    ],
)
def test_malformed_header(header: bytes) -> None:
    """A header that is not exactly one well-formed CBOR map is a protocol error."""
    f = _frame_with_header_bytes(header)
    with pytest.raises(RemoteProtocolError):
        f.header()


def test_prefix_layout_matches_the_documented_offsets() -> None:
    """The prefix is 32 bytes with fields at the offsets of docs/PROTOCOL.md."""
    data = join(
        encode_frame(
            FrameType.NOTIFY,
            target="abc",
            request_id=0x0102030405060708,
            flags=1,
            header=b"\xa0",
            body=b"\xf6",
            source=b"src",
            n_fds=4,
            blobs=[b"zz"],
        )
    )
    assert PREFIX.size == 32
    (length,) = struct.unpack_from(">I", data, 0)
    assert length == len(data) - 4
    assert data[4] == FrameType.NOTIFY
    assert data[5] == 1
    assert struct.unpack_from(">HHHHH", data, 6) == (3, 3, 1, 4, 0)
    assert struct.unpack_from(">Q", data, 16) == (0x0102030405060708,)
    assert struct.unpack_from(">II", data, 24) == (1, 1)
    assert data[32:35] == b"abc"
    assert data[35:38] == b"src"


def test_frames_and_runs_match_frames() -> None:
    """frames_and_runs(source) returns the same frames as frames(), in the same order, with
    consecutive MESSAGEs to one target that carry exactly ``source`` grouped into runs;
    other sources, types, targets, descriptors and blobs end a run; any receive cuts."""
    rng = random.Random(5)
    stamp = b"l.3\0tx"
    pieces: list[bytes] = []
    for i in range(400):
        k = rng.random()
        target = rng.choice([b"G", b"l.1", b"H"])
        if k < 0.6:
            pieces.append(
                framing.encode_simple(FrameType.MESSAGE, target, bytes(i % 7), source=stamp)
            )
        elif k < 0.7:
            pieces.append(framing.encode_simple(FrameType.MESSAGE, target, b"", source=b"l.3"))
        elif k < 0.8:
            pieces.append(
                join(encode_frame(FrameType.MESSAGE, target="G", source=stamp, blobs=[b"ab"]))
            )
        elif k < 0.9:
            pieces.append(join(encode_frame(FrameType.MESSAGE, target="G", source=stamp, n_fds=1)))
        else:
            pieces.append(
                framing.encode_simple(
                    FrameType.REQUEST, target, b"", request_id=i + 1, source=stamp
                )
            )
    data = b"".join(pieces)
    p = FrameParser()
    got: list[bytes] = []
    runs = 0
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 300)
        p.feed(data[pos : pos + n])
        pos += n
        for item in p.frames_and_runs(stamp):
            if isinstance(item, framing.Run):
                runs += 1
                frames = item.frames()
                assert len(frames) == item.count
                assert b"".join(bytes(f.raw) for f in frames) == item.raw
                for f in frames:
                    assert (f.type, f.source, f.n_fds, f.n_blobs) == (
                        FrameType.MESSAGE,
                        stamp,
                        0,
                        0,
                    )
                    assert f.target == item.target
                    assert f == parse_one(bytes(f.raw))
            else:
                frames = [item]  # may be self-stamped: the careful path makes no runs
            got.extend(bytes(f.raw) for f in frames)
    assert got == pieces
    assert runs > 10


def test_encode_simple_with_source() -> None:
    """encode_simple(source=...) writes the source section like encode_frame does."""
    fast = framing.encode_simple(FrameType.MESSAGE, b"G", b"\x01", b"\xa0", source=b"l.4\0x")
    assert fast == join(
        encode_frame(FrameType.MESSAGE, target="G", body=b"\x01", header=b"\xa0", source=b"l.4\0x")
    )
    assert parse_one(fast).source == b"l.4\0x"


@pytest.mark.parametrize("n", [0, 1, 23, 24, 255, 256, 65535, 65536])
def test_bytes_body_fast_decode_matches_cbor2(n: int) -> None:
    """A byte-string body is decoded without cbor2 to the same value; with a trailing byte
    or a head that claims more than the section it is still a protocol error."""
    value = bytes(range(256)) * (n // 256) + bytes(range(n % 256))
    body = cbor2.dumps(value)
    f = parse_one(framing.encode_simple(FrameType.MESSAGE, b"G", body, source=b"l.1\0x"))
    assert f.body() == value and type(f.body()) is bytes
    f = parse_one(join(encode_frame(FrameType.MESSAGE, target="G", body=body, blobs=[b"ab"])))
    assert f.body() == value
    with pytest.raises(RemoteProtocolError):
        parse_one(framing.encode_simple(FrameType.MESSAGE, b"G", body + b"\0")).body()


@pytest.mark.parametrize(
    "body", [b"\x58", b"\x59\x00", b"\x5a\x00\x00\x00", b"\x45ab", b"\x58\x01ab", b"\x5b\x00"]
)
def test_truncated_bytes_body_is_a_protocol_error(body: bytes) -> None:
    """Byte-string heads that do not fill the body section exactly are rejected."""
    with pytest.raises(RemoteProtocolError):
        parse_one(framing.encode_simple(FrameType.MESSAGE, b"G", body)).body()


@pytest.mark.parametrize("n", [0, 1, 23, 24, 255, 256, 65535, 65536, 70_000, 4 * 1024 * 1024])
def test_encode_bytes_message_is_encode_simple_of_the_cbor_bytes(n: int) -> None:
    """The two-piece large-body encoding is byte-identical to the one-piece one, at every
    CBOR head width, and its second piece is the caller's payload object (not a copy)."""
    payload = random.randbytes(n)
    pieces = framing.encode_bytes_message(
        int(FrameType.MESSAGE), b"Grp", payload, source=b"l.7\0me"
    )
    assert pieces[1] is payload
    whole = framing.encode_simple(
        int(FrameType.MESSAGE), b"Grp", cbor2.dumps(payload), source=b"l.7\0me"
    )
    assert b"".join(pieces) == whole
    parser = framing.FrameParser()
    parser.feed(whole)
    frame = parser.next_frame()
    assert frame is not None and frame.body() == payload and frame.source == b"l.7\0me"


@pytest.mark.parametrize("n", [0, 1, 23, 24, 255, 256, 65535, 65536, 70_000])
def test_encode_small_bytes_is_encode_simple_of_the_cbor_bytes(n: int) -> None:
    """The one-step binary-body encoding is byte-identical to encode_simple over
    cbor2's encoding, at every CBOR head width, and refuses an oversized target."""
    payload = random.randbytes(n)
    whole = framing.encode_simple(
        int(FrameType.MESSAGE), b"Grp", cbor2.dumps(payload), source=b"l.7\0me"
    )
    assert framing.encode_small_bytes(int(FrameType.MESSAGE), b"Grp", payload, b"l.7\0me") == whole
    with pytest.raises(LocalProtocolError):
        framing.encode_small_bytes(int(FrameType.MESSAGE), b"G" * 65536, payload, b"")


# -- the small-header cache ------------------------------------------------------------------
def test_cached_header_is_a_fresh_dict_each_time() -> None:
    """Frame.header() serves repeated small headers from a cache: what one caller does to
    its dict must not show in the next frame's header."""
    frames = [
        parse_one(
            join(
                encode_frame(
                    FrameType.REQUEST,
                    target="g",
                    request_id=i + 1,
                    header=encode_cbor({"cmd": "echo", "n": 1}),
                )
            )
        )
        for i in range(3)
    ]
    first = frames[0].header()
    first["cmd"] = "changed"
    first["extra"] = True
    assert frames[1].header() == {"cmd": "echo", "n": 1}
    assert frames[2].header() == {"cmd": "echo", "n": 1}
    assert frames[1].header() is not frames[2].header()


def test_header_with_nested_values_is_decoded_afresh() -> None:
    """Headers holding lists or maps are not cached: a shallow copy would share them."""
    enc = encode_cbor({"to": [["l.1", "a"]]})
    f1, f2 = (
        parse_one(join(encode_frame(FrameType.ROUTED, target="l.2", request_id=1, header=enc)))
        for _ in range(2)
    )
    h1 = f1.header()
    h1["to"].append(["l.9", "x"])  # type: ignore[attr-defined]
    assert f2.header() == {"to": [["l.1", "a"]]}


def test_header_cache_is_bounded_and_large_frames_work() -> None:
    """Many distinct headers keep the cache at its cap; a large frame (assembled in a
    bytearray) decodes its header through the same path."""
    for i in range(frame_module._HEADER_CACHE_MAX * 3):
        f = parse_one(
            join(
                encode_frame(
                    FrameType.REQUEST,
                    target="g",
                    request_id=1,
                    header=encode_cbor({"cmd": f"c{i}"}),
                )
            )
        )
        assert f.header() == {"cmd": f"c{i}"}
        assert len(frame_module._header_cache) <= frame_module._HEADER_CACHE_MAX
    body = encode_cbor(b"x" * (framing._LARGE_FRAME + 10))
    data = join(
        encode_frame(
            FrameType.REQUEST,
            target="g",
            request_id=1,
            header=encode_cbor({"cmd": "big"}),
            body=body,
        )
    )
    p = FrameParser()
    f = None
    for k in range(0, len(data), 65536):  # in pieces: the parser assembles a large frame
        assert f is None
        p.feed(data[k : k + 65536])
        f = p.next_frame()
    assert f is not None and not isinstance(f.raw, bytes)
    assert f.header() == {"cmd": "big"} and f.header() == {"cmd": "big"}
    # The body of a bytearray-backed frame is a bytes object of its own.
    b = f.body()
    assert type(b) is bytes and b == b"x" * (framing._LARGE_FRAME + 10)


def test_large_frame_buffer_grows_with_what_arrives() -> None:
    """A large frame's buffer is at most max(256 KiB, 2 x the bytes received), whatever
    its prefix claims, and a view lent by receive_buffer() must be given back by advance()
    before the next one (misuse is the caller's error, LocalProtocolError)."""
    frame = join(encode_frame(FrameType.MESSAGE, target="Big", blobs=[b"z" * (3 << 20)]))
    p = FrameParser()
    p.feed(frame[:100])
    assert p.frames() == [] and p.buffered == 100
    view = p.receive_buffer()
    assert view is not None and len(view) == framing._LARGE_FRAME - 100
    lent = len(view)
    with pytest.raises(LocalProtocolError):
        p.receive_buffer()  # the first view is still lent
    view.release()
    with pytest.raises(LocalProtocolError):
        p.advance(lent + 1)
    p.advance(0)
    with pytest.raises(LocalProtocolError):
        p.advance(0)  # nothing lent
    pos = 100
    while pos < len(frame):
        view = p.receive_buffer()
        assert view is not None
        capacity = pos + len(view)
        assert capacity <= max(framing._LARGE_FRAME, 2 * pos)  # bounded by what arrived
        n = min(len(view), 100_000)
        view[:n] = frame[pos : pos + n]
        view.release()
        p.advance(n)
        pos += n
    assert p.receive_buffer() is None
    [f] = p.frames()
    assert bytes(f.raw) == frame and len(f.raw) == len(frame)


# -- a client's large byte-string bodies ------------------------------------------------------

_BIG_BODY = bytes(range(256)) * (3 * 4096) + b"END"  # 3 MiB + 3: above _LARGE_FRAME


def _stream_with_big_body(body: bytes = _BIG_BODY) -> tuple[list[bytes], bytes]:
    frames = [
        join(encode_frame(FrameType.MESSAGE, target="G", body=encode_cbor("before"))),
        join(
            encode_frame(
                FrameType.MESSAGE,
                target="Big",
                source=b"l.7",
                header=encode_cbor({"cmd": "big"}),
                body=encode_cbor(body),
            )
        ),
        join(encode_frame(FrameType.MESSAGE, target="G", body=encode_cbor("after"))),
    ]
    return frames, b"".join(frames)


def _check_own_body(f: Frame, frame: bytes, body: bytes = _BIG_BODY) -> None:
    got = f.body()
    assert type(got) is bytes and got == body
    assert got is f.large_body and f.body() is got  # handed out as received: no copy
    assert bytes(f.raw) + f.large_body == frame  # raw ends with the body's CBOR head
    assert f.header() == {"cmd": "big"} and f.target == "Big" and f.source == b"l.7"
    assert bytes(f.body_bytes) == encode_cbor(body)


@pytest.mark.parametrize("step", [4096, 64 * 1024, 1 << 20])
def test_client_parser_receives_a_large_bytes_body_into_its_own_bytes(step: int) -> None:
    """With own_bodies (a client's parser), a large frame whose body is one byte string
    is received in two parts: the body's content straight into the bytes that body()
    returns. The first bytes arrive one by one (the parser waits for the body's head
    before it decides), the rest in ``step`` pieces through a reused buffer (feed copies);
    sizes and counts are those of the whole frame."""
    frames, data = _stream_with_big_body()
    p = FrameParser(own_bodies=True)
    got: list[Frame] = []
    scratch = bytearray(step)
    pos = 0
    while pos < len(data):
        n = 1 if pos < len(frames[0]) + 80 else step
        chunk = data[pos : pos + n]
        scratch[: len(chunk)] = chunk
        p.feed(memoryview(scratch)[: len(chunk)])
        scratch[:] = b"\xee" * len(scratch)  # the next receive overwrites it
        got.extend(p.frames())
        pos += len(chunk)
    assert p.buffered == 0
    assert [f.target for f in got] == ["G", "Big", "G"]
    _check_own_body(got[1], frames[1])
    assert [f.body() for f in (got[0], got[2])] == ["before", "after"]
    assert not got[0].large_body and not got[2].large_body


def test_client_parser_lends_the_body_itself_to_receive_into() -> None:
    """receive_buffer() lends views of the body's own bytes once the head is in; advance()
    is bounded by what the frame still lacks; returned_bytes counts the whole frame."""
    frames, _ = _stream_with_big_body()
    big = frames[1]
    p = FrameParser(own_bodies=True)
    p.feed(big[:1000])
    assert p.frames() == [] and p.buffered == 1000
    pos = 1000
    view = p.receive_buffer()
    assert view is not None and len(view) == len(big) - 1000  # the whole rest, at once
    with pytest.raises(LocalProtocolError):
        p.advance(len(view) + 1)
    view.release()
    p.advance(0)
    while pos < len(big):
        view = p.receive_buffer()
        assert view is not None and len(view) == len(big) - pos
        n = min(len(view), 700_001)
        view[:n] = big[pos : pos + n]
        view.release()
        p.advance(n)
        pos += n
        assert p.buffered == pos
    assert p.receive_buffer() is None
    p.feed(frames[2])
    [f, after] = p.frames()
    assert p.returned_bytes == len(big) + len(frames[2])
    _check_own_body(f, big)
    assert after.body() == "after"


def test_only_a_client_parser_receives_bodies_apart() -> None:
    """The broker's parser (the default) keeps a large frame whole in one buffer."""
    frames, data = _stream_with_big_body()
    p = FrameParser()
    p.feed(data[:5000])
    got = p.frames()
    p.feed(data[5000:])
    got += p.frames()
    assert [bytes(f.raw) for f in got] == frames and not got[1].large_body
    assert got[1].body() == _BIG_BODY


def _big_frame(**kw: object) -> bytes:
    return join(encode_frame(FrameType.MESSAGE, target="Big", **kw))  # type: ignore[arg-type]


def _one_frame_in_parts(frame: bytes) -> Frame:
    """``frame`` through a client's parser in 64 KiB parts (the large frame's path: it is
    not all there when the parser first sees it)."""
    p = FrameParser(own_bodies=True)
    got: list[Frame] = []
    for i in range(0, len(frame), 64 * 1024):
        p.feed(frame[i : i + 64 * 1024])
        got += p.frames()
    [f] = got
    return f


@pytest.mark.parametrize(
    "frame",
    [
        # A text string, a map: not a byte string.
        _big_frame(body=encode_cbor("t" * (1 << 20))),
        _big_frame(body=encode_cbor({"b": b"x" * (1 << 20)})),
        # Blobs beside the body.
        _big_frame(body=encode_cbor(b"x" * (1 << 20)), blobs=[b"blob"]),
        # A large frame whose body is not most of it (its header is what is large).
        _big_frame(header=encode_cbor({"h": b"h" * 200_000}), body=encode_cbor(b"s" * 100_000)),
        # A header too long to wait for before deciding.
        _big_frame(header=encode_cbor({"h": b"h" * (1 << 20)}), body=encode_cbor(b"b" * (1 << 20))),
    ],
    ids=["text", "map", "blobs", "small-body", "long-header"],
)
def test_other_large_frames_stay_whole_in_a_client_parser(frame: bytes) -> None:
    """Only a byte-string body that is most of its frame, with no blobs and a head within
    reach, is received apart; any other large frame stays whole in ``raw``."""
    f = _one_frame_in_parts(frame)
    assert bytes(f.raw) == frame and not f.large_body
    assert f.body() == cbor2.loads(bytes(f.body_bytes))


def test_a_byte_string_body_of_the_wrong_length_is_still_refused() -> None:
    """A byte string whose head claims less than its section holds (trailing bytes) is not
    received apart: body() refuses it as for any frame."""
    content = b"x" * (1 << 20)
    section = encode_cbor(content) + b"\x00"
    frame = _big_frame(body=section)
    f = _one_frame_in_parts(frame)
    assert not f.large_body
    with pytest.raises(RemoteProtocolError):
        f.body()


RECEIVE = 256 * 1024  # what the drivers receive at most at once (RECEIVE_SIZE)


@pytest.mark.parametrize("own_bodies", [False, True], ids=["broker", "client"])
def test_a_receive_that_starts_a_large_frame_is_copied_once(own_bodies: bool) -> None:
    """The first receive of a large frame, arriving with nothing buffered (as every one
    does in a stream of large frames: a receive into a frame ends where it does), goes
    straight into the frame's own buffer (the broker's) or body (a client's): the parser
    allocates no second buffer of its size on the way, and the frames come out whole."""
    frames, _ = _stream_with_big_body()
    big = frames[1]
    first = memoryview(bytearray(big[:RECEIVE]))
    junk = b"\xee" * RECEIVE
    p = FrameParser(own_bodies=own_bodies)
    p.feed(frames[0])
    assert [f.body() for f in p.frames()] == ["before"] and p.buffered == 0
    tracemalloc.start()
    try:
        p.feed(first)
        first[:] = junk  # the next receive overwrites it
        assert p.frames() == []
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The frame's own buffer (a client's: the body, whole) and nothing else of the size
    # of the receive: appending it to the buffer of small frames first would add it.
    own = len(_BIG_BODY) if own_bodies else 2 * RECEIVE
    assert own <= peak < own + RECEIVE // 2
    assert p.buffered == RECEIVE
    pos = RECEIVE
    while pos < len(big):
        view = p.receive_buffer()
        assert view is not None
        n = min(len(view), RECEIVE)
        view[:n] = big[pos : pos + n]
        view.release()
        p.advance(n)
        pos += n
    p.feed(frames[2])
    [f, after] = p.frames()
    if own_bodies:
        _check_own_body(f, big)
    else:
        assert bytes(f.raw) == big and f.body() == _BIG_BODY
    assert after.body() == "after" and p.buffered == 0


@pytest.mark.parametrize(
    ("tail", "hlen", "blen"),
    [
        (2**62, 2**62, 5),
        (2**63, 0, 1),
        (64, 0, 1),
        (0, 60, 5),
        (-1, 0, 3),
        (32, -40, 3),
        (32, 0, -1),
    ],
)
def test_body_of_a_hand_made_frame_outside_raw_is_refused(tail: int, hlen: int, blen: int) -> None:
    """Frame is public: one made by hand whose lengths put the body outside ``raw`` gets
    LocalProtocolError from body() (the caller's fault), in either build."""
    f = Frame(3, 0, 0, "x", b"", 0, 0, hlen, blen, bytes(64), tail)
    with pytest.raises(LocalProtocolError, match="outside raw"):
        f.body()
