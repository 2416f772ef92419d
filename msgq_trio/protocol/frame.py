"""The parsed frame (:class:`Frame`), a run of frames (:class:`Run`), the decoding of
their CBOR sections, and the descriptors that travel with frames (:class:`FdBuffer`).

Sans-I/O: values only; the parser that makes them is framing.py.
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import cbor2

from .codes import FrameType
from .errors import LocalProtocolError, RemoteProtocolError
from .layout import _LARGE_FRAME, PREFIX, PREFIX_SIZE


class FdBuffer(bytes):
    """The first bytes of a frame to be sent together with file descriptors (SCM_RIGHTS).

    Writers start a new sendmsg at every FdBuffer, so the descriptors travel with the
    first byte of the frame that declares them. Whoever holds an FdBuffer owns ``fds``
    and must close them once sent or dropped.
    """

    fds: tuple[int, ...]

    def __new__(cls, data: bytes, fds: tuple[int, ...]) -> FdBuffer:
        self = super().__new__(cls, data)
        self.fds = fds
        return self


def close_fds(fds: Sequence[int]) -> None:
    """Close descriptors we own (an :class:`FdBuffer`'s, a received frame's), ignoring
    ones already closed. The one copy for every layer: plain ``os.close``, no I/O loop."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


#: Decoded small headers by their encoded bytes (see Frame.header): bounded by count and
#: item size, cleared when full, so any traffic costs O(1) memory here.
_HEADER_CACHE_MAX = 256
_HEADER_CACHE_ITEM = 64
_SCALARS = frozenset({str, int, float, bool, type(None)})
_header_cache: dict[bytes, dict[str, object]] = {}


class SplicedRest(Protocol):
    """The rest of a large frame that the broker's I/O layer holds outside the process
    (``transport/splice.PipeTail``). The protocol and the core only size, route and
    release it; they never read it."""

    #: Set by the core once a receiver's queue holds it: its owner is that queue then.
    taken: bool
    #: The bytes once :meth:`materialize` brought them in, else None.
    data: bytes | None

    def __len__(self) -> int: ...

    def piece(self) -> object:
        """What goes into a receiver's outgoing queue for it."""
        ...

    def materialize(self) -> None:
        """Bring the bytes into memory: :meth:`piece` then returns ``bytes``, which
        any number of receivers may share (one receiver only, before)."""
        ...

    def close(self) -> None:
        """Release what it holds (idempotent)."""
        ...


class Frame(NamedTuple):
    """One parsed frame. Value type: never mutate ``raw``.

    ``raw`` is the whole frame as received (prefix included); the sections are views
    into it computed on demand, so routing a frame costs no copies of its payload.
    Exception: a client's parser receives a large byte-string body straight into a
    ``bytes`` of its own (``large_body``, see :class:`FrameParser`); ``raw`` then ends
    with the body's CBOR head, and the frame's size is
    ``len(raw) + len(large_body)``.
    """

    type: int
    flags: int
    request_id: int
    target: str
    source: bytes
    n_blobs: int
    n_fds: int
    header_len: int
    body_len: int
    raw: bytes | bytearray
    #: Offset in ``raw`` where the header starts (everything from here on is the "tail").
    tail: int
    #: File descriptors that came with this frame (``n_fds`` of them), attached by
    #: :class:`~msgq_trio.protocol.connection.Connection`; their owner must close them.
    fds: tuple[int, ...] = ()
    #: The body's payload (a CBOR byte string's content) when the parser received it
    #: into its own ``bytes``; empty otherwise. :meth:`body` returns it as it is.
    large_body: bytes = b""
    #: The broker's large frames only: the frame's last bytes, held outside the process
    #: (spliced into pipes, see :class:`SplicedRest`); ``raw`` ends where they start.
    spliced: SplicedRest | None = None

    @property
    def wire_size(self) -> int:
        """The frame's size on the wire (prefix included)."""
        n = len(self.raw) + len(self.large_body)
        return n + len(self.spliced) if self.spliced is not None else n

    @property
    def header_bytes(self) -> memoryview:
        return memoryview(self.raw)[self.tail : self.tail + self.header_len]

    @property
    def body_bytes(self) -> memoryview:
        start = self.tail + self.header_len
        if self.large_body:
            # (a copy: only for a caller that wants the encoded section itself)
            return memoryview(bytes(memoryview(self.raw)[start:]) + self.large_body)
        return memoryview(self.raw)[start : start + self.body_len]

    def header(self) -> dict[str, object]:
        """Decode the CBOR header (an empty section means an empty map).

        Raises:
            RemoteProtocolError: the header is not a CBOR map or has trailing bytes.
        """
        hlen = self.header_len
        if not hlen:
            return {}
        key = b""
        if hlen <= _HEADER_CACHE_ITEM:
            # Small headers repeat ({"cmd": "echo"} on every call): a cache hit costs a
            # slice and a dict copy, several times less than a CBOR decode.
            part = self.raw[self.tail : self.tail + hlen]
            # A large frame's raw is a bytearray, whose slices cannot be dict keys.
            key = part if isinstance(part, bytes) else bytes(part)
            hit = _header_cache.get(key)
            if hit is not None:
                return dict(hit)
        value = decode_cbor(self.header_bytes, "header")
        if not isinstance(value, dict):
            raise RemoteProtocolError("frame header is not a CBOR map")
        if key and all(type(v) in _SCALARS for v in value.values()):
            # Only maps of scalars: the copy handed out is then as good as a fresh decode.
            if len(_header_cache) >= _HEADER_CACHE_MAX:
                _header_cache.clear()
            _header_cache[key] = dict(value)
        return value

    def body(self) -> object:
        """Decode the CBOR body (an empty section means ``None``).

        Raises:
            RemoteProtocolError: the body is not well-formed CBOR or has trailing bytes.
            LocalProtocolError: the Frame was made by hand and its lengths put the body
                outside ``raw``.
        """
        if self.large_body:
            return self.large_body
        blen = self.body_len
        if not blen:
            return None
        raw = self.raw
        tail, hlen = self.tail, self.header_len
        start = tail + hlen
        if tail < 0 or hlen < 0 or blen < 0 or start + blen > len(raw):
            # Never a parsed frame: one made by hand whose fields disagree with raw.
            raise LocalProtocolError(
                f"Frame fields put the body at {start}..{start + blen}, outside raw"
                f" ({len(raw)} bytes): not a frame the parser made"
            )
        ib = raw[start]
        if 0x40 <= ib <= 0x5A:
            # A definite-length byte string (the common binary body) is its head and a
            # slice: no decoder call, the most of a small body's decode. The length must
            # fill the section exactly, as for any body; anything else goes to cbor2.
            if ib < 0x58:
                h, n = 1, ib - 0x40
            elif blen >= 1 + (k := 1 << (ib - 0x58)):
                h, n = 1 + k, int.from_bytes(raw[start + 1 : start + 1 + k], "big")
            else:
                h, n = 0, -1
            if h + n == blen:
                if type(raw) is bytes:
                    return raw[start + h : start + blen]
                # A large frame's raw is a bytearray: slicing it would copy once into a
                # bytearray and bytes() again; through a memoryview it is one copy.
                return bytes(memoryview(raw)[start + h : start + blen])
        if blen < _LARGE_FRAME and type(raw) is bytes:
            # Small bodies decode in place: BytesIO over bytes shares the buffer, so no
            # slice is copied (an allocation and a copy per body saved). Large ones
            # decode faster from a memoryview slice.
            buf = io.BytesIO(raw)
            buf.seek(start)
            try:
                value = cbor2.load(buf)
            except Exception as exc:  # cbor2 raises several unrelated types on bad input
                raise RemoteProtocolError(f"malformed CBOR in frame body: {exc}") from exc
            if buf.tell() != start + self.body_len:
                raise RemoteProtocolError("CBOR body does not fill its section exactly")
            return value
        return decode_cbor(self.body_bytes, "body")

    def blobs(self) -> list[memoryview]:
        """The binary attachments, as views into ``raw`` (no copies)."""
        if not self.n_blobs:
            return []
        pos = self.tail + self.header_len + self.body_len
        view = memoryview(self.raw)
        lens = struct.unpack_from(f">{self.n_blobs}I", self.raw, pos)
        pos += 4 * self.n_blobs
        out = []
        for n in lens:
            out.append(view[pos : pos + n])
            pos += n
        return out


