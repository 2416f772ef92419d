"""The objects the compiled code builds or reuses are ordinary Python objects: a Frame
from ``_speedups.scan`` hashes, compares, copies and is freed like one built by the
Python loop, whichever way the extension builds it for this CPython (the subclass's
tp_alloc filled by hand, or the tuple constructor: ``FILL_FRAMES`` in _speedups.c); an
awaitable of ``ready`` or a large body reused holds only what it was made for."""

from __future__ import annotations

import copy
import gc
import pickle
import sys

import pytest

from msgq_trio.protocol import framing
from msgq_trio.protocol.framing import Frame, FrameParser

try:
    from msgq_trio.protocol import _speedups
except ImportError:
    _speedups = None  # type: ignore[assignment]

pytestmark = pytest.mark.skipif(
    _speedups is None or not framing.SPEEDUPS, reason="the C extension is not in use"
)

STAMP = b"l.7\0sender"


def parse(data: bytes, scan: object) -> list[Frame]:
    saved = framing._scan_loop
    framing._scan_loop = scan  # type: ignore[assignment]
    try:
        p = FrameParser()
        p.feed(data)
        return p.frames()
    finally:
        framing._scan_loop = saved


def stream() -> bytes:
    return b"".join(
        framing.encode_small_bytes(3, t, body, s)
        for t, body, s in [
            (b"g", b"one", STAMP),
            (b"g", b"two", STAMP),
            (b"h.i", bytes(range(100)), b"l.8\0x"),
            (b"g", b"", STAMP),
        ]
    )


def test_compiled_frames_hash_and_compare_as_tuples() -> None:
    compiled, python = parse(stream(), _speedups.scan), parse(stream(), framing._scan_loop_py)
    assert compiled == python
    for c, p in zip(compiled, python, strict=True):
        assert type(c) is Frame
        assert c == p and c == tuple(p) and tuple(c) == tuple(p)
        # A hash cache left unset, or an item missing, gives another hash than the
        # plain tuple of the same values.
        assert hash(c) == hash(p) == hash(tuple(p))
        assert {c: 1}[p] == 1
        assert c._replace(flags=1) == p._replace(flags=1)
        assert copy.copy(c) == p and pickle.loads(pickle.dumps(c)) == p
        assert c.body() == p.body()
        assert not gc.is_tracked(c)  # no reference cycle can hold one (see make_frame)


def test_compiled_frames_hold_one_reference_per_item_and_are_freed() -> None:
    frames = parse(stream(), _speedups.scan)
    raw = frames[2].raw
    # The list, the frame and this name: no reference leaked or lost when it was built.
    assert sys.getrefcount(raw) == 3
    target = frames[2].target
    n = sys.getrefcount(target)
    del frames
    gc.collect()
    assert sys.getrefcount(raw) == 2
    assert sys.getrefcount(target) < n


def _result(r: object) -> object:
    try:
        next(r)  # type: ignore[call-overload]
    except StopIteration as stop:
        return stop.value
    raise AssertionError("ready() did not finish at once")


def test_ready_objects_reused_hold_only_their_own_value() -> None:
    """A freed awaitable may serve the next ready() (see ready_spare in _speedups.c):
    it then gives the new value, holds no reference to the old one, is tracked by the
    collector again, and two alive at once stay two."""
    a, b, c = object(), object(), object()
    before = sys.getrefcount(a)
    r = _speedups.ready(a)
    assert gc.is_tracked(r)
    del r
    assert sys.getrefcount(a) == before
    r = _speedups.ready(b)
    r2 = _speedups.ready(c)
    assert r is not r2
    assert _result(r) is b and _result(r2) is c and _result(r) is b
    assert gc.is_tracked(r) and gc.get_referents(r) == [b]
    del r, r2
    for value in (a, b, c, None):
        assert _result(_speedups.ready(value)) is value
    assert sys.getrefcount(a) == before


def _large_bodies(parser: FrameParser, bodies: list[bytes]) -> list[bytes]:
    """The bodies of large MESSAGE frames as a client's parser hands them out, each
    frame fed in two parts (as a stream of receives brings it)."""
    from msgq_trio.protocol.encode import encode_bytes_message

    out = []
    for body in bodies:
        data = b"".join(encode_bytes_message(3, b"big", body, STAMP))
        parser.feed(data[:4096])
        parser.feed(data[4096:])
        (frame,) = parser.frames()
        got = frame.body()
        assert got is frame.large_body and type(got) is bytes
        out.append(got)
    return out


def test_a_spare_body_is_reused_only_once_no_one_else_holds_it() -> None:
    """A client's parser receives a large body into one it handed out before only once
    that one is held by nothing else: a body the application keeps never changes; one it
    dropped comes back with the new content and the hash of that content."""
    if framing._reuse_body is framing._reuse_body_py:
        pytest.skip("the pure build hands out copies and keeps no spares")
    size = 1 << 20
    one, two, three = (bytes([i]) * size for i in (1, 2, 3))
    p = FrameParser(own_bodies=True)
    (kept,) = _large_bodies(p, [one])
    hash(kept)
    (second,) = _large_bodies(p, [two])
    assert kept == one and second == two and second is not kept
    address = id(second)
    hash(second)
    del second  # dropped: the parser's spares alone hold it now
    (third,) = _large_bodies(p, [three])
    assert id(third) == address  # the dropped one, written again
    assert third == three and kept == one
    assert hash(third) == hash(bytes(three)) != hash(two)
    # A view (or any export) of a body is a reference: that body is left alone.
    view = memoryview(third)
    del third
    (fourth,) = _large_bodies(p, [two])
    assert fourth == two and bytes(view) == three
    # Another size, or more spares than SPARE_BODIES: new bodies, the oldest let go.
    assert _large_bodies(p, [bytes(size + 1)]) == [bytes(size + 1)]
    assert len(p._spares) <= framing.SPARE_BODIES
    p.release()
    assert p._spares == []
