"""The parser's side of the broker's splice path (``FrameParser.splice_rest``,
``complete_spliced``, ``unsplice``): which frames may have their rest outside the parser,
and that a spliced frame, once complete, routes and re-stamps as the whole frame would.
The rest here is a plain object holding bytes: the parser only sizes it."""

from __future__ import annotations

import random

import pytest

from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.errors import LocalProtocolError
from msgq_trio.protocol.framing import Frame, FrameParser, encode_cbor, encode_frame, stamped

MiB = 1 << 20
SOURCE = b"l.7\x00pub"


class HeldRest:
    """Bytes standing in for the pipes of transport/splice.PipeTail."""

    def __init__(self, data: bytes) -> None:
        self.data: bytes | None = data
        self.taken = False
        self.closed = False

    def __len__(self) -> int:
        assert self.data is not None
        return len(self.data)

    def piece(self) -> object:
        return self

    def materialize(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def frame_bytes(ftype: int = FrameType.MESSAGE, size: int = 4 * MiB, **kw: object) -> bytes:
    body = random.Random(size).randbytes(size)
    kw.setdefault("target", "Big")
    kw.setdefault("source", SOURCE)
    return b"".join(bytes(p) for p in encode_frame(ftype, body=encode_cbor(body), **kw))  # type: ignore[arg-type]


def start(parser: FrameParser, data: bytes, first: int) -> None:
    """Feed the first ``first`` bytes, as the broker's first receive of a frame."""
    parser.feed(data[:first])
    assert parser.next_frame() is None
    assert parser.in_large_frame


def receive_rest(parser: FrameParser, data: bytes, at: int) -> None:
    """Receive ``data[at:]`` in place, as the broker's reader does (the buffer grows)."""
    while at < len(data):
        view = parser.receive_buffer()
        assert view is not None
        n = min(len(view), len(data) - at)
        view[:n] = data[at : at + n]
        del view
        parser.advance(n)
        at += n


def test_a_large_message_s_rest_is_announced_and_the_frame_completes_with_it() -> None:
    data = frame_bytes()
    p = FrameParser(64 * MiB)
    start(p, data, 256 * 1024)
    rest = p.splice_rest(MiB)
    assert rest == len(data) - 256 * 1024
    assert p.receive_buffer() is None  # nothing is lent while the rest is outside
    held = HeldRest(data[256 * 1024 :])
    p.complete_spliced(held)
    f = p.next_frame()
    assert isinstance(f, Frame)
    assert f.spliced is held
    assert bytes(f.raw) == data[: 256 * 1024]
    assert f.wire_size == len(data)
    assert (f.type, f.target, f.source) == (FrameType.MESSAGE, "Big", SOURCE)
    assert not p.in_frame and not p.in_large_frame
    # Forwarded: the head (re-stamped or not) and then the rest, adding up to the frame.
    for source in (SOURCE, b"l.9\x00other"):
        pieces = stamped(f, source)
        assert pieces[-1] is held
        head = b"".join(bytes(x) for x in pieces[:-1])
        whole = head + data[256 * 1024 :]
        assert int.from_bytes(whole[:4], "big") + 4 == len(whole)
        q = FrameParser(64 * MiB)
        q.feed(whole)
        g = q.next_frame()
        assert g is not None and g.source == source and g.body() == f_body(data)


def f_body(data: bytes) -> object:
    p = FrameParser(64 * MiB)
    p.feed(data)
    f = p.next_frame()
    assert f is not None
    return f.body()


@pytest.mark.parametrize(
    "case",
    ["request", "blobs", "fds", "small-rest", "head-not-in", "bad-target"],
)
def test_frames_the_broker_must_read_whole_are_not_announced(case: str) -> None:
    """Only a one-way MESSAGE/NOTIFY with no blobs or descriptors, whose head is in and
    valid, and whose rest is big enough, may go outside: anything else is received whole
    (0), and the ordinary path judges it."""
    kw: dict[str, object] = {}
    ftype: int = FrameType.MESSAGE
    first, min_rest = 256 * 1024, MiB
    if case == "request":
        ftype, kw = FrameType.REQUEST, {"request_id": 1, "header": encode_cbor({"cmd": "x"})}
    elif case == "blobs":
        kw = {"blobs": [b"x" * 10]}
    elif case == "fds":
        kw = {"n_fds": 1}
    elif case == "small-rest":
        min_rest = 4 * MiB
    elif case == "head-not-in":
        kw, first = {"header": encode_cbor({"k": "v" * 300_000})}, 200_000
    data = frame_bytes(ftype, **kw)
    if case == "bad-target":
        data = data[:32] + b"\xff\xfe\xfd" + data[35:]
    p = FrameParser(64 * MiB)
    start(p, data, first)
    assert p.splice_rest(min_rest) == 0
    if case != "fds":  # (a frame declaring descriptors needs them: not this test's matter)
        receive_rest(p, data, first)  # still received as usual
        if case == "bad-target":
            with pytest.raises(Exception, match="UTF-8"):
                p.next_frame()
        else:
            f = p.next_frame()
            assert f is not None and f.spliced is None and bytes(f.raw) == data


def test_a_rest_not_spliced_after_all_comes_the_ordinary_way() -> None:
    """unsplice(): the part that was spliced goes back into the frame, the rest is received
    as usual, and the frame is the very one an unspliced receive gives."""
    data = frame_bytes()
    p = FrameParser(64 * MiB)
    start(p, data, 100_000)
    assert p.splice_rest(MiB)
    p.unsplice(data[100_000:1_500_000])
    assert p.splice_rest(MiB) == 0  # not tried again for this frame
    receive_rest(p, data, 1_500_000)
    f = p.next_frame()
    assert f is not None and f.spliced is None and bytes(f.raw) == data


def test_misuse_of_the_splice_calls_is_a_local_error() -> None:
    data = frame_bytes()
    p = FrameParser(64 * MiB)
    with pytest.raises(LocalProtocolError):
        p.complete_spliced(HeldRest(b"x"))  # nothing announced
    start(p, data, 256 * 1024)
    rest = p.splice_rest(MiB)
    with pytest.raises(LocalProtocolError):
        p.feed(b"more")  # bytes of the rest cannot also come the ordinary way
    with pytest.raises(LocalProtocolError):
        p.complete_spliced(HeldRest(b"x" * (rest - 1)))  # short
    with pytest.raises(LocalProtocolError):
        p.unsplice(b"x" * (rest + 1))  # longer than announced
    assert p.splice_rest(MiB) == 0  # announced once only
