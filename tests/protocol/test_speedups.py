"""The optional compiled fast paths (msgq_trio/protocol/_speedups.c) against their
reference, the Python code of framing.py: the same input must give the same frames,
runs, ``seen`` bits, positions, values and errors.

Both implementations run side by side in one process: the compiled scan is swapped in
and out of ``framing._scan_loop`` (the one place ``FrameParser`` looks it up), the
compiled ``Frame.body`` is called as the method descriptor the module would install.
Skipped where the extension was not built (no compiler), except in CI, which builds it.
"""

from __future__ import annotations

import collections.abc
import gc
import os
import struct
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msgq_trio.protocol import framing
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.errors import RemoteProtocolError
from msgq_trio.protocol.framing import PREFIX, Frame, FrameParser, Run

try:
    from msgq_trio.protocol import _speedups
except ImportError:
    _speedups = None  # type: ignore[assignment]

if _speedups is None:
    if os.environ.get("CI"):
        # CI has gcc and the Python headers: a missing build there is a packaging bug,
        # not a machine without a compiler.
        raise AssertionError("msgq_trio.protocol._speedups was not built in CI")
    pytest.skip("the C extension is not built here", allow_module_level=True)

# The module's own wiring, also under MSGQ_TRIO_PURE_PYTHON=1 (which skips it): init
# only records the Python fallbacks, it installs nothing.
_speedups.init(
    Frame,
    Run,
    framing._VALID_MASK,
    int(FrameType.MESSAGE),
    framing._body_py,
    framing._encode_small_bytes_py,
)
C_BODY = _speedups.frame_body_method(Frame)

SETTINGS = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
STAMP = b"l.7\0sender"
VALID = [int(t) for t in FrameType]


@contextmanager
def scan_with(impl: Callable[..., tuple[int, int, bool]]) -> Iterator[None]:
    """FrameParser's fast loop is ``impl`` inside the block."""
    saved = framing._scan_loop
    framing._scan_loop = impl
    try:
        yield
    finally:
        framing._scan_loop = saved


def outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    """("ok", value) or ("error", type, message, wire code): comparable across paths."""
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("error", type(exc), str(exc), getattr(exc, "code", None))


def described(items: list[Frame | Run] | Frame | None) -> Any:
    """Frames and runs as plain values, their Python types included (a Frame must be a
    Frame, its target a str, its source and raw bytes)."""
    if items is None:
        return None
    if isinstance(items, list):
        return [described(x) for x in items]  # type: ignore[arg-type]
    if isinstance(items, Run):
        return ("Run", type(items.target), items.target, type(items.raw), items.raw, items.count)
    assert type(items) is Frame
    return ("Frame", *((type(v), v) for v in items))


# -- strategies ----------------------------------------------------------------------------
body_sections = st.one_of(
    st.just(b""),
    st.binary(max_size=40).map(cbor2.dumps),  # byte strings: every head form below 256
    st.binary(min_size=256, max_size=300).map(cbor2.dumps),  # the 0x59 head
    st.binary(max_size=40),  # garbage, truncated heads, trailing bytes
    st.builds(
        lambda h, n, tail: bytes([h]) + n + tail,
        st.integers(0x40, 0x5B),
        st.binary(max_size=4),
        st.binary(max_size=8),
    ),
    st.sampled_from([b"\x5a\x00\x00\x00\x01x", b"\x5a\x00\x00\x00\x02x", b"\x59\x00", b"\x58"]),
    st.integers().map(cbor2.dumps),
)


