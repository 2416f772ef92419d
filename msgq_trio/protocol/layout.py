"""The frame layout on the wire: the fixed prefix and the limits on a frame's size.

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
"""

from __future__ import annotations

import struct

from .codes import FrameType

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
_VALID_TYPES = frozenset(int(t) for t in FrameType)
_MESSAGE = int(FrameType.MESSAGE)
_U16 = 0xFFFF
