"""What the queue client (client/queue.py, client/queue_consumer.py,
client/queue_message.py) needs from a bus: :class:`QueueBus`, the part of
:class:`~msgq_trio.client.async_bus.AsyncBus`'s public API it uses, as a Protocol. The
queue modules name this instead of ``AsyncBus``, so they import no driver and
``async_bus.py`` can import them (``Bus.queue()``) without an import cycle
(``tests/test_layering.py``). Every asynchronous driver's bus satisfies it; mypy checks
that where ``AsyncBus.queue`` hands itself to :class:`~msgq_trio.client.queue.Queue`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

from ..errors import ConnectionLost
from .message import Buffer, Message

__all__ = ["QueueBus"]


class QueueBus(Protocol):
    """The bus API the queue client uses; see :class:`~msgq_trio.client.async_bus.AsyncBus`
    for each method's contract."""

    @property
    def lname(self) -> str: ...

    @property
    def send(self) -> Callable[..., Awaitable[None]]: ...

    async def call(
        self,
        target: str,
        command: str,
        params: Any = None,
        *,
        timeout: float | None = None,
        attachments: Sequence[Buffer] = (),
        fds: Sequence[int] = (),
    ) -> Any: ...

    def start_call(
        self,
        target: str,
        command: str,
        params: Any = None,
        *,
        timeout: float | None = None,
        attachments: Sequence[Buffer] = (),
        on_behalf_of: tuple[str, str] | None = None,
    ) -> Callable[[], Awaitable[Any]]: ...

    async def subscribe(self, group: str) -> bool: ...

    def answer(
        self, request: Message, result: Any = None, *, attachments: Sequence[Buffer] = ()
    ) -> None: ...

    def answer_error(
        self, request: Message, code: str, message: str, data: object = None
    ) -> None: ...

    def add_inline_command(self, name: str, fn: Callable[[Message], None]) -> None: ...

    def on_notification_inline(self, group: str, callback: Callable[[Message], None]) -> None: ...

    def on_reconnected(self, callback: Callable[[], Any]) -> None: ...

    async def wait_lost(self) -> ConnectionLost: ...

    # the loop services (client/loop.py)
    async def sleep(self, seconds: float) -> None: ...

    async def checkpoint(self) -> None: ...

    def new_event(self) -> Any: ...

    async def shielded(
        self, fn: Callable[[], Coroutine[Any, Any, None]], timeout: float | None = None
    ) -> None: ...

    def start_soon(self, fn: Callable[[], Coroutine[Any, Any, None]]) -> None: ...


class QueueHandle(Protocol):
    """What a push consumer (client/queue_consumer.py) needs from its
    :class:`~msgq_trio.client.queue.Queue`: named so, the consumer does not import the
    module that creates it."""

    @property
    def _bus(self) -> QueueBus: ...

    @property
    def name(self) -> str: ...

    @property
    def group(self) -> str: ...

    async def _ensure_declared(self) -> None: ...


class Settler(Protocol):
    """What a delivered message (client/queue_message.py) needs from the push consumer
    it came from: its generation (a delivery from before a reattach is not settled
    there) and the settling of an ack or nack."""

    _acked_since_yield: int

    @property
    def _gen(self) -> int: ...

    def _settle(self, mid: int, ok: bool, gen: int) -> None: ...