@st.composite
def raw_frames(draw: st.DrawFn) -> bytes:
    """One frame, usually valid and plain; sometimes one field is wrong (type, reserved,
    lengths, blobs, UTF-8 of the target), sometimes it is not a frame at all."""
    # Uniform (integers() favours the ends); kinds 0-6 stop the fast loop, so they are
    # rare enough that most streams hold several plain frames first.
    kind = draw(st.sampled_from(range(40)))
    if kind == 0:
        return draw(st.binary(max_size=48))
    # MESSAGE frames with the stamp half of the time, so runs form and break often.
    ftype = (
        draw(st.sampled_from([*VALID, *[int(FrameType.MESSAGE)] * len(VALID)]))
        if kind != 1
        else draw(st.sampled_from([0, 10, 31, 63, 64, 255]))
    )
    if kind == 2:
        target = draw(st.sampled_from([b"\xff", b"a\xc3", b"\xed\xa0\x80", b"ok\x80"]))
    else:
        # Targets of equal length that differ: a run must compare the bytes.
        target = draw(st.sampled_from([b"", b"grp", b"gro", b"other", "gr\u00fcn".encode()]))
    source = draw(st.sampled_from([STAMP, STAMP, STAMP, b"", b"l.8\0x", STAMP[:-1] + b"!"]))
    header = draw(st.sampled_from([b"", cbor2.dumps({"cmd": "x"})]))
    body = draw(body_sections)
    blobs = draw(st.lists(st.binary(max_size=8), max_size=2)) if kind == 3 else []
    nfds = draw(st.integers(0, 2)) if kind == 4 else 0
    reserved = draw(st.integers(1, 0xFFFF)) if kind == 5 else 0
    length = 28 + len(target) + len(source) + len(header) + len(body) + 4 * len(blobs)
    length += sum(len(b) for b in blobs)
    if kind == 6:
        length += draw(st.sampled_from([-1, 1, -28, 2**32 - 1 - length]))
        length %= 2**32
    prefix = PREFIX.pack(
        length,
        ftype,
        draw(st.integers(0, 255)),
        len(target),
        len(source),
        len(blobs),
        nfds,
        reserved,
        draw(st.sampled_from([0, 1, 2**63, 2**64 - 1])),
        len(header),
        len(body),
    )
    table = struct.pack(f">{len(blobs)}I", *map(len, blobs)) if blobs else b""
    return prefix + target + source + header + body + table + b"".join(blobs)


@st.composite
def message_streams(draw: st.DrawFn) -> bytes:
    """Plain MESSAGE frames only (every one taken by the fast loop): targets of equal
    length that differ, the stamp or another source, descriptors now and then."""
    out = []
    for _ in range(draw(st.integers(1, 30))):
        target = draw(st.sampled_from([b"grp", b"gro", b"grp", b"other"]))
        source = draw(st.sampled_from([STAMP, STAMP, STAMP, b"l.8\0x"]))
        nfds = draw(st.sampled_from([0, 0, 0, 0, 1]))
        body = cbor2.dumps(draw(st.binary(max_size=30)))
        length = 28 + len(target) + len(source) + len(body)
        out.append(
            PREFIX.pack(length, 3, 0, len(target), len(source), 0, nfds, 0, 0, 0, len(body))
            + target
            + source
            + body
        )
    return b"".join(out)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, prev = [], 0
    for p in [*points, len(data)]:
        pieces.append(data[prev:p])
        prev = p
    return pieces


# -- the scan -----------------------------------------------------------------------------
@SETTINGS
@given(
    frames=st.lists(raw_frames(), max_size=12) | message_streams().map(lambda b: [b]),
    cuts=st.lists(st.integers(0, 2**31), max_size=8),
    calls=st.lists(st.sampled_from(["frames", "runs", "next"]), min_size=1, max_size=12),
    max_frame_size=st.sampled_from([framing.DEFAULT_MAX_FRAME_SIZE, 80, 120]),
)
def test_parsers_agree_on_random_streams(
    frames: list[bytes], cuts: list[int], calls: list[str], max_frame_size: int
) -> None:
    """Fed the same pieces and asked the same way, the pure and the compiled parser
    return the same frames and runs (or raise the same error), with the same ``seen``
    bits, position, buffered count and poisoning; the bodies decode the same."""
    data = b"".join(frames)
    parsers = {"py": FrameParser(max_frame_size), "c": FrameParser(max_frame_size)}
    impls = {"py": framing._scan_loop_py, "c": _speedups.scan}
    for i, piece in enumerate(split(data, cuts)):
        call = calls[i % len(calls)]
        seen: dict[str, Any] = {}
        for name, p in parsers.items():
            p.feed(piece)
            with scan_with(impls[name]):
                if call == "frames":
                    got = outcome(p.frames)
                elif call == "runs":
                    got = outcome(lambda p=p: p.frames_and_runs(STAMP))  # type: ignore[misc]
                else:
                    got = outcome(p.next_frame)
            error = str(p.error) if p.error else None
            state = (p.seen, p.returned_bytes, p._pos, p.buffered, error)
            if got[0] == "ok":
                seen[name] = (("ok", described(got[1])), state)
            else:
                seen[name] = (got, state)
        assert seen["py"] == seen["c"], f"piece {i} ({call})"


