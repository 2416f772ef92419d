"""Frame layout: encoding frames to bytes and parsing a byte stream back into frames.

Every frame is a fixed 32-byte prefix followed by variable sections (docs/PROTOCOL.md):

    offset size  field
    0      4     length      u32 BE, bytes that follow this field (so frame size = 4 + length)
    4      1     type        FrameType
    5      1     flags       Flag bits
    6      2     target_len  u16 BE
    8      2     source_len  u16 BE (0 from clients; the broker stamps the true sender)
    10     2     n_blobs     u16 BE, binary attachments in this frame
    12     2     n_fds       u16 BE, file descriptors sent alongside (SCM_RIGHTS)
    14     2     reserved    must be 0
    16     8     request_id  u64 BE, 0 = none
    24     4     header_len  u32 BE, CBOR map (may be 0 bytes = empty map)
    28     4     body_len    u32 BE, CBOR value (may be 0 bytes = None)
    32     ...   target (UTF-8) | source | header | body | n_blobs x u32 BE blob lengths | blobs

Routing needs only the prefix and the target, so the broker never decodes a body, and
re-stamping the sender copies only the prefix: the tail (header onwards) is forwarded as is.
This module is sans-I/O: bytes in, frames out.
"""

from __future__ import annotations

import io
import os
import struct
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple, NoReturn, Protocol, TypeVar

import cbor2

from .codes import ErrorCode, FrameType
from .errors import LocalProtocolError, RemoteProtocolError

_T = TypeVar("_T")

PREFIX = struct.Struct(">IBBHHHHHQII")
PREFIX_SIZE = PREFIX.size  # 32
#: Bytes of the prefix counted by ``length`` (everything after the length field itself).
_FIXED_AFTER_LENGTH = PREFIX_SIZE - 4
_BLOB_LEN = struct.Struct(">I")

#: Default maximum frame size. 64 MiB: configuration pushes carry multi-megabyte
#: snippets (a server with millions of zones); dbus-daemon allows 128 MiB messages,
#: NATS 64 MiB max_payload.
DEFAULT_MAX_FRAME_SIZE = 64 * 1024 * 1024
#: The u32 length field bounds any configured maximum.
ABSOLUTE_MAX_FRAME_SIZE = 0xFFFFFFFF
#: Frames at least this big are assembled in a buffer of their own instead of the shared
#: receive buffer, so a multi-megabyte frame is not moved again with every chunk. That
#: buffer grows with the bytes that actually arrive, never from the claimed length: its
#: size is at most max(_LARGE_FRAME, 2 x the bytes received), and the part not yet
#: received is never written (see _resize), so its pages cost no resident memory: a
#: client that announces 64 MiB and sends 1 byte costs about 1 page (scenario
#: near-max-length-prefixes).
_LARGE_FRAME = 256 * 1024


def _resize_by_writing(buf: bytearray, size: int) -> None:
    buf.extend(bytes(size - len(buf)))


def _resizer() -> Callable[[bytearray, int], None]:
    """Grow a bytearray without writing the new bytes (``PyByteArray_Resize``).

    Why: the I/O layer receives a large frame straight into its buffer
    (:meth:`FrameParser.receive_buffer`); zero-filling the part still to come would
    touch every page once more and, above all, make a claimed-but-unsent frame cost
    resident memory. Outside CPython: an ordinary zero-filled extend.
    """
    try:
        import ctypes

        fn = ctypes.pythonapi.PyByteArray_Resize
    except (ImportError, AttributeError):
        return _resize_by_writing
    fn.argtypes = [ctypes.py_object, ctypes.c_ssize_t]
    fn.restype = ctypes.c_int

    def resize(buf: bytearray, size: int) -> None:
        fn(buf, size)  # ctypes.pythonapi raises the Python error it sets (BufferError...)

    return resize


_resize = _resizer()


def _new_body_py(n: int) -> tuple[bytes | bytearray, memoryview]:
    """A buffer of ``n`` bytes (``n`` > 0) to receive a large body into, and a writable
    view of it: the reference, a bytearray (:meth:`FrameParser.next_frame` copies it into
    the ``bytes`` it hands out). Grown without writing, as for :func:`_resize`: a body
    announced but not sent costs no resident memory.

    The compiled ``_speedups.new_bytes`` returns the ``bytes`` itself, its view owned by
    an object that keeps it alive, which saves that copy (a full pass over a
    multi-megabyte body).
    """
    buf = bytearray()
    _resize(buf, n)
    return buf, memoryview(buf)


#: :func:`_new_body_py`, or the compiled ``new_bytes`` (see :data:`SPEEDUPS`).
_new_body: Callable[[int], tuple[bytes | bytearray, memoryview]] = _new_body_py
#: :attr:`FrameParser.seen` bit: a frame declares descriptors (frame types are < 32).
SEEN_FDS = 1 << 32
_SEEN_ALL = (1 << 33) - 1  # after an error: make no claim about the frames returned
_VALID_TYPES = frozenset(int(t) for t in FrameType)
_MESSAGE = int(FrameType.MESSAGE)
_U16 = 0xFFFF


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


