"""Forwarding a frame under its true sender: the broker's stamp (docs/PROTOCOL.md).

Only the prefix and the source section are rebuilt; the target and the tail (header
onwards) are shared with the received frame.
"""

from __future__ import annotations

from .frame import Frame
from .layout import _FIXED_AFTER_LENGTH, _LARGE_FRAME, PREFIX, PREFIX_SIZE


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