@SETTINGS
@given(
    frames=st.lists(raw_frames(), max_size=12) | message_streams().map(lambda b: [b]),
    start=st.integers(0, 64),
    source=st.sampled_from([None, STAMP, b""]),
    limit=st.sampled_from([framing.DEFAULT_MAX_FRAME_SIZE - 4, 60, 100, -1, 0]),
    seen0=st.sampled_from([0, 1 << 3, framing.SEEN_FDS]),
)
def test_scan_functions_agree(
    frames: list[bytes], start: int, source: bytes | None, limit: int, seen0: int
) -> None:
    """The fast loop itself: same appended items, position, ``seen`` and bad-target flag
    from any start position (also one inside a frame, or past the end)."""
    buf = bytearray(b"".join(frames))
    if limit <= 0 and len(buf) - start >= 4:
        # At the first frame's own length (-1: one byte short): the boundary of the limit.
        limit += int.from_bytes(buf[start : start + 4], "big")
    out_py: list[Frame | Run] = []
    out_c: list[Frame | Run] = []
    r_py = framing._scan_loop_py(buf, start, limit, source, out_py, seen0)
    r_c = _speedups.scan(buf, start, limit, source, out_c, seen0)
    assert r_c == r_py
    assert described(out_c) == described(out_py)


@pytest.mark.parametrize("length", [2**31 - 1, 2**31, 2**32 - 5, 2**32 - 1])
def test_scan_stops_before_a_length_past_the_buffer(length: int) -> None:
    """A length whose frame would end far past the buffer (4 + length overflows a 32-bit
    Py_ssize_t) stops the fast loop at that frame, with any limit, as the Python loop."""
    good = framing.encode_small_bytes(3, b"g", b"x", STAMP)
    body = 100
    head = PREFIX.pack(length, 3, 0, 1, 0, 0, 0, 0, 0, 0, length - 29) + b"g" + bytes(body)
    for limit in (2**32 - 1, 2**62):
        results = []
        for impl in (framing._scan_loop_py, _speedups.scan):
            out: list[Frame | Run] = []
            results.append((impl(bytearray(good + head), 0, limit, None, out, 0), len(out)))
        assert results[0] == results[1] == ((len(good), 1 << 3, False), 1)


def test_runs_are_grouped_the_same() -> None:
    """A deterministic stream with runs broken by every condition: another target, another
    source, descriptors, another frame type, and a bad target inside a would-be run."""

    def msg(target: bytes, source: bytes = STAMP, ftype: int = 3, nfds: int = 0) -> bytes:
        body = cbor2.dumps(b"x" * 5)
        length = 28 + len(target) + len(source) + len(body)
        prefix = PREFIX.pack(
            length, ftype, 0, len(target), len(source), 0, nfds, 0, 0, 0, len(body)
        )
        return prefix + target + source + body

    stream = b"".join(
        [
            msg(b"a"),
            msg(b"a"),
            msg(b"b"),
            msg(b"b"),
            msg(b"b", b"l.8\0x"),
            msg(b"b"),
            msg(b"b", nfds=1),
            msg(b"b"),
            msg(b"b", ftype=4),
            msg(b"a"),
            msg(b"a"),
            msg(b"\xff"),
        ]
    )
    results = []
    for impl in (framing._scan_loop_py, _speedups.scan):
        out: list[Frame | Run] = []
        r = impl(bytearray(stream), 0, framing.DEFAULT_MAX_FRAME_SIZE - 4, STAMP, out, 0)
        results.append((r, described(out)))
    assert results[0] == results[1]
    (pos, _seen, bad), items = results[0]
    assert bad and pos == len(stream) - len(msg(b"\xff"))  # stops at the bad run start
    assert [x[0] for x in items] == ["Run", "Run", "Frame", "Run", "Frame", "Run", "Frame", "Run"]


def test_large_frame_then_small_ones() -> None:
    """A frame of the large-frame path followed by small frames in the same receive: both
    parsers give the large one first, then the rest, with the same ``seen``."""
    big = b"".join(
        bytes(p) for p in framing.encode_frame(3, target="g", body=cbor2.dumps(b"x" * 300_000))
    )
    small = framing.encode_small_bytes(3, b"g", b"y" * 10, STAMP)
    got = []
    for impl in (framing._scan_loop_py, _speedups.scan):
        p = FrameParser()
        with scan_with(impl):
            p.feed(big[:1000])
            assert p.frames() == []
            p.feed(big[1000:] + small * 3)
            got.append((described(p.frames()), p.seen, p.buffered))
    assert got[0] == got[1]
    assert len(got[0][0]) == 4


