"""Protocol-level exceptions: whose fault was it (ours or the peer's) and what code to send."""

from __future__ import annotations

from .codes import ErrorCode


class ProtocolError(Exception):
    """Base of the codec's errors. Any other exception from the codec is a bug.

    Attributes:
        code: the :class:`ErrorCode` to put in the final ERROR frame sent to the peer.
    """

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


class LocalProtocolError(ProtocolError):
    """Our caller misused the codec (sent a frame the state machine forbids, etc.)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that violate the protocol; the connection must be closed."""
