"""The stable wire registry: frame types, flags and error codes that cross the wire.

Numbers and strings in this file are part of the protocol (docs/PROTOCOL.md). Never
renumber or rename an entry; add new ones at the end.
"""

from __future__ import annotations

import enum

#: Bumped only for incompatible changes; the broker refuses a HELLO with another version.
PROTOCOL_VERSION = 1


class FrameType(enum.IntEnum):
    """The kind of a frame (byte 4 of every frame)."""

    HELLO = 1  # client -> broker: first frame, {"version", "name"}
    WELCOME = 2  # broker -> client: answer to HELLO, {"lname", "version", "broker", "limits"}
    MESSAGE = 3  # one-way message to a target; never answered
    REQUEST = 4  # wants an answer (REPLY or ERROR with the same request id)
    REPLY = 5  # successful answer to a REQUEST
    ERROR = 6  # failed answer to a REQUEST, or (request id 0) a connection-level error
    NOTIFY = 7  # notification to a group; distinct from commands, never answered
    ROUTED = 8  # broker -> caller: who received a FLAG_ALL request (how many answers to expect)
    GOODBYE = 9  # either side: orderly close follows, {"reason"}


class Flag(enum.IntFlag):
    """Bits of byte 5 of every frame."""

    NONE = 0
    #: REQUEST to a group: every member answers (the caller gets one answer per member).
    ALL = 1
    #: The header carries a W3C ``traceparent`` (docs/PROTOCOL.md, "Trace context"): the
    #: broker records the frame's hop without decoding the header of an untraced one.
    TRACED = 2


class ErrorCode(enum.StrEnum):
    """Error codes carried in ERROR frames (header key ``code``).

    One registry for the whole project: the client maps each code to an exception class
    in :mod:`msgq_trio.errors`, docs/PROTOCOL.md lists them, and codes never change meaning.
    """

    # -- answered by the broker on behalf of a recipient --------------------------------
    NO_RECIPIENT = (
        "no-recipient"  # target resolves to nobody (unknown lname, empty group, [N] out of range)
    )
    RECIPIENT_GONE = "recipient-gone"  # recipient disconnected/crashed/was dropped before answering
    TIMEOUT = "timeout"  # broker-side deadline for the answer passed
    RECEIVER_FULL = "receiver-full"  # recipient's outgoing queue is over its bound
    MULTIPLE_RECIPIENTS = (
        "multiple-recipients"  # single-answer request to a group of several members
    )
    # -- answered by a handler (or the broker for its own commands) ---------------------
    UNKNOWN_COMMAND = "unknown-command"
    BAD_REQUEST = "bad-request"
    INTERNAL_ERROR = "internal-error"
    # -- connection level (request id 0), the connection closes afterwards ----------------
    PROTOCOL_ERROR = "protocol-error"
    VERSION_MISMATCH = "version-mismatch"
    FRAME_TOO_LARGE = "frame-too-large"
    LIMIT_EXCEEDED = "limit-exceeded"
    FORBIDDEN = "forbidden"
    BROKER_SHUTDOWN = "broker-shutdown"
    SLOW_CONSUMER = "slow-consumer"
    DROPPED = "dropped"  # an operator dropped this client (control command ``drop``)
    # -- answered by the queue plugin (docs/QUEUE.md) -------------------------------------
    #: The queue store's map is full and may not grow (``max_store_size``): the message was
    #: not stored; retry after consumers drained the queue.
    QUEUE_FULL = "queue-full"
    # -- answered by the pipe plugin (docs/PIPES.md) --------------------------------------
    #: A write to a pipe whose readers all left (writer opened with on_reader_gone="fail"),
    #: or any operation on a pipe handle the plugin no longer knows (closed, or the pipe
    #: service restarted): the pipe is broken, like EPIPE; close it.
    #: The queue plugin: a put with ``after`` whose producer's seq ``after`` has not
    #: arrived (an earlier pipelined put failed); nothing was accepted, resend from there.
    OUT_OF_ORDER = "out-of-order"
    PIPE_BROKEN = "pipe-broken"
    #: An open asked a pipe to be persistent (or not) but it exists, or is configured,
    #: the other way: the first open (or the configuration) decides (docs/PIPES.md).
    PIPE_MISMATCH = "pipe-mismatch"
    # -- TCP clients (docs/SECURITY.md) ----------------------------------------------------
    #: A TCP client sent no valid token and no trusted client certificate (connection level).
    UNAUTHENTICATED = "unauthenticated"
    #: A TCP peer sent nothing for ``tcp.heartbeat_misses`` heartbeat intervals (it is
    #: dropped; its pending calls fail recipient-gone), or the client saw the broker fall
    #: silent for as long (then raised locally as ConnectionLost with this code).
    HEARTBEAT_TIMEOUT = "heartbeat-timeout"