def test_frames_of_one_scan_share_equal_targets_and_sources() -> None:
    """Equal targets and sources of consecutive frames are one object each (a burst
    allocates them once), and a different one is a new object with its own value."""
    msgs = [
        framing.encode_small_bytes(3, t, b"x", s)
        for t, s in [(b"g", STAMP), (b"g", STAMP), (b"h", STAMP), (b"h", b"l.8\0x"), (b"g", STAMP)]
    ]
    p = FrameParser()
    with scan_with(_speedups.scan):
        p.feed(b"".join(msgs))
        f = p.frames()
    assert [(x.target, x.source) for x in f] == [
        ("g", STAMP),
        ("g", STAMP),
        ("h", STAMP),
        ("h", b"l.8\0x"),
        ("g", STAMP),
    ]
    assert f[0].target is f[1].target and f[0].source is f[1].source
    assert f[2].source is f[1].source and f[3].target is f[2].target


# -- slot_maker --------------------------------------------------------------------------------
class Slotted:
    __slots__ = ("a", "b", "c", "d")

    def __init__(self, a: object, b: object) -> None:
        self.a, self.b, self.c, self.d = a, b, None, False


def test_slot_maker_sets_the_slots_as_init_does() -> None:
    make = _speedups.slot_maker(Slotted, ("a", "b"), {"c": None, "d": False})
    a, b = object(), [1]
    before = sys.getrefcount(a)
    made, ref = make(a, b), Slotted(a, b)
    assert type(made) is Slotted
    assert [getattr(made, n) for n in Slotted.__slots__] == [
        getattr(ref, n) for n in Slotted.__slots__
    ]
    assert made.a is a and made.b is b
    del made, ref
    assert sys.getrefcount(a) == before  # each slot's reference is released with it
    with pytest.raises(TypeError, match="takes 2 positional arguments"):
        make(a)
    with pytest.raises(TypeError, match="takes 2 positional arguments"):
        make(a, b=b)


class WithDict:
    def __init__(self) -> None:
        self.a = 1


class Sub(Slotted):
    __slots__ = ("e",)


class Wide:
    __slots__ = tuple(f"s{i}" for i in range(20))


class Borrower:
    __slots__ = ("a",)


Borrower.far = Wide.__dict__["s19"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("args", "fixed"), [(("a", "a"), {}), (("a", "b"), {"b": None}), (("a",), {"a": 1})]
)
def test_slot_maker_refuses_a_slot_named_twice(
    args: tuple[str, ...], fixed: dict[str, object]
) -> None:
    """Set twice, a slot's first reference would be lost."""
    with pytest.raises(ValueError, match="named twice"):
        _speedups.slot_maker(Slotted, args, fixed)


@pytest.mark.parametrize(
    ("cls", "args", "fixed", "error"),
    [
        (WithDict, ("a",), {}, "not a plain class with __slots__"),
        (Sub, ("e",), {}, "not a plain class with __slots__"),
        (int, (), {}, "not a plain class with __slots__"),
        (Slotted, ("x",), {}, "'x' is not a slot of"),
        (Slotted, ("a",), {"__init__": 1}, "'__init__' is not an object slot of"),
        # A member descriptor of another class, assigned after the class was made: its
        # offset is into that class's instances (past the end of this one's).
        (Borrower, ("a", "far"), {}, "'far' is not an object slot of"),
    ],
)
def test_slot_maker_refuses_what_it_cannot_make(
    cls: type, args: tuple[str, ...], fixed: dict[str, object], error: str
) -> None:
    with pytest.raises(TypeError, match=error):
        _speedups.slot_maker(cls, args, fixed)


# -- Frame.body ------------------------------------------------------------------------------
@SETTINGS
@given(
    body=body_sections,
    header=st.sampled_from([b"", cbor2.dumps({"k": 1})]),
    as_bytearray=st.booleans(),
)
def test_body_agrees(body: bytes, header: bytes, as_bytearray: bool) -> None:
    """Every body section decodes to the same value or the same error either way."""
    raw = b"".join(bytes(p) for p in framing.encode_frame(3, target="g", header=header, body=body))
    p = FrameParser()
    p.feed(raw)
    f = p.next_frame()
    assert f is not None
    if as_bytearray:
        f = f._replace(raw=bytearray(f.raw))
    py, c = outcome(lambda: framing._body_py(f)), outcome(lambda: C_BODY(f))
    assert py == c
    if py[0] == "ok":
        assert type(py[1]) is type(c[1])