#: The frame types whose large bodies the broker may splice: one-way, routed on the head.
_SPLICE_TYPES = frozenset({FrameType.MESSAGE, FrameType.NOTIFY})


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


def encode_frame(
    type: int,
    *,
    target: str = "",
    request_id: int = 0,
    flags: int = 0,
    header: bytes = b"",
    body: bytes = b"",
    blobs: Sequence[bytes | bytearray | memoryview] = (),
    source: bytes = b"",
    n_fds: int = 0,
) -> list[bytes | bytearray | memoryview]:
    """Build one frame from already-encoded sections.

    Returns a list of buffers whose concatenation is the frame; large blobs are not
    copied (the writer joins small pieces and sends large ones as they are).

    Raises:
        LocalProtocolError: a section is too long for its length field.
    """
    tb = target.encode()
    if len(tb) > _U16 or len(source) > _U16:
        raise LocalProtocolError("target or source longer than 65535 bytes")
    if len(blobs) > _U16 or n_fds > _U16:
        raise LocalProtocolError("too many attachments in one frame")
    blob_total = 0
    for b in blobs:
        blob_total += len(b)
    length = (
        _FIXED_AFTER_LENGTH
        + len(tb)
        + len(source)
        + len(header)
        + len(body)
        + 4 * len(blobs)
        + blob_total
    )
    if length > ABSOLUTE_MAX_FRAME_SIZE - 4:
        raise LocalProtocolError("frame larger than 4 GiB")
    head = (
        PREFIX.pack(
            length,
            type,
            flags,
            len(tb),
            len(source),
            len(blobs),
            n_fds,
            0,
            request_id,
            len(header),
            len(body),
        )
        + tb
        + source
        + header
    )
    if not blobs:
        if len(body) < _LARGE_FRAME:
            return [head + body]
        return [head, body]
    pieces: list[bytes | bytearray | memoryview] = [
        head,
        body,
        struct.pack(f">{len(blobs)}I", *(len(b) for b in blobs)),
    ]
    pieces.extend(blobs)
    return pieces


def encode_simple(
    type: int,
    target: bytes,
    body: bytes,
    header: bytes = b"",
    request_id: int = 0,
    flags: int = 0,
    source: bytes = b"",
    body_head: tuple[bytes, int] | None = None,
) -> bytes:
    """Fast path of :func:`encode_frame` for a frame without attachments.

    ``target`` is already UTF-8 encoded (callers cache it); ``source`` is the sender's
    own stamp (``lname NUL name``, see docs/PROTOCOL.md) or empty. Returns one bytes object.
    With ``body_head=(head, n)``, ``body`` must be empty: the frame declares a body of
    ``len(head) + n`` bytes and ends with ``head``; the caller sends the ``n`` bytes after it.
    """
    tl = len(target)
    sl = len(source)
    if tl > _U16 or sl > _U16:
        raise LocalProtocolError("target or source longer than 65535 bytes")
    blen = len(body)
    if body_head is not None:
        body, blen = body_head[0], len(body_head[0]) + body_head[1]
    return (
        PREFIX.pack(
            _FIXED_AFTER_LENGTH + tl + sl + len(header) + blen,
            type,
            flags,
            tl,
            sl,
            0,
            0,
            0,
            request_id,
            len(header),
            blen,
        )
        + target
        + source
        + header
        + body
    )


def cbor_bytes_head(n: int) -> bytes:
    """The CBOR head of a definite-length byte string of ``n`` bytes (major type 2)."""
    if n < 24:
        return bytes((0x40 + n,))
    if n < 0x100:
        return bytes((0x58, n))
    if n < 0x10000:
        return b"\x59" + n.to_bytes(2, "big")
    if n < 0x100000000:
        return b"\x5a" + n.to_bytes(4, "big")
    return b"\x5b" + n.to_bytes(8, "big")


def _encode_small_bytes_py(type: int, target: bytes, payload: bytes, source: bytes) -> bytes:
    """A frame without header whose body is the CBOR byte string ``payload``, in one
    step: the same bytes as :func:`encode_simple` with ``cbor2.dumps(payload)``, without
    the encoder call and the intermediate copy (a small binary body is the common
    one-way message). ``target`` and ``source`` as for :func:`encode_simple`.

    Raises:
        LocalProtocolError: ``target`` or ``source`` is longer than 65535 bytes.
    """
    n = len(payload)
    tl = len(target)
    sl = len(source)
    if tl > _U16 or sl > _U16:
        raise LocalProtocolError("target or source longer than 65535 bytes")
    if n < 24:
        head = _SMALL_HEADS[n]
    elif n < 0x100:
        head = bytes((0x58, n))
    else:
        head = cbor_bytes_head(n)
    blen = len(head) + n
    return (
        PREFIX.pack(_FIXED_AFTER_LENGTH + tl + sl + blen, type, 0, tl, sl, 0, 0, 0, 0, 0, blen)
        + target
        + source
        + head
        + payload
    )


