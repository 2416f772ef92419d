"""Differential fuzz of the frame codec: the compiled fast paths against the pure-Python
reference over random and mutated frame streams, fed in random chunkings.

Two parsers, one per build, get the same bytes in the same pieces (through ``feed`` or
through ``receive_buffer``/``advance``) and the same calls (``frames``,
``frames_and_runs``, ``next_frame``); they must return the same frames and runs, raise
the same errors, and agree on ``seen``, ``returned_bytes``, ``buffered`` and poisoning.
Every frame's ``body()``, ``header()`` and ``blobs()`` must agree too, and so must
``body()`` of frames made by hand with absurd fields. Deterministic for a seed.

CI runs a bounded count under ASan and UBSan (tests/protocol/sanitize.sh, through
test_differential.py); a longer run by hand::

    .venv/bin/python tests/protocol/differential.py --seed 7 --count 100000

Exit status 1 on the first disagreement, with the seed and case number to replay it.
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import cbor2

from msgq_trio.protocol import framing
from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import Frame, FrameParser, Run

STAMP = b"l.7\0sender"
TYPES = [int(t) for t in FrameType]
LARGE = framing._LARGE_FRAME


class Disagreement(AssertionError):
    """The two builds did not do the same thing."""


def _hooks_pure() -> tuple[Any, ...]:
    return (
        framing._scan_loop_py,
        framing._body_py,
        framing._encode_small_bytes_py,
        framing._new_body_py,
    )


def _hooks_now() -> tuple[Any, ...]:
    return (
        framing._scan_loop,
        framing.Frame.__dict__["body"],
        framing.encode_small_bytes,
        framing._new_body,
    )


def _set_hooks(hooks: tuple[Any, ...]) -> None:
    framing._scan_loop, body, framing.encode_small_bytes, framing._new_body = hooks
    framing.Frame.body = body  # type: ignore[method-assign]


class Builds:
    """Switches framing's fast-path hooks between the two builds."""

    def __init__(self) -> None:
        if not framing.SPEEDUPS:
            raise RuntimeError(
                "the compiled fast paths are not in use (not built, or MSGQ_TRIO_PURE_PYTHON)"
            )
        self.hooks = {"c": _hooks_now(), "py": _hooks_pure()}

    @contextmanager
    def use(self, name: str) -> Iterator[None]:
        saved = _hooks_now()
        _set_hooks(self.hooks[name])
        try:
            yield
        finally:
            _set_hooks(saved)


def outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    """("ok", value) or ("error", type, message, wire code): comparable across builds."""
    try:
        return ("ok", fn())
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc), getattr(exc, "code", None))


def described(item: Frame | Run) -> Any:
    """A frame or run as plain values, Python types included; a frame's decoded
    sections too (each decoded with the build in use)."""
    if isinstance(item, Run):
        return ("Run", type(item.target), item.target, bytes(item.raw), item.count)
    fields = tuple((type(v), bytes(v) if isinstance(v, bytearray) else v) for v in item)
    blobs = outcome(lambda: [bytes(b) for b in item.blobs()])
    return ("Frame", fields, outcome(item.body), outcome(item.header), blobs)