@pytest.mark.parametrize(("hlen", "blen"), [(0, 10), (0, 2**70), (2**70, 3), (0, -1)])
def test_body_of_a_hand_made_frame_outside_raw(hlen: int, blen: int) -> None:
    """A Frame whose lengths point past ``raw`` or do not fit 64 bits (never parsed, made
    by hand) gets the Python method's answer, not a read past the buffer."""
    f = Frame(3, 0, 0, "g", b"", 0, 0, hlen, blen, b"\x00" * 32 + b"\x45abc", 32)
    assert outcome(lambda: C_BODY(f)) == outcome(lambda: framing._body_py(f))


# -- Message.body's getter --------------------------------------------------------------------
def _message(body: bytes) -> Any:
    from msgq_trio.client.message import Message

    raw = b"".join(bytes(p) for p in framing.encode_frame(3, target="g", body=body, source=STAMP))
    p = FrameParser()
    p.feed(raw)
    f = p.next_frame()
    assert f is not None
    return Message(f, {})


def _getters() -> tuple[Callable[[Any], object], Callable[[Any], object]]:
    """(the Python getter of Message.body, a compiled one over it)."""
    from msgq_trio.client.message import Message, _body_py

    return _body_py, _speedups.body_getter(Message, "_frame", "_decoded", "_body", _body_py)


@SETTINGS
@given(body=body_sections)
def test_body_getter_agrees(body: bytes) -> None:
    """The compiled getter gives what the Python one gives (value or error, with the same
    message), caches it as that one does, and a second read is the cached object."""
    py_get, c_get = _getters()
    m_py, m_c = _message(body), _message(body)
    py, c = outcome(lambda: py_get(m_py)), outcome(lambda: c_get(m_c))
    assert py == c
    assert (m_py._decoded, m_c._decoded) == (py[0] == "ok",) * 2
    if py[0] == "ok":
        assert type(py[1]) is type(c[1])
        assert c_get(m_c) is m_c._body is c[1]
        assert py_get(m_c) is c[1]  # each reads the other's cache


def test_body_getter_hands_anything_else_to_the_python_getter() -> None:
    """An instance of another class, a message whose slot holds no parsed frame, or
    keyword arguments go to the Python getter, which raises its own errors."""
    from msgq_trio.client.message import Message

    calls: list[object] = []

    def fallback(obj: object) -> object:
        calls.append(obj)
        return "fallback"

    get = _speedups.body_getter(Message, "_frame", "_decoded", "_body", fallback)
    other = object()
    assert get(other) == "fallback"
    odd = _message(cbor2.dumps(b"x"))
    odd._frame = ("not", "a", "frame")
    assert get(odd) == "fallback"
    assert odd._decoded is False
    assert calls == [other, odd]
    with pytest.raises(TypeError, match="not a plain class"):
        _speedups.body_getter(int, "_frame", "_decoded", "_body", fallback)
    with pytest.raises(TypeError, match="is not a slot of"):
        _speedups.body_getter(Message, "_frame", "_nope", "_body", fallback)


