"""A bounded FIFO from a bus's reader to the tasks that take from it, on any driver.

The plugin clients (client/queue.py) hand what the reader receives (a callback, which
must not block) to a consumer's iteration. :class:`Mailbox` is that hand-over, written
once for the trio and the asyncio drivers: it waits on the driver's events
(:meth:`~msgq_trio.client.loop.LoopServices.new_event`) and imports no event loop
(``tests/test_layering.py``).

Rules:

1. ``put`` never waits: the producer is a reader callback. Over ``capacity`` it raises
   (the caller checks :attr:`room` first: a peer that exceeds its window is refused as a
   whole, never half-taken).
2. After ``close()`` nothing more goes in; what is in still comes out, then ``get``
   returns None (the end), as a memory channel's ``EndOfChannel``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..errors import UsageError

__all__ = ["Mailbox"]

T = TypeVar("T")


class Mailbox(Generic[T]):
    """Up to ``capacity`` items (never None) between synchronous producers and the
    tasks that ``await get()``. ``new_event`` makes the driver's event (``set()``,
    ``await wait()``)."""

    __slots__ = ("_closed", "_items", "_new_event", "_waiters", "capacity")

    def __init__(self, capacity: int, new_event: Callable[[], Any]) -> None:
        if capacity < 1:
            raise UsageError("a mailbox holds at least one item")
        self.capacity = capacity
        self._items: deque[T] = deque()
        self._new_event = new_event
        self._waiters: list[Any] = []
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    @property
    def room(self) -> int:
        """How many more items ``put`` takes now (0 once closed)."""
        return 0 if self._closed else self.capacity - len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, item: T) -> None:
        """Add ``item`` and wake the takers.

        Raises:
            UsageError: the mailbox is full or closed (the caller's bug: see ``room``).
        """
        if self._closed:
            raise UsageError("put into a closed mailbox")
        if len(self._items) >= self.capacity:
            raise UsageError(f"put into a full mailbox ({self.capacity} items)")
        self._items.append(item)
        self._wake()

    def put_many(self, items: list[T]) -> None:
        """Add ``items`` in order and wake the takers once; all or none.

        Raises:
            UsageError: they do not fit, or the mailbox is closed (see ``room``).
        """
        if self._closed:
            raise UsageError("put into a closed mailbox")
        if len(self._items) + len(items) > self.capacity:
            raise UsageError(f"{len(items)} items do not fit a mailbox of {self.capacity}")
        self._items.extend(items)
        self._wake()

    def close(self) -> None:
        """No more items: the takers get what is in, then the end. Idempotent."""
        self._closed = True
        self._wake()

    def get_nowait(self) -> T | None:
        """The oldest item, or None if there is none now (see :attr:`ended`)."""
        return self._items.popleft() if self._items else None

    @property
    def ended(self) -> bool:
        """Closed and empty: ``get`` returns None from now on."""
        return self._closed and not self._items

    async def get(self) -> T | None:
        """The oldest item, waiting for one; None once closed and empty. Cancel-safe:
        a cancelled ``get`` took nothing."""
        items = self._items
        while not items:
            if self._closed:
                return None
            event = self._new_event()
            self._waiters.append(event)
            try:
                await event.wait()
            finally:
                if event in self._waiters:  # cancelled before anything was put
                    self._waiters.remove(event)
        return items.popleft()

    def drain(self) -> list[T]:
        """Take every item now (the mailbox stays open or closed as it was)."""
        out = list(self._items)
        self._items.clear()
        return out

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()
