"""The frame types and flags the client's sans-I/O modules compare, as plain ints: each
is compared once or more per received frame, and an IntEnum compares slower."""

from __future__ import annotations

from ..protocol.codes import Flag, FrameType

__all__ = ["ERROR", "FLAG_ALL", "GOODBYE", "MESSAGE", "NOTIFY", "REPLY", "REQUEST", "ROUTED"]

MESSAGE = int(FrameType.MESSAGE)
REQUEST = int(FrameType.REQUEST)
REPLY = int(FrameType.REPLY)
ERROR = int(FrameType.ERROR)
NOTIFY = int(FrameType.NOTIFY)
ROUTED = int(FrameType.ROUTED)
GOODBYE = int(FrameType.GOODBYE)
FLAG_ALL = int(Flag.ALL)
