"""Parsing a byte stream into frames (:class:`FrameParser`), and the one place that
chooses between the pure-Python code and the optional compiled fast paths
(``_speedups.c``, :data:`SPEEDUPS`).

The frame code is in modules with one job each, all re-exported here, where the rest of
the package imports them from: the wire layout (layout.py), the frame and run types and
their decoding (frame.py), the encoders (encode.py) and the broker's stamping
(stamping.py). The hooks the compiled build replaces live here (``_scan_loop``,
``_new_body``, ``encode_small_bytes``, ``ready``, ``Frame.body``).
This module is sans-I/O: bytes in, frames out.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

from .codes import ErrorCode, Flag, FrameType
from .encode import (
    _encode_small_bytes_py,
    cbor_bytes_head,
    encode_bytes_message,
    encode_frame,
    encode_simple,
)
from .errors import LocalProtocolError, RemoteProtocolError
from .frame import (
    FdBuffer,
    Frame,
    Run,
    SplicedRest,
    close_fds,
    decode_cbor,
    encode_cbor,
)
from .layout import (
    _FIXED_AFTER_LENGTH,
    _LARGE_FRAME,
    _MESSAGE,
    _VALID_TYPES,
    ABSOLUTE_MAX_FRAME_SIZE,
    DEFAULT_MAX_FRAME_SIZE,
    PREFIX,
    PREFIX_SIZE,
)
from .stamping import restamp, stamped

__all__ = [
    "ABSOLUTE_MAX_FRAME_SIZE",
    "DEFAULT_MAX_FRAME_SIZE",
    "PREFIX",
    "PREFIX_SIZE",
    "SEEN_FDS",
    "SPEEDUPS",
    "FdBuffer",
    "Frame",
    "FrameParser",
    "Run",
    "SplicedRest",
    "body_getter",
    "cbor_bytes_head",
    "close_fds",
    "decode_cbor",
    "encode_bytes_message",
    "encode_cbor",
    "encode_frame",
    "encode_simple",
    "encode_small_bytes",
    "ready",
    "restamp",
    "slot_maker",
    "stamped",
]

_T = TypeVar("_T")


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


def _reuse_body_py(spares: list[bytes], n: int) -> tuple[bytes, memoryview] | None:
    """What :func:`_new_body` returns, made of a body of ``spares`` that only that list
    still holds and that has ``n`` bytes; None if there is none. The reference never
    finds one: Python cannot write into a ``bytes``, and the pure build hands out a copy
    of its bytearray, which :class:`FrameParser` does not keep. The compiled
    ``reuse_bytes`` does it (see ``_speedups.c``)."""
    return None


#: :func:`_reuse_body_py`, or the compiled ``reuse_bytes`` (see :data:`SPEEDUPS`).
_reuse_body: Callable[[list[bytes], int], tuple[bytes, memoryview] | None] = _reuse_body_py
#: How many large bodies a client's parser (``own_bodies``) keeps after handing them
#: out, to receive later bodies of the same size into once the application has dropped
#: them: a body received into a new ``bytes`` is in fresh pages, faulted in one by one,
#: until the C library's allocator has adapted its thresholds and whenever it trims its
#: heap (docs/bench/scale.md), a body received into a spare is in pages the process has.
#: 4: a burst of up to four large messages waiting in the inbox at once still finds a
#: spare for each (tests/client/test_large_body_faults.py); a spare costs its size in
#: resident memory while it waits. Read at each large body; 0 keeps none.
SPARE_BODIES = 4
SEEN_FDS = 1 << 32
#: A traced frame (docs/PROTOCOL.md, "Trace context") never joins a run.
_TRACED = int(Flag.TRACED)
_SEEN_ALL = (1 << 33) - 1  # after an error: make no claim about the frames returned


#: The frame types whose large bodies the broker may splice: one-way, routed on the head.
_SPLICE_TYPES = frozenset({FrameType.MESSAGE, FrameType.NOTIFY})


#: :func:`_encode_small_bytes_py`, or the compiled copy of it (see :data:`SPEEDUPS`).
encode_small_bytes: Callable[[int, bytes, bytes, bytes], bytes] = _encode_small_bytes_py


def _scan_loop_py(
    buf: bytearray, pos: int, limit: int, source: bytes | None, out: list[Frame | Run], seen: int
) -> tuple[int, int, bool]:
    """The fast loop of :meth:`FrameParser._scan`: complete, plain frames from ``pos`` on.

    Appends a :class:`Frame` per frame (or a :class:`Run` per run of MESSAGE frames
    without the TRACED flag that carry exactly ``source``; None: no runs) to ``out`` and stops
    before the first frame that is incomplete, larger than ``limit`` (the maximum frame
    size - 4), has blobs or fails a check: the careful path
    (:meth:`FrameParser.next_frame`) takes over there and raises the error. Returns the
    new position, ``seen`` with the appended frames' bits, and whether it stopped on a
    target that is not UTF-8 (the position is then that frame's start if it would have
    begun a run, else its end).

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
                and not flags & _TRACED  # a traced message is a hop of its own (core/traces.py)
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
        "_spares",
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
        # With own_bodies, the large bodies handed out last, at most SPARE_BODIES of them,
        # oldest first: _start_body receives into one that no one else holds any longer.
        self._spares: list[bytes] = []
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
        n = total - head
        spares = self._spares
        reused = _reuse_body(spares, n) if spares else None
        if reused is not None:
            self._body, self._body_view = reused
        else:
            body, self._body_view = _new_body(n)
            self._body = body
            if type(body) is bytes and SPARE_BODIES > 0:
                spares.append(body)
                if len(spares) > SPARE_BODIES:
                    del spares[: len(spares) - SPARE_BODIES]
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
        self._spares = []
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
_SPEEDUPS_API = 8  # 8: reuse_bytes
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
    global _scan_loop, encode_small_bytes, ready, _new_body, _reuse_body
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
    _reuse_body = _speedups.reuse_bytes
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