#: CBOR heads of byte strings shorter than 24 bytes (the length is in the head byte).
_SMALL_HEADS = tuple(bytes((0x40 + n,)) for n in range(24))
#: :func:`_encode_small_bytes_py`, or the compiled copy of it (see :data:`SPEEDUPS`).
encode_small_bytes: Callable[[int, bytes, bytes, bytes], bytes] = _encode_small_bytes_py


def encode_bytes_message(
    type: int, target: bytes, payload: bytes, source: bytes = b""
) -> list[bytes]:
    """A frame whose body is the CBOR byte string ``payload``, as two pieces: everything
    before the payload, then ``payload`` itself (not copied).

    For large binary bodies: :func:`encode_simple` would copy the payload twice (the CBOR
    encoding and the join), each into freshly faulted pages. The caller's writer sends
    both pieces with one ``sendmsg``. Same output bytes as :func:`encode_simple` with
    ``cbor2.dumps(payload)``.
    """
    head = cbor_bytes_head(len(payload))
    return [
        encode_simple(type, target, b"", source=source, body_head=(head, len(payload))),
        payload,
    ]


def stamped(frame: Frame, source: bytes) -> list[bytes | bytearray | memoryview]:
    """The frame as it must be forwarded with sender ``source``: ``frame.raw`` itself when
    the sender already wrote that source (no copy), else :func:`restamp`."""
    if frame.spliced is not None:
        # The rest stays where it is: the head goes first, then the rest's piece.
        return [*restamp(frame, source), frame.spliced.piece()]  # type: ignore[list-item]
    if frame.source == source:
        raw = frame.raw
        if len(raw) < _LARGE_FRAME:
            return [raw]
        # Large: the head apart, so a copy of the first piece (FdBuffer) stays small.
        return [bytes(raw[: frame.tail]), memoryview(raw)[frame.tail :]]
    return restamp(frame, source)


def restamp(frame: Frame, source: bytes) -> list[bytes | bytearray | memoryview]:
    """The same frame with its source section replaced by ``source``.

    Only the 32-byte prefix is rebuilt; target and tail are shared with ``frame.raw``.
    A spliced frame's rest (``frame.spliced``) is not among the pieces: it follows them.
    """
    raw = frame.raw
    tail_start = frame.tail
    target_end = PREFIX_SIZE + (tail_start - PREFIX_SIZE - len(frame.source))
    tail_len = len(raw) - tail_start
    length = _FIXED_AFTER_LENGTH + (target_end - PREFIX_SIZE) + len(source) + tail_len
    if frame.spliced is not None:
        length += len(frame.spliced)
    head = PREFIX.pack(
        length,
        frame.type,
        frame.flags,
        target_end - PREFIX_SIZE,
        len(source),
        frame.n_blobs,
        frame.n_fds,
        0,
        frame.request_id,
        frame.header_len,
        frame.body_len,
    )
    if tail_len < _LARGE_FRAME:
        return [head + raw[PREFIX_SIZE:target_end] + source + raw[tail_start:]]
    return [head + raw[PREFIX_SIZE:target_end] + source, memoryview(raw)[tail_start:]]


def _scan_loop_py(
    buf: bytearray, pos: int, limit: int, source: bytes | None, out: list[Frame | Run], seen: int
) -> tuple[int, int, bool]:
    """The fast loop of :meth:`FrameParser._scan`: complete, plain frames from ``pos`` on.

    Appends a :class:`Frame` per frame (or a :class:`Run` per run of MESSAGE frames that
    carry exactly ``source``; None: no runs) to ``out`` and stops before the first frame
    that is incomplete, larger than ``limit`` (the maximum frame size - 4), has blobs or
    fails a check: the careful path (:meth:`FrameParser.next_frame`) takes over there and
    raises the error. Returns the new position, ``seen`` with the appended frames' bits,
    and whether it stopped on a target that is not UTF-8 (the position is then that
    frame's start if it would have begun a run, else its end).

    The reference for the compiled ``_speedups.scan``, which must do exactly this.
    """
    end = len(buf)
    unpack = PREFIX.unpack_from
    valid = _VALID_TYPES
    append = out.append
    slen_run = -1 if source is None else len(source)
    new_tuple = tuple.__new__
    startswith = buf.startswith
    # The open run: its first byte, frame count and encoded target (b"" = none open).
    run_start = run_n = 0
    run_tb = b""
    run_target = ""
    try:
        while end - pos >= PREFIX_SIZE:
            (length, ftype, flags, tlen, slen, nblobs, nfds, reserved, rid, hlen, blen) = unpack(
                buf, pos
            )
            total = 4 + length
            if (
                length > limit
                or nblobs
                or ftype not in valid
                or reserved
                or _FIXED_AFTER_LENGTH + tlen + slen + hlen + blen != length
            ):
                break  # anything unusual (or an error) takes the careful path
            if end - pos < total:
                break
            seen |= (1 << ftype) | (SEEN_FDS if nfds else 0)
            tstart = pos + PREFIX_SIZE
            if (
                slen == slen_run
                and ftype == _MESSAGE
                and not nfds
                and tlen
                and startswith(source, tstart + tlen)  # type: ignore[arg-type]
            ):
                if run_n and tlen == len(run_tb) and startswith(run_tb, tstart):
                    run_n += 1
                    pos += total
                    continue
                if run_n:
                    append(Run(run_target, bytes(buf[run_start:pos]), run_n))
                    run_n = 0
                run_tb = bytes(buf[tstart : tstart + tlen])
                run_target = run_tb.decode()
                run_start = pos
                run_n = 1
                pos += total
                continue
            if run_n:
                append(Run(run_target, bytes(buf[run_start:pos]), run_n))
                run_n = 0
            raw = bytes(buf[pos : pos + total])
            pos += total
            tend = PREFIX_SIZE + tlen
            # tuple.__new__ directly: the NamedTuple's own __new__ is a Python-level
            # function, a tenth of the parse time per small frame.
            append(
                new_tuple(
                    Frame,
                    (
                        ftype,
                        flags,
                        rid,
                        raw[PREFIX_SIZE:tend].decode(),
                        raw[tend : tend + slen],
                        0,
                        nfds,
                        hlen,
                        blen,
                        raw,
                        tend + slen,
                        (),
                        b"",
                        None,
                    ),
                )
            )
    except UnicodeDecodeError:
        # No run is open here: it is closed before any target is decoded.
        return pos, seen, True
    if run_n:
        append(Run(run_target, bytes(buf[run_start:pos]), run_n))
    return pos, seen, False


