"""msgq_trio: a message bus for systems built from many cooperating processes.

General layout (each layer imports only the ones above it):

* ``msgq_trio.protocol`` - sans-I/O wire codec: bytes in, frames out (no trio).
* ``msgq_trio.core`` - routing, RPC tracking, the broker's logic (no trio, time passed in).
* ``msgq_trio.io`` - the thin trio layer of the broker daemon.
* ``msgq_trio.client`` - the trio client (``connect``) and the synchronous client.
* ``msgq_trio.plugins`` / ``msgq_trio.storage`` - queue plugin and its storage backends.
"""

__version__ = "0.1.0"

from .client.bus import Bus, Member, Message, Reply, Result, connect
from .errors import (
    CommandFailed,
    ConnectError,
    ConnectionLost,
    MalformedMessage,
    MsgqError,
    NoRecipient,
    RecipientGone,
    RemoteError,
    RequestTimeout,
    RpcError,
)

__all__ = [
    "Bus",
    "CommandFailed",
    "ConnectError",
    "ConnectionLost",
    "MalformedMessage",
    "Member",
    "Message",
    "MsgqError",
    "NoRecipient",
    "RecipientGone",
    "RemoteError",
    "Reply",
    "RequestTimeout",
    "Result",
    "RpcError",
    "__version__",
    "connect",
]
