"""The asyncio client's public face: ``async with msgq_trio.aio.connect(path, name) as bus``.

:func:`connect` yields an :class:`AioBus`, the asyncio driver of the client session
(``msgq_trio/client/aio.py``), with the trio ``Bus``'s API for what it has: send, notify,
call, request, call_all, call_many and the callback variants, subscriptions, command
handlers (plain or ``async def``, inline ones, a default one), notification and message
callbacks, iteration and ``receive(timeout=)``, attachments, descriptors on Unix
sockets, and ``tcp://``/``tls://`` addresses. It has no queue or pipe client yet. Messages,
results and errors are the package's own types (:class:`msgq_trio.Message`,
:mod:`msgq_trio.errors`).
"""

from .client.aio import OUT_HIGH_WATER, AioBus, connect
from .client.message import Member, Message, Reply, Result
from .client.reconnect import Reconnect

__all__ = [
    "OUT_HIGH_WATER",
    "AioBus",
    "Member",
    "Message",
    "Reconnect",
    "Reply",
    "Result",
    "connect",
]