class FrameParser:
    """Incremental frame parser: feed bytes, take complete frames.

    ``max_frame_size`` is checked on the length prefix before any memory is allocated
    for the frame, so an absurd length costs nothing but the error.
    After a :class:`RemoteProtocolError` the parser is poisoned: every later call raises
    the same error (the connection must be closed).

    With ``own_bodies`` (a client's parser), a large frame whose body is one CBOR byte
    string of at least half of :data:`_LARGE_FRAME` and which has no blobs is received
    in two parts: the bytes up to the body's content in the frame buffer, the content
    into a buffer of its own (``Frame.large_body`` once complete, which
    :meth:`Frame.body` returns as it is). With the compiled fast paths that buffer is
    the ``bytes`` handed out, which saves a copy of the body; the pure build copies its
    bytearray into one when the frame is complete. That buffer is allocated at the
    frame's full size when the head has arrived, not grown with what arrives: only for a
    peer that sends whole frames (a client's peer is the broker, which forwards a frame
    only once all of it has arrived). The broker's parser keeps the growing buffer.
    """

    __slots__ = (
        "_body",
        "_body_view",
        "_buf",
        "_error",
        "_large",
        "_large_fill",
        "_large_lent",
        "_large_total",
        "_pos",
        "_spliced",
        "_splicing",
        "max_frame_size",
        "own_bodies",
        "returned_bytes",
        "seen",
    )

    def __init__(
        self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, *, own_bodies: bool = False
    ) -> None:
        if not 0 < max_frame_size <= ABSOLUTE_MAX_FRAME_SIZE:
            raise ValueError(f"max_frame_size must be in 1..{ABSOLUTE_MAX_FRAME_SIZE}")
        self.max_frame_size = max_frame_size
        self.own_bodies = own_bodies
        self._buf = bytearray()
        self._pos = 0
        # A frame of at least _LARGE_FRAME bytes in progress: its buffer (len = capacity,
        # only the first _large_fill bytes received), its full length, and whether
        # receive_buffer() lent a view of it that advance() has not taken back.
        self._large: bytearray | None = None
        self._large_fill = 0
        self._large_total = 0
        self._large_lent = False
        # With own_bodies, a large frame received in two parts: _large holds exactly the
        # bytes before the body's content, which goes into _body through _body_view
        # (_large_fill counts both parts).
        self._body: bytes | bytearray | None = None
        self._body_view: memoryview | None = None
        # The broker's splice of a large frame's rest (splice_rest): the bytes expected
        # outside the parser (-1: not for this frame, it fell back to unsplice), then what
        # holds them once they are all there.
        self._splicing = 0
        self._spliced: SplicedRest | None = None
        #: What the last :meth:`frames` / :meth:`frames_and_runs` returned: bit ``1 << t``
        #: for each frame type ``t`` among them, plus :data:`SEEN_FDS` if any frame declares
        #: descriptors. Lets the connection's state check skip a per-frame loop.
        self.seen = 0
        #: The bytes of the frames (prefixes included) the last :meth:`frames` /
        #: :meth:`frames_and_runs` returned: a client queues a burst of them whole.
        self.returned_bytes = 0
        # Kept without a traceback and raised as fresh copies: a stored, raised exception
        # would pin this parser's frames (and its buffers) in a reference cycle.
        self._error: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames (for idle-in-frame checks)."""
        n = len(self._buf) - self._pos
        if self._large is not None:
            n += self._large_fill
        return n

    @property
    def error(self) -> RemoteProtocolError | None:
        """The error that poisoned this parser, if any (raised again by every call)."""
        return self._error

    @property
    def in_frame(self) -> bool:
        """True while part of a frame has arrived and the rest has not."""
        return self.buffered > 0

    @property
    def in_large_frame(self) -> bool:
        """True while a large frame (one assembled in a buffer of its own) has started
        arriving and is not complete."""
        return self._large is not None

    def splice_rest(self, min_rest: int) -> int:
        """The broker's zero-copy path: if the rest of the large frame in progress may
        arrive outside the parser, how many bytes it is (then the parser expects
        :meth:`complete_spliced` or :meth:`unsplice`); 0 if not (receive as usual).

        Only a MESSAGE or NOTIFY with no blobs and no descriptors, whose prefix, target,
        source and header have arrived and are valid, and whose rest is at least
        ``min_rest`` bytes: the broker routes such a frame on its head alone and never
        reads its body. The checks :meth:`next_frame` makes on the whole frame are made
        here, so the frame, once complete, cannot be refused with its rest outside.
        """
        large = self._large
        if (
            large is None
            or self._splicing
            or self._large_lent
            or self._body_view is not None
            or self._error is not None
        ):
            return 0
        fill = self._large_fill
        rest = self._large_total - fill
        if rest < max(min_rest, 1) or fill < PREFIX_SIZE:
            return 0
        (length, ftype, _f, tlen, slen, nblobs, nfds, reserved, _rid, hlen, blen) = (
            PREFIX.unpack_from(large, 0)
        )
        if ftype not in _SPLICE_TYPES or nblobs or nfds or reserved:
            return 0
        head = PREFIX_SIZE + tlen + slen + hlen
        if fill < head or _FIXED_AFTER_LENGTH + tlen + slen + hlen + blen != length:
            return 0
        try:
            bytes(large[PREFIX_SIZE : PREFIX_SIZE + tlen]).decode()
        except UnicodeDecodeError:
            return 0
        self._splicing = rest
        return rest

    def complete_spliced(self, rest: SplicedRest) -> None:
        """All of the rest :meth:`splice_rest` announced is in ``rest``: the frame is
        complete (:meth:`next_frame` returns it with ``Frame.spliced = rest``).

        Raises:
            LocalProtocolError: no splice was announced, or ``rest`` has another size.
        """
        if self._splicing <= 0 or len(rest) != self._splicing:
            raise LocalProtocolError("complete_spliced() does not match splice_rest()")
        self._splicing = 0
        self._spliced = rest
        self._large_total = self._large_fill

    def unsplice(self, data: bytes | bytearray | memoryview) -> None:
        """The announced rest will not be spliced after all: ``data`` is the part of it
        that was (possibly empty); the rest arrives as usual.

        Raises:
            LocalProtocolError: no splice was announced, or ``data`` is too long.
        """
        if self._splicing <= 0 or len(data) > self._splicing:
            raise LocalProtocolError("unsplice() does not match splice_rest()")
        self._splicing = -1  # the rest of this frame comes the ordinary way
        if data:
            self._large_put(data)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes (copied: ``data`` may be reused by the caller at once).
        ``b""`` (EOF) is not special here: the caller handles EOF."""
        if self._splicing > 0:
            raise LocalProtocolError("bytes fed while a frame's rest is being spliced")
        if self._large is not None:
            need = self._large_total - self._large_fill
            if need >= len(data):
                self._large_put(data)
            else:
                self._large_put(memoryview(data)[:need])
                self._buf += memoryview(data)[need:]
            return
        if self._pos and self._pos == len(self._buf):
            self._buf.clear()
            self._pos = 0
        if not self._buf and self._start_large_from(data):
            return
        self._buf += data

    def _start_large_from(self, data: bytes | bytearray | memoryview) -> bool:
        """With nothing buffered, ``data`` begins a large frame and holds part of it: move
        it into the frame's own buffer (or body) at once. True if done.

        Why: otherwise the first receive of every large frame is appended to the frame
        buffer (an allocation, a copy and fresh pages) only to be copied out again by
        :meth:`next_frame`; a stream of large frames starts each one here, since a receive
        into a large frame ends where the frame does. Anything unusual (a bad length, a
        body head not yet in, a whole frame) takes the ordinary path, which judges it.
        """
        n = len(data)
        if n < PREFIX_SIZE or self._error is not None:
            return False
        length = int.from_bytes(data[:4], "big")
        total = 4 + length
        if not _LARGE_FRAME <= total <= self.max_frame_size or n >= total:
            return False
        view = memoryview(data)
        head = self._body_head(view, 0, n) if self.own_bodies else 0
        if head < 0:
            return False
        if head:
            self._start_body(view, total, head)
        else:
            self._start_large(view, total)
        return True

    def receive_buffer(self) -> memoryview | None:
        """Where the next received bytes should go, if they belong to a large frame in
        progress: a writable, non-empty view of the rest of its buffer (at most the bytes
        the frame still lacks). None otherwise: receive anywhere and :meth:`feed` them.

        After receiving ``n`` bytes into it, release the view (and every slice of it: the
        buffer cannot grow while one is alive) and call :meth:`advance` (``n`` may be 0);
        nothing else may be called in between. This saves the copy that :meth:`feed`
        makes: the kernel writes the frame's bytes in place.
        """
        large = self._large
        if (
            large is None
            or self._error is not None
            or self._large_fill == self._large_total
            or self._splicing > 0
        ):
            return None  # (a complete frame waits to be taken: never lend an empty view)
        if self._large_lent:
            raise LocalProtocolError("receive_buffer() called twice without advance()")
        fill = self._large_fill
        self._large_lent = True
        if self._body_view is not None:
            return self._body_view[fill - len(large) :]
        if fill == len(large):
            self._large_grow()
        return memoryview(large)[fill:]

    @property
    def lent(self) -> bool:
        """True between :meth:`receive_buffer` (returning a view) and :meth:`advance`."""
        return self._large_lent

    def advance(self, n: int) -> None:
        """``n`` bytes were written at the start of the view :meth:`receive_buffer` lent.

        Raises:
            LocalProtocolError: no view is lent, or ``n`` exceeds it.
        """
        if not self._large_lent or self._large is None:
            raise LocalProtocolError("advance() without receive_buffer()")
        room = self._large_total if self._body_view is not None else len(self._large)
        if not 0 <= n <= room - self._large_fill:
            raise LocalProtocolError(f"advance({n}) beyond the lent buffer")
        self._large_lent = False
        self._large_fill += n

    def _large_put(self, data: bytes | bytearray | memoryview) -> None:
        large = self._large
        assert large is not None
        fill, n = self._large_fill, len(data)
        if self._body_view is not None:
            at = fill - len(large)
            self._body_view[at : at + n] = data
            self._large_fill = fill + n
            return
        while fill + n > len(large):
            self._large_grow()
        # Through a view: a bytearray's slice assignment from anything but a bytearray
        # first copies the source into a temporary bytearray.
        with memoryview(large) as dest:
            dest[fill : fill + n] = data
        self._large_fill = fill + n

    def _large_grow(self) -> None:
        """Double the large frame's buffer (at least _LARGE_FRAME, at most the frame)."""
        large = self._large
        assert large is not None
        _resize(large, min(self._large_total, max(2 * len(large), _LARGE_FRAME)))

    def _start_large(self, part: bytes | bytearray | memoryview, total: int) -> None:
        large = bytearray()
        self._large, self._large_fill, self._large_total = large, 0, total
        _resize(large, min(total, max(2 * len(part), _LARGE_FRAME)))
        self._large_put(part)

    def _body_head(self, buf: bytearray | memoryview, pos: int, avail: int) -> int:
        """For a large frame starting at ``buf[pos]`` with ``avail`` of its bytes here:
        the length of its part before the body's content if it is to be received in two
        parts (see the class), 0 if not, -1 if that cannot be told yet."""
        if avail < PREFIX_SIZE:
            return -1
        (length, _t, _f, tlen, slen, _b, _n, _r, _rid, hlen, blen) = PREFIX.unpack_from(buf, pos)
        start = PREFIX_SIZE + tlen + slen + hlen
        # Blobs after the body make the sum differ; a malformed frame is left to the
        # careful path, which rejects it.
        if blen < _LARGE_FRAME // 2 or start + blen != 4 + length:
            return 0
        if start + 5 > _LARGE_FRAME:
            return 0  # a header this long: not worth holding the frame back for
        if avail < start + 5:  # a u32-length byte string's head is 5 bytes
            return -1
        ib = buf[pos + start]
        if not 0x40 <= ib <= 0x5A:
            return 0
        if ib < 0x58:
            h, n = 1, ib - 0x40
        else:
            k = 1 << (ib - 0x58)
            h, n = 1 + k, int.from_bytes(buf[pos + start + 1 : pos + start + 1 + k], "big")
        return start + h if h + n == blen else 0

    def _start_body(self, part: memoryview, total: int, head: int) -> None:
        self._body, self._body_view = _new_body(total - head)
        self._large, self._large_fill, self._large_total = bytearray(part[:head]), head, total
        self._large_put(part[head:])

    def next_frame(self) -> Frame | None:
        """Return the next complete frame, or None when more bytes are needed.

        Raises:
            RemoteProtocolError: the stream violates the framing rules.
        """
        if self._error is not None:
            self._raise()
        large = self._large
        if large is not None:
            if self._large_fill < self._large_total:
                return None
            self._large = None
            fill = self._large_fill
            self._large_total = self._large_fill = 0
            self._splicing = 0
            spliced = self._spliced
            if spliced is not None:
                self._spliced = None
                del large[fill:]  # (capacity beyond the head: no copy)
                return self._parse(large, b"", spliced)
            view = self._body_view
            if view is not None:
                body = self._body
                assert body is not None
                self._body = self._body_view = None
                view.release()  # no writable view of the bytes handed out is kept
                if type(body) is not bytes:
                    body = bytes(body)  # (the pure build's bytearray)
                return self._parse(bytes(large), body)
            return self._parse(large)  # grown to at most the frame: exactly its bytes
        buf = self._buf
        pos = self._pos
        avail = len(buf) - pos
        if avail < 4:
            self._compact()
            return None
        length = int.from_bytes(buf[pos : pos + 4], "big")
        if length > self.max_frame_size - 4 or length < _FIXED_AFTER_LENGTH:
            self._fail(
                f"frame length {length + 4} outside 32..{self.max_frame_size}",
                ErrorCode.FRAME_TOO_LARGE
                if length >= _FIXED_AFTER_LENGTH
                else ErrorCode.PROTOCOL_ERROR,
            )
        total = 4 + length
        if avail < total:
            head = (
                self._body_head(buf, pos, avail) if total >= _LARGE_FRAME and self.own_bodies else 0
            )
            if head < 0:
                self._compact()  # (the body's head is still to come)
            elif total >= _LARGE_FRAME:
                # Move the partial frame into a buffer of its own; later bytes go there.
                if head:
                    self._start_body(memoryview(buf)[pos:], total, head)
                else:
                    self._start_large(memoryview(buf)[pos:], total)
                buf.clear()
                self._pos = 0
            else:
                self._compact()
            return None
        raw = bytes(buf[pos : pos + total])
        self._pos = pos + total
        return self._parse(raw)

    def frames(self) -> list[Frame]:
        """Every complete frame buffered now (possibly none), in order.

        Same contract as :meth:`next_frame`; one call per receive instead of one per frame.
        If a later frame is malformed, the frames before it are still returned and the
        error is raised by the next call.
        """
        return self._scan(None)  # type: ignore[return-value]  # no stamp: Frames only

    def frames_and_runs(self, source: bytes) -> list[Frame | Run]:
        """Like :meth:`frames`, but consecutive plain MESSAGE frames to one target that
        carry exactly ``source`` in their source section come as one :class:`Run`.

        The broker passes its sender's stamp: a run can be forwarded as it is, without a
        :class:`Frame` per message. Every framing check of :meth:`frames` is still made
        per frame; a frame with descriptors, blobs, another source or another target
        ends the run.
        """
        return self._scan(source)

    def _scan(self, source: bytes | None) -> list[Frame | Run]:
        out: list[Frame | Run] = []
        if self._error is not None:
            self._raise()
        nbytes = 0
        if self._large is not None:
            f = self.next_frame()
            if f is None:
                self.seen = self.returned_bytes = 0
                return out
            out.append(f)
            nbytes = f.wire_size
        seen = ((1 << out[0].type) | (SEEN_FDS if out[0].n_fds else 0)) if out else 0
        pos, seen, bad_target = _scan_loop(
            self._buf, self._pos, self.max_frame_size - 4, source, out, seen
        )
        nbytes += pos - self._pos
        self._pos = pos
        if bad_target:
            self.seen, self.returned_bytes = _SEEN_ALL, nbytes
            self._error = RemoteProtocolError("frame target is not UTF-8")
            if out:
                return out  # raised by the next call
            self._raise()
        append = out.append
        # The careful path handles the rest: partial, large, with blobs, or malformed.
        try:
            while True:
                f = self.next_frame()
                if f is None:
                    break
                append(f)
                seen |= (1 << f.type) | (SEEN_FDS if f.n_fds else 0)
                nbytes += f.wire_size
        except RemoteProtocolError:
            self.seen, self.returned_bytes = seen | _SEEN_ALL, nbytes
            if out:
                return out  # the error is kept in self._error and raised next call
            raise
        self.seen, self.returned_bytes = seen, nbytes
        return out

    def _compact(self) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0

    def _fail(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL_ERROR) -> NoReturn:
        self._error = RemoteProtocolError(message, code)
        self._raise()

    def _raise(self) -> NoReturn:
        err = self._error
        assert err is not None
        raise RemoteProtocolError(str(err), err.code) from None

    def release(self) -> None:
        """Drop every buffered byte now (the connection is closed). Later calls raise."""
        self._buf = bytearray()
        self._pos = 0
        self._large = None
        self._large_fill = self._large_total = 0
        self._large_lent = False
        self._splicing = 0
        self._spliced = None  # (its owner, the broker's reader, closes it)
        if self._error is None:
            self._error = RemoteProtocolError("the connection is closed")

    def _parse(
        self, raw: bytes | bytearray, large_body: bytes = b"", spliced: SplicedRest | None = None
    ) -> Frame:
        (length, ftype, flags, tlen, slen, nblobs, nfds, reserved, rid, hlen, blen) = (
            PREFIX.unpack_from(raw, 0)
        )
        if ftype not in _VALID_TYPES:
            self._fail(f"unknown frame type {ftype}")
        if reserved:
            self._fail("reserved prefix field is not zero")
        fixed = _FIXED_AFTER_LENGTH + tlen + slen + hlen + blen + 4 * nblobs
        if nblobs:
            if fixed > length:
                self._fail("frame sections exceed the frame length")
            table = PREFIX_SIZE + tlen + slen + hlen + blen
            blob_total = sum(struct.unpack_from(f">{nblobs}I", raw, table))
            fixed += blob_total
        if fixed != length:
            self._fail(f"frame sections add up to {fixed + 4} bytes, length says {length + 4}")
        tend = PREFIX_SIZE + tlen
        try:
            target = raw[PREFIX_SIZE:tend].decode()
        except UnicodeDecodeError:
            self._fail("frame target is not UTF-8")
        return Frame(
            ftype,
            flags,
            rid,
            target,
            bytes(raw[tend : tend + slen]),
            nblobs,
            nfds,
            hlen,
            blen,
            raw,
            tend + slen,
            (),
            large_body,
            spliced,
        )