class Run:
    """Consecutive MESSAGE frames from one sender to one target, as one buffer.

    Made by :meth:`FrameParser.frames_and_runs` only for frames that already carry the
    stamp the broker would give them, no descriptors and no blobs, so ``raw`` (the frames
    back to back, exactly as received) can be forwarded unchanged. Has the attributes of
    :class:`Frame` that the connection's state table and descriptor accounting read.
    """

    __slots__ = ("count", "raw", "target")

    type = FrameType.MESSAGE
    n_fds = 0
    fds: tuple[int, ...] = ()
    large_body = b""
    spliced = None

    def __init__(self, target: str, raw: bytes, count: int) -> None:
        self.target = target
        self.raw = raw
        self.count = count

    def __repr__(self) -> str:
        return f"<Run to {self.target!r}: {self.count} frames, {len(self.raw)} bytes>"

    @property
    def wire_size(self) -> int:
        """The run's size on the wire."""
        return len(self.raw)

    def frames(self) -> list[Frame]:
        """The run as one :class:`Frame` per message (its frames were checked already)."""
        raw = self.raw
        out = []
        pos = 0
        while pos < len(raw):
            (length, ftype, flags, tlen, slen, _nb, _nf, _r, rid, hlen, blen) = PREFIX.unpack_from(
                raw, pos
            )
            one = raw[pos : pos + 4 + length]
            pos += 4 + length
            tend = PREFIX_SIZE + tlen
            out.append(
                Frame(
                    ftype,
                    flags,
                    rid,
                    self.target,
                    one[tend : tend + slen],
                    0,
                    0,
                    hlen,
                    blen,
                    one,
                    tend + slen,
                )
            )
        return out


def decode_cbor(data: bytes | memoryview, what: str) -> object:
    """Decode exactly one CBOR item; trailing bytes are a protocol error.

    cbor2.loads() silently ignores trailing bytes, so the length is checked here.
    """
    buf = io.BytesIO(data)
    try:
        value = cbor2.load(buf)
    except Exception as exc:  # cbor2 raises several unrelated types on bad input
        raise RemoteProtocolError(f"malformed CBOR in frame {what}: {exc}") from exc
    if buf.tell() != len(data):
        raise RemoteProtocolError(f"trailing bytes after CBOR {what}")
    return value


def encode_cbor(value: object) -> bytes:
    try:
        return cbor2.dumps(value)
    except Exception as exc:
        raise LocalProtocolError(f"value cannot be encoded as CBOR: {exc}") from exc
