"""The asyncio client's public face: ``async with msgq_trio.aio.connect(path, name) as bus``.

:func:`connect` yields an :class:`AioBus`, the asyncio driver of the client session
(``msgq_trio/client/aio.py``), with the trio ``Bus``'s API: send, notify, call, request,
call_all, call_many and the callback variants, subscriptions, command handlers (plain or
``async def``, inline ones, a default one), notification and message callbacks,
iteration and ``receive(timeout=)``, attachments, descriptors on Unix sockets,
``tcp://``/``tls://`` addresses, the plugin-driver methods (``start_call``,
``start_request``, ``wait_call``...), durable queues (``bus.queue(name)``: the same
:class:`~msgq_trio.client.queue.Queue` as the trio client's) and named pipes
(``bus.pipe(name)``: :class:`AioPipe`). Messages, results and errors are the package's
own types (:class:`msgq_trio.Message`, :mod:`msgq_trio.errors`).
"""

from .client.aio import OUT_HIGH_WATER, AioBus, connect
from .client.aio_pipe import AioPipe, AioPipeReader, AioPipeWriter
from .client.message import Member, Message, Reply, Result
from .client.queue import Consumer, Queue, QueueMessage
from .client.reconnect import Reconnect

__all__ = [
    "OUT_HIGH_WATER",
    "AioBus",
    "AioPipe",
    "AioPipeReader",
    "AioPipeWriter",
    "Consumer",
    "Member",
    "Message",
    "Queue",
    "QueueMessage",
    "Reconnect",
    "Reply",
    "Result",
    "connect",
]