# -- the optional compiled fast paths ---------------------------------------------------
# _speedups.c (built when a C compiler was there at install time) does what
# _scan_loop_py, Frame.body and _encode_small_bytes_py do, for the common case only,
# and hands everything else (every error included) to them: this Python code is the
# reference, and the package works the same without the extension.
_scan_loop: Callable[
    [bytearray, int, int, bytes | None, list[Frame | Run], int], tuple[int, int, bool]
] = _scan_loop_py
_body_py = Frame.body
#: The bitmask of valid frame types for the compiled scan (bit ``t`` for type ``t``).
_VALID_MASK = sum(1 << t for t in _VALID_TYPES)
#: The compiled interface this module expects (``_speedups.API``): an extension of
#: another version, such as a stale in-place build, is not used.
_SPEEDUPS_API = 6
#: True when the compiled fast paths are in use; False with ``MSGQ_TRIO_PURE_PYTHON=1``
#: in the environment (any value but "" and "0"), or when the extension was not built.
SPEEDUPS = False


async def _ready_py(value: _T) -> _T:
    return value


#: ``ready(value)``: an awaitable already done, ``await ready(v)`` being ``v``, for an
#: ``__anext__`` written as a plain function that often has its value at once. With the
#: compiled fast paths a small C object (a coroutine per call cost about as much as the
#: rest of a message's iteration); otherwise this coroutine, the reference.
ready: Callable[[_T], Awaitable[_T]] = _ready_py


