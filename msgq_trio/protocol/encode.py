"""Encoding frames: from already-encoded sections (:func:`encode_frame`,
:func:`encode_simple`) and the common one-way message with a byte-string body
(:func:`encode_bytes_message`, :func:`_encode_small_bytes_py`, which framing.py
exports as ``encode_small_bytes``, compiled where the extension is built).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from .errors import LocalProtocolError
from .layout import _FIXED_AFTER_LENGTH, _LARGE_FRAME, _U16, ABSOLUTE_MAX_FRAME_SIZE, PREFIX


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
