"""msgq_trio: a message bus for systems built from many cooperating processes.

General layout (each layer imports only the ones above it):

* ``msgq_trio.protocol`` - sans-I/O wire codec: bytes in, frames out (no trio).
* ``msgq_trio.core`` - routing, RPC tracking, the broker's logic (no trio, time passed in).
* ``msgq_trio.transport`` - socket receive/send, fd passing and the one OSError
  translation, shared by the broker daemon and the clients.
* ``msgq_trio.io`` - the thin trio layer of the broker daemon (imports no client).
* ``msgq_trio.client`` - one sans-I/O client session under three drivers: the trio
  client (``connect``), the direct blocking client (``connect_direct``; the synchronous
  client ``msgq_trio.sync`` on top) and the asyncio client (``msgq_trio.aio.connect``:
  import ``msgq_trio.aio``).
* ``msgq_trio.plugins`` / ``msgq_trio.storage`` - the plugins (durable queues, named pipes)
  and the queue's storage backends.
* ``msgq_trio.ops`` / ``msgq_trio.scenario`` / ``msgq_trio.analytics`` - operations, the
  fault runner, the Spark analytics. The peer benchmark is not part of the package: it
  lives in the repository's ``benchmarks/``.
"""

from ._version import __version__
from .client.bus import Bus, Member, Message, Reply, Result, connect
from .client.direct import DirectBus
from .client.direct import connect as connect_direct
from .client.reconnect import Reconnect
from .errors import (
    CommandFailed,
    ConnectError,
    ConnectionLost,
    Forbidden,
    LimitExceeded,
    MalformedMessage,
    MsgqError,
    MultipleRecipients,
    NoRecipient,
    PipeBroken,
    PipeMismatch,
    PipeTimeout,
    QueueFull,
    ReceiverFull,
    RecipientGone,
    RemoteError,
    RequestTimeout,
    RpcError,
    UsageError,
)

__all__ = [
    "Bus",
    "CommandFailed",
    "ConnectError",
    "ConnectionLost",
    "DirectBus",
    "Forbidden",
    "LimitExceeded",
    "MalformedMessage",
    "Member",
    "Message",
    "MsgqError",
    "MultipleRecipients",
    "NoRecipient",
    "PipeBroken",
    "PipeMismatch",
    "PipeTimeout",
    "QueueFull",
    "ReceiverFull",
    "RecipientGone",
    "Reconnect",
    "RemoteError",
    "Reply",
    "RequestTimeout",
    "Result",
    "RpcError",
    "UsageError",
    "__version__",
    "connect",
    "connect_direct",
]