def _use_speedups() -> bool:
    global _scan_loop, encode_small_bytes, ready, _new_body
    if os.environ.get("MSGQ_TRIO_PURE_PYTHON", "") not in {"", "0"}:
        return False
    try:
        from . import _speedups
    except ImportError:
        return False
    if getattr(_speedups, "API", None) != _SPEEDUPS_API or max(_VALID_TYPES) >= 64:
        return False
    _speedups.init(Frame, Run, _VALID_MASK, _MESSAGE, _body_py, _encode_small_bytes_py)
    _scan_loop = _speedups.scan
    encode_small_bytes = _speedups.encode_small_bytes
    ready = _speedups.ready
    _new_body = _speedups.new_bytes
    # A method descriptor of Frame, so frame.body() calls C without a Python frame.
    setattr(Frame, "body", _speedups.frame_body_method(Frame))  # noqa: B010
    return True


SPEEDUPS = _use_speedups()


def slot_maker(
    cls: Callable[..., _T], arg_slots: tuple[str, ...], fixed_slots: dict[str, object]
) -> Callable[..., _T]:
    """A faster ``cls``: with the compiled fast paths, a constructor that sets the slots
    ``arg_slots`` from its positional arguments and ``fixed_slots`` to their values,
    without running ``cls.__init__``; otherwise ``cls`` itself.

    ``cls`` is the reference: a plain class with ``__slots__`` whose ``__init__`` takes
    those arguments in that order and does exactly that (its tests compare the two).

    Raises:
        TypeError: ``cls`` is not such a class, or a name is not one of its slots.
    """
    if not SPEEDUPS:
        return cls
    from . import _speedups

    return _speedups.slot_maker(cls, arg_slots, fixed_slots)


def body_getter(
    cls: type[_T],
    frame_slot: str,
    decoded_slot: str,
    body_slot: str,
    fallback: Callable[[_T], object],
) -> Callable[[_T], object]:
    """A faster ``fallback``, a property getter of ``cls`` that caches a body decoded
    from a :class:`Frame`: with the compiled fast paths, a C getter that returns
    ``body_slot`` once ``decoded_slot`` is True, and otherwise stores
    ``Frame.body()`` of ``frame_slot`` there and sets ``decoded_slot``; anything else,
    and every error, is ``fallback``'s (so the errors are the reference's). Without the
    compiled fast paths, ``fallback`` itself.

    ``fallback`` is the reference: it must do exactly that (its tests compare the two).

    Raises:
        TypeError: ``cls`` is not a plain class with ``__slots__``, or a name is not one
            of its slots.
    """
    if not SPEEDUPS:
        return fallback
    from . import _speedups

    getter: Callable[[_T], object] = _speedups.body_getter(
        cls, frame_slot, decoded_slot, body_slot, fallback
    )
    return getter
