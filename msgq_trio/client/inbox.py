"""The inbox every driver keeps: received messages the application has not taken
yet, and the one bound on them (:class:`Inbox`). Sans-I/O: no trio, asyncio, socket or
thread (``tests/test_layering.py``); what a driver does at the bound is its own (the
asynchronous drivers read no more, the blocking one raises ``LimitExceeded``).
"""

from __future__ import annotations

import collections
from typing import Generic, TypeVar

__all__ = ["Inbox"]

T = TypeVar("T")


class Inbox(Generic[T]):
    """Received messages not yet taken (:attr:`items`, oldest first), bounded by
    ``max_bytes`` bytes of their frames and, when ``max_count`` is set, ``max_count``
    messages while none of the client's calls waits for its answer (:meth:`full`).

    The bound: past it the driver stops reading (backpressure travels to the broker,
    which pauses the senders) or, having no reader to stop, refuses to read further
    until messages are taken: never silent loss. The count does not apply while a call
    is pending, because its answer may be behind the messages, and a caller that takes
    its messages after the answer would wait for ever.

    The bytes are counted by batch: the driver appends a receive's messages to
    :attr:`items` itself and accounts for them with one :meth:`put`, and their bytes
    leave when the last of them is taken (:meth:`held`). Taking a message is then only
    the ``popleft`` of :attr:`items` (how many were taken is what was put minus what is
    left) instead of two lengths per message; the bound is over by at most one batch (a
    receive's worth, or one large frame), and exact when the inbox is empty or each
    batch is one message.
    """

    __slots__ = ("_bytes", "_marks", "added", "items", "max_bytes", "max_count")

    def __init__(self, max_bytes: int, max_count: int | None = None) -> None:
        #: The messages (or frames to be made messages when taken), oldest first.
        self.items: collections.deque[T] = collections.deque()
        self.max_bytes = max_bytes
        self.max_count = max_count
        self._bytes = 0
        #: (``added`` after a batch, its bytes), oldest first.
        self._marks: collections.deque[tuple[int, int]] = collections.deque()
        #: Entries ever put (a driver compares it to see whether a receive added any).
        self.added = 0

    def put(self, entries: int, nbytes: int) -> None:
        """``entries`` were just appended to :attr:`items`, ``nbytes`` in all: one batch."""
        count = self.added + entries
        self.added = count
        self._bytes += nbytes
        self._marks.append((count, nbytes))

    def held(self) -> int:
        """The bytes counted against ``max_bytes``: every batch not yet taken to its
        last message (so at most one batch more than exact; 0 when empty)."""
        marks = self._marks
        taken = self.added - len(self.items)
        while marks and marks[0][0] <= taken:
            self._bytes -= marks.popleft()[1]
        return self._bytes

    def over(self) -> bool:
        """Over the byte bound."""
        return self.held() > self.max_bytes

    def full(self, calls_pending: bool) -> bool:
        """Over the bound: the byte bound, or the count bound unless ``calls_pending``
        (see the class's docstring)."""
        if self.held() > self.max_bytes:
            return True
        count = self.max_count
        return count is not None and len(self.items) > count and not calls_pending

    def clear(self) -> list[T]:
        """Empty the inbox; returns what nobody took (for the driver to close)."""
        left = list(self.items)
        self.items.clear()
        self._marks.clear()
        self._bytes = 0
        return left
