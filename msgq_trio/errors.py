"""Exceptions of the public API, mapped one-to-one onto the wire error codes.

Whose fault is it?

* :class:`UsageError` - the caller misused the API (local; fix the calling code).
* :class:`ConnectError` / :class:`ConnectionLost` - the broker is unreachable or went away.
* :class:`RpcError` and subclasses - a call failed; ``code`` is the stable wire code from
  :class:`msgq_trio.protocol.codes.ErrorCode`, ``message`` is for humans, ``data`` is any
  CBOR value, ``sender`` is the lname the failure is about (the callee, or ``l.0`` for the
  broker).
"""

from __future__ import annotations

from .protocol.codes import ErrorCode


class MsgqError(Exception):
    """Base class of every msgq_trio exception."""


class UsageError(MsgqError):
    """Local misuse: a bad argument, a closed bus, a value CBOR cannot encode."""


class ConnectError(MsgqError):
    """Could not connect to the broker (no broker, refused handshake, version mismatch)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class MalformedMessage(MsgqError, ValueError):
    """A received message's header or body is not well-formed CBOR.

    The broker routes on the prefix and target only and never decodes bodies (that would
    cost every message a decode), so a sender's encoding bug reaches its receivers. It is
    raised when the body is read, names the sender (``sender``: its lname and client name),
    and affects nothing else: the connection and the other messages are fine.
    """

    def __init__(self, message: str, sender: str) -> None:
        super().__init__(message)
        self.sender = sender


class ConnectionLost(MsgqError):
    """The connection to the broker ended (broker shut down, crashed, or dropped us)."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class RpcError(MsgqError):
    """A call did not produce a result."""

    code: str = "rpc-error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        data: object = None,
        sender: str | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        self.data = data
        self.sender = sender

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class NoRecipient(RpcError):
    """Nobody is at the target (unknown lname, empty group, ``Group[N]`` out of range)."""

    code = ErrorCode.NO_RECIPIENT.value


class RecipientGone(RpcError):
    """The recipient disconnected or crashed before answering (reported at once)."""

    code = ErrorCode.RECIPIENT_GONE.value


class RequestTimeout(RpcError):
    """No answer before the deadline (the broker's, or the one passed to ``call``)."""

    code = ErrorCode.TIMEOUT.value


class ReceiverFull(RpcError):
    """The recipient's queue in the broker is over its bound; the request was not delivered."""

    code = ErrorCode.RECEIVER_FULL.value


class MultipleRecipients(RpcError):
    """A single-answer call to a group of several members; use ``G[N]``, ``G[?]`` or call_all."""

    code = ErrorCode.MULTIPLE_RECIPIENTS.value


class LimitExceeded(RpcError):
    """A broker limit (pending requests, subscriptions...) refused the request."""

    code = ErrorCode.LIMIT_EXCEEDED.value


class QueueFull(RpcError):
    """The queue plugin's store is full (``max_store_size`` reached): the message was not
    stored and will not be delivered. Retry once consumers have drained the queue."""

    code = ErrorCode.QUEUE_FULL.value


class PipeBroken(RpcError):
    """The other end of a pipe is gone for good: a write after every reader left (writer
    opened with ``on_reader_gone="fail"``), or the pipe service lost the handle (it
    restarted). Close the pipe; nothing more can be written or read through it."""

    code = ErrorCode.PIPE_BROKEN.value


class PipeMismatch(RpcError):
    """An open asked for a persistent pipe where the pipe exists (or is configured) as a
    plain one, or the reverse: the first open, or the plugin's configuration, decides.
    Open it without ``persistent`` to take it as it is, or use another name."""

    code = ErrorCode.PIPE_MISMATCH.value


class PipeTimeout(TimeoutError):
    """A pipe read or write did not complete within its timeout. Not an error of the
    pipe (which stays usable) and not end of pipe (a read returns b"" for that).

    Attributes:
        written: for a write, how many bytes of it were accepted before the timeout
            (a prefix; the rest was not written); 0 for a read.
    """

    def __init__(self, message: str, written: int = 0) -> None:
        super().__init__(message)
        self.written = written


class RemoteError(RpcError):
    """The handler (or the broker's command) answered with an error.

    ``code`` is e.g. ``unknown-command``, ``bad-request``, ``internal-error`` or any code
    the handler chose; ``data`` carries structured details.
    """


class Forbidden(RemoteError):
    """The access policy does not let this client do that (docs/SECURITY.md), or another
    client holds a binding. A RemoteError, as ``forbidden`` answers were before."""

    code = ErrorCode.FORBIDDEN.value


class CommandFailed(RpcError):
    """Raise from a command handler to answer with a chosen error code and data."""

    def __init__(self, code: str, message: str, data: object = None) -> None:
        super().__init__(message, code=code, data=data)


_BY_CODE: dict[str, type[RpcError]] = {
    cls.code: cls
    for cls in (
        NoRecipient,
        RecipientGone,
        RequestTimeout,
        ReceiverFull,
        MultipleRecipients,
        LimitExceeded,
        QueueFull,
        PipeBroken,
        PipeMismatch,
        Forbidden,
    )
}


def rpc_error_from_wire(code: str, message: str, data: object, sender: str | None) -> RpcError:
    """The exception a caller sees for an ERROR answer with ``code``."""
    cls = _BY_CODE.get(code, RemoteError)
    return cls(message, code=code, data=data, sender=sender)