# -- streams ---------------------------------------------------------------------------------
def _cbor_value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(8 if depth < 2 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([0, 1, -1, 23, 24, 255, 256, 2**32, -(2**63), 2**64 - 1])
    if kind == 2:
        return rng.randbytes(rng.choice([0, 1, 23, 24, 100, 255, 256, 300]))
    if kind == 3:
        return "t" * rng.randrange(40)
    if kind == 4:
        return rng.random()
    if kind == 5:
        return rng.choice([True, False])
    if kind == 6:
        return [_cbor_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": _cbor_value(rng, depth + 1) for i in range(rng.randrange(4))}


def _body_section(rng: random.Random) -> bytes:
    kind = rng.randrange(10)
    if kind < 4:
        return cbor2.dumps(rng.randbytes(rng.choice([0, 5, 23, 24, 200, 256, 1000])))
    if kind < 6:
        return cbor2.dumps(_cbor_value(rng))
    if kind == 6:
        return b""
    if kind == 7:  # a byte-string head with a length that does or does not fit
        head = rng.randrange(0x40, 0x5C)
        return bytes([head]) + rng.randbytes(rng.randrange(10))
    if kind == 8:  # trailing bytes after a valid item
        return cbor2.dumps(rng.randbytes(rng.randrange(30))) + rng.randbytes(rng.randrange(1, 4))
    return rng.randbytes(rng.randrange(40))


def _frame(rng: random.Random) -> bytes:
    """One well-formed frame (types, sections, stamps, blobs and descriptors vary)."""
    ftype = rng.choice([*TYPES, int(FrameType.MESSAGE), int(FrameType.MESSAGE)])
    target = rng.choice(["grp", "gro", "other", "gr\u00fcn", "", "x" * 300])
    source = rng.choice([STAMP, STAMP, b"", b"l.8\0x"])
    if rng.random() < 0.03:
        # Large: the parser's own buffer, a client's body received apart, the broker's
        # growing buffer (which path depends on the parser and the body).
        n = rng.choice([LARGE // 2, LARGE, 3 * LARGE])
        body = cbor2.dumps(rng.randbytes(8) * (n // 8)) if rng.random() < 0.8 else b"\x5a" * n
        header = cbor2.dumps({"h": 1}) if rng.random() < 0.5 else b""
        return b"".join(
            bytes(p)
            for p in framing.encode_frame(
                ftype, target=target, header=header, body=body, source=source
            )
        )
    if rng.random() < 0.4 and ftype == int(FrameType.MESSAGE):
        return framing._encode_small_bytes_py(
            ftype, target.encode(), rng.randbytes(rng.randrange(300)), source
        )
    blobs = [rng.randbytes(rng.randrange(20)) for _ in range(rng.randrange(3))]
    blobs = blobs if rng.random() < 0.2 else []
    return b"".join(
        bytes(p)
        for p in framing.encode_frame(
            ftype,
            target=target,
            request_id=rng.choice([0, 1, 2**63, 2**64 - 1]),
            flags=rng.randrange(256),
            header=cbor2.dumps(_cbor_value(rng)) if rng.random() < 0.3 else b"",
            body=_body_section(rng),
            blobs=blobs,
            source=source,
            n_fds=rng.choice([0, 0, 0, 0, 1, 2]),
        )
    )


# Prefix fields: (offset, struct format) of length, type, tlen, slen, n_blobs, n_fds,
# reserved, header_len, body_len.
_FIELDS = [(0, ">I"), (4, ">B"), (6, ">H"), (8, ">H"), (10, ">H"), (12, ">H"), (14, ">H")]
_FIELDS += [(24, ">I"), (28, ">I")]
_EDGES = {">B": [0, 1, 31, 63, 64, 255], ">H": [0, 1, 0xFFFF], ">I": [0, 27, 28, 2**31, 2**32 - 1]}


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    """The frame with one defect: a prefix field set to an edge or off by a little, a
    flipped byte, bad UTF-8 in the target, a cut, or garbage."""
    b = bytearray(frame)
    kind = rng.randrange(6)
    if kind <= 1 and len(b) >= 32:
        off, fmt = rng.choice(_FIELDS)
        (old,) = struct.unpack_from(fmt, b, off)
        top = 2 ** (8 * struct.calcsize(fmt))
        new = rng.choice(_EDGES[fmt]) if kind == 0 else (old + rng.choice([-1, 1, -28])) % top
        struct.pack_into(fmt, b, off, new)
    elif kind == 2 and b:
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 3 and len(b) > 33:
        tlen = struct.unpack_from(">H", b, 6)[0]
        if tlen:
            b[32 + rng.randrange(tlen)] = rng.choice([0xFF, 0x80, 0xC3, 0xED])
    elif kind == 4:
        del b[rng.randrange(len(b) + 1) :]
    else:
        b[rng.randrange(len(b) + 1) : 0] = rng.randbytes(rng.randrange(1, 40))
    return bytes(b)


def stream(rng: random.Random) -> bytes:
    """Frames, a burst of plain MESSAGEs now and then, a mutated one sometimes."""
    parts = []
    for _ in range(rng.randrange(1, 16)):
        r = rng.random()
        if r < 0.15:
            one = framing._encode_small_bytes_py(
                int(FrameType.MESSAGE), rng.choice([b"grp", b"gro"]), b"p" * rng.randrange(9), STAMP
            )
            parts.extend([one] * rng.randrange(1, 20))
        elif r < 0.3:
            parts.append(_mutate(rng, _frame(rng)))
        else:
            parts.append(_frame(rng))
    return b"".join(parts)


def _chunks(rng: random.Random, data: bytes) -> list[bytes]:
    cuts = sorted(rng.randrange(len(data) + 1) for _ in range(rng.randrange(0, 12)))
    if rng.random() < 0.2:
        cuts += range(0, min(len(data), 80))  # byte by byte at the start
        cuts.sort()
    out, prev = [], 0
    for c in [*cuts, len(data)]:
        out.append(data[prev:c])
        prev = c
    return out


# -- one case --------------------------------------------------------------------------------
def _give(p: FrameParser, piece: bytes) -> None:
    """``piece`` into the parser as an I/O layer would: into the lent buffer while there
    is one, else through feed."""
    pos = 0
    while pos < len(piece):
        view = p.receive_buffer()
        if view is None:
            p.feed(piece[pos:])
            return
        n = min(len(view), len(piece) - pos)
        view[:n] = piece[pos : pos + n]
        view.release()
        p.advance(n)
        pos += n


def _state(p: FrameParser) -> tuple[Any, ...]:
    err = p.error
    return (p.seen, p.returned_bytes, p.buffered, p.in_large_frame, str(err) if err else None)


def run_case(builds: Builds, rng: random.Random) -> None:
    """One stream through both builds; raises Disagreement on any difference."""
    data = stream(rng)
    max_frame = rng.choice([framing.DEFAULT_MAX_FRAME_SIZE, 4 * LARGE, 120, 2000])
    own = rng.random() < 0.5
    lend = rng.random() < 0.5
    parsers = {name: FrameParser(max_frame, own_bodies=own) for name in ("c", "py")}
    for i, piece in enumerate(_chunks(rng, data)):
        call = rng.choice(["frames", "runs", "next", "frames"])
        got = {}
        for name, p in parsers.items():
            with builds.use(name):
                if lend:
                    _give(p, piece)
                else:
                    p.feed(piece)
                if call == "frames":
                    res = outcome(p.frames)
                elif call == "runs":
                    res = outcome(lambda p=p: p.frames_and_runs(STAMP))  # type: ignore[misc]
                else:
                    res = outcome(p.next_frame)
                if res[0] == "ok":
                    value = res[1]
                    items = [] if value is None else value if isinstance(value, list) else [value]
                    res = ("ok", [described(x) for x in items])
                got[name] = (res, _state(p))
        if got["c"] != got["py"]:
            raise Disagreement(f"piece {i} ({call}): compiled {got['c']!r} != pure {got['py']!r}")


def run_hand_made(builds: Builds, rng: random.Random) -> None:
    """``body()`` of a Frame made by hand, fields anywhere: the same value or error."""
    raw: bytes | bytearray = rng.randbytes(rng.choice([0, 1, 32, 40, 64, 300]))
    if rng.random() < 0.3:
        raw = bytearray(raw)

    def length() -> int:
        return rng.choice([0, 1, 5, 31, 32, 64, 2**31, 2**32, 2**62, 2**63, 2**64, -1, -(2**63)])

    if rng.random() < 0.5:
        f = Frame(3, 0, 0, "x", b"", 0, 0, length(), length(), raw, length())
    else:
        # Near the end of raw: a byte-string head whose length fills the claimed body
        # section exactly, which may end inside raw, at its end or a little past it.
        size = len(raw)
        tail, hlen = rng.randrange(size + 2), rng.randrange(3)
        blen = rng.randrange(1, 24)
        at = tail + hlen
        if at < size:
            raw = bytearray(raw) if isinstance(raw, bytearray) else raw
            raw = raw[:at] + bytes([0x40 + blen - 1]) + raw[at + 1 :]
        f = Frame(3, 0, 0, "x", b"", 0, 0, hlen, blen, raw, tail)
    if rng.random() < 0.2:
        f = f._replace(large_body=rng.randbytes(rng.randrange(3)))
    got = {}
    for name in ("c", "py"):
        with builds.use(name):
            got[name] = outcome(f.body)
    if got["c"] != got["py"]:
        raise Disagreement(f"hand-made {f!r}: compiled {got['c']!r} != pure {got['py']!r}")


def fuzz(seed: int, count: int, report: Callable[[str], None] | None = None) -> None:
    """``count`` cases from ``seed`` (case ``k`` is seeded with ``(seed, k)``, so one case
    replays alone). Raises Disagreement naming the seed and case."""
    builds = Builds()
    start = time.monotonic()
    for k in range(count):
        rng = random.Random(f"{seed}:{k}")
        try:
            run_case(builds, rng)
            run_hand_made(builds, rng)
        except Disagreement as exc:
            raise Disagreement(f"seed {seed} case {k}: {exc}") from None
        if report is not None and (k + 1) % 1000 == 0:
            report(f"{k + 1} cases, {time.monotonic() - start:.0f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=10_000, help="cases (default 10,000)")
    ap.add_argument("--case", type=int, default=None, help="replay this one case")
    args = ap.parse_args(argv)
    try:
        if args.case is not None:
            builds = Builds()
            rng = random.Random(f"{args.seed}:{args.case}")
            run_case(builds, rng)
            run_hand_made(builds, rng)
        else:
            fuzz(args.seed, args.count, report=lambda s: print(s, flush=True))
    except Disagreement as exc:
        print(f"DISAGREEMENT {exc}", file=sys.stderr)
        return 1
    print("no disagreement")
    return 0


if __name__ == "__main__":
    sys.exit(main())