def test_body_getter_before_init_is_the_python_getter() -> None:
    """Made before init() (a process with the pure build selected, where framing never
    calls it), the getter calls its fallback cleanly, with no error pending."""
    code = (
        "from msgq_trio.protocol import _speedups\n"
        "class M:\n"
        "    __slots__ = ('_frame', '_decoded', '_body')\n"
        "m = M(); m._frame, m._decoded, m._body = None, False, None\n"
        "get = _speedups.body_getter(M, '_frame', '_decoded', '_body', lambda o: 'py')\n"
        "print(get(m))\n"
    )
    env = {**os.environ, "MSGQ_TRIO_PURE_PYTHON": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert (done.returncode, done.stdout) == (0, "py\n"), done.stderr


# -- ready ----------------------------------------------------------------------------------
class _Done:
    """An async iterator whose ``__anext__`` is a plain function returning ready(...)."""

    def __init__(self, items: list[object]) -> None:
        self.items = items

    def __aiter__(self) -> _Done:
        return self

    def __anext__(self) -> Any:
        if self.items:
            return _speedups.ready(self.items.pop(0))
        return self._end()

    async def _end(self) -> object:
        raise StopAsyncIteration


VALUES: list[object] = [1, None, (1, 2), (), ValueError("a value, not raised"), [3]]


async def _collect() -> list[object]:
    got = [await _speedups.ready(v) for v in VALUES]
    got += [v async for v in _Done(list(VALUES))]
    return got


def test_ready_is_an_awaitable_already_done() -> None:
    """``await ready(v)`` is ``v`` under trio and asyncio, in ``async for`` too, for any
    value (tuples and exceptions are values, not arguments or errors); driven by hand it
    finishes with StopIteration(v) at once, and it releases the value."""
    import asyncio

    import trio

    assert trio.run(_collect) == VALUES * 2
    assert asyncio.run(_collect()) == VALUES * 2
    for v in VALUES:
        r = _speedups.ready(v)
        assert r.__await__() is r  # type: ignore[attr-defined]
        # What trio's start_soon and asyncio's create_task accept as a coroutine.
        assert isinstance(r, collections.abc.Coroutine)
        with pytest.raises(StopIteration) as info:
            next(r)  # type: ignore[call-overload]
        assert info.value.value is v
        with pytest.raises(StopIteration) as info:
            r.send(None)  # type: ignore[attr-defined]
        assert info.value.value is v
        with pytest.raises(KeyError, match="thrown"):
            r.throw(KeyError("thrown"))  # type: ignore[attr-defined]
        assert r.close() is None  # type: ignore[attr-defined]
    marker = object()
    before = sys.getrefcount(marker)
    r = _speedups.ready(marker)
    assert sys.getrefcount(marker) == before + 1
    del r
    assert sys.getrefcount(marker) == before


def test_ready_in_a_reference_cycle_is_collected() -> None:
    """An awaitable whose value refers back to it is freed by the cyclic collector (which
    sees its value: ``gc.get_referents``)."""

    class Holder:
        r: object = None

    holder = Holder()
    r = _speedups.ready(holder)
    holder.r = r
    assert gc.get_referents(r) == [holder]
    ref = weakref.ref(holder)
    del holder, r
    gc.collect()
    assert ref() is None


# -- new_bytes -------------------------------------------------------------------------------
def test_new_bytes_view_keeps_its_bytes_alive() -> None:
    """The writable view of new_bytes() owns what it writes into: dropping every other
    reference to the bytes leaves it alive while the view is, and writes land in it."""
    b, view = _speedups.new_bytes(10)
    assert type(b) is bytes and len(b) == 10 and len(view) == 10 and not view.readonly
    ref = sys.getrefcount(b)
    view[:] = b"0123456789"
    assert b == b"0123456789"
    keep = view[2:5]
    del view
    b_id = id(b)
    del b
    keep[:] = b"abc"  # (ASan in CI: a write into freed memory would be reported here)
    assert bytes(keep) == b"abc"
    assert ref >= 2 and b_id
    for bad in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            _speedups.new_bytes(bad)
    with pytest.raises(MemoryError):
        _speedups.new_bytes(sys.maxsize - 64)


# -- init --------------------------------------------------------------------------------------
class ShortFrame(NamedTuple):
    type: int
    raw: bytes


class RenamedFrame(NamedTuple):  # the right count, one name moved
    flags: int
    type: int
    request_id: int
    target: str
    source: bytes
    n_blobs: int
    n_fds: int
    header_len: int
    body_len: int
    raw: bytes
    tail: int
    fds: tuple[int, ...]
    large_body: bytes
    spliced: object


@pytest.mark.parametrize("frame", [ShortFrame, RenamedFrame, tuple])
def test_init_refuses_another_frame_layout(frame: type) -> None:
    """The compiled code reads and writes Frame's fields by index: init() checks that
    the class it is given has exactly those fields, so a changed Frame fails loudly at
    import instead of reading past a tuple."""
    args = (framing._VALID_MASK, 3, framing._body_py, framing._encode_small_bytes_py)
    try:
        with pytest.raises((TypeError, AttributeError)):
            _speedups.init(frame, Run, *args)
    finally:
        _speedups.init(Frame, Run, *args)


# -- encode_small_bytes ----------------------------------------------------------------------
payload_sizes = st.sampled_from([0, 1, 23, 24, 255, 256, 1000, 65535, 65536])


@SETTINGS
@given(
    ftype=st.sampled_from([0, 3, 255, 256, -1]),
    target=st.sampled_from([b"", b"grp", b"g" * 65535, b"g" * 65536]),
    size=payload_sizes,
    source=st.sampled_from([b"", STAMP, b"s" * 65536]),
    kind=st.sampled_from([bytes, bytearray, memoryview]),
)
def test_encode_small_bytes_agrees(
    ftype: int, target: bytes, size: int, source: bytes, kind: type
) -> None:
    """The same bytes, or the same error, for every head form, length limit and
    argument type."""
    payload = kind(bytes(range(256)) * (size // 256) + bytes(size % 256))
    py = outcome(lambda: framing._encode_small_bytes_py(ftype, target, payload, source))
    c = outcome(lambda: _speedups.encode_small_bytes(ftype, target, payload, source))
    assert py == c
    if py[0] == "ok":
        assert type(c[1]) is bytes


def test_encode_small_bytes_keywords_and_int_subclasses() -> None:
    args = {"type": FrameType.MESSAGE, "target": b"g", "payload": b"p", "source": STAMP}
    assert _speedups.encode_small_bytes(**args) == framing._encode_small_bytes_py(**args)  # type: ignore[arg-type]
    assert _speedups.encode_small_bytes(FrameType.MESSAGE, b"g", b"p", STAMP) == (
        framing._encode_small_bytes_py(3, b"g", b"p", STAMP)
    )


# -- selection --------------------------------------------------------------------------------
@pytest.mark.parametrize("pure", ["1", "0", ""])
def test_environment_selects_the_path(pure: str) -> None:
    """MSGQ_TRIO_PURE_PYTHON=1 runs the reference code; unset or "0" the compiled one."""
    code = (
        "from msgq_trio.protocol import framing as f; from msgq_trio import Message as M;"
        "print(f.SPEEDUPS, type(f.Frame.body).__name__, f._scan_loop.__name__,"
        " f.encode_small_bytes.__name__, type(f.ready).__name__, type(M.body.fget).__name__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "MSGQ_TRIO_PURE_PYTHON"}
    if pure:
        env["MSGQ_TRIO_PURE_PYTHON"] = pure
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    if pure == "1":
        assert out == [
            "False",
            "function",
            "_scan_loop_py",
            "_encode_small_bytes_py",
            "function",
            "function",
        ]
    else:
        assert out == [
            "True",
            "method_descriptor",
            "scan",
            "encode_small_bytes",
            "builtin_function_or_method",
            "BodyGetter",
        ]


@pytest.mark.parametrize("pure", ["1", "0"], ids=["pure", "compiled"])
def test_a_hand_made_frame_body_outside_raw_raises(pure: str) -> None:
    """A Frame made by hand with lengths far past ``raw`` (the type is public): body()
    raises LocalProtocolError in either build, in a process of its own so that a read
    out of bounds shows as a crash, not as the test run's."""
    code = (
        "from msgq_trio.protocol import framing as f\n"
        "from msgq_trio.protocol.errors import LocalProtocolError\n"
        "fr = f.Frame(type=3, flags=0, request_id=0, target='x', source=b'', n_blobs=0,"
        " n_fds=0, header_len=2**62, body_len=5, raw=bytes(64), tail=2**62)\n"
        "try:\n"
        "    fr.body()\n"
        "except LocalProtocolError as exc:\n"
        "    print(f.SPEEDUPS, 'LocalProtocolError', exc)\n"
    )
    env = {**os.environ, "MSGQ_TRIO_PURE_PYTHON": pure}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{pure == '0'} LocalProtocolError "), done.stdout
    assert "outside raw (64 bytes)" in done.stdout


def test_parse_errors_are_the_pythons() -> None:
    """The compiled scan raises nothing of its own: a bad frame after good ones gives the
    good ones, then the reference error on the next call."""
    good = framing.encode_small_bytes(3, b"g", b"x", STAMP)
    bad = bytearray(good)
    bad[14] = 1  # reserved
    p = FrameParser()
    with scan_with(_speedups.scan):
        p.feed(good + bytes(bad))
        assert len(p.frames()) == 1
        with pytest.raises(RemoteProtocolError, match="reserved prefix field is not zero"):
            p.frames()
