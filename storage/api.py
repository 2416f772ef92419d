"""The contract of queue storage: the ``QueueStore`` protocol, its value types and its errors.

A ``QueueStore`` holds durable store-and-forward queues. It is deliberately small and
synchronous: the queue plugin drives it from a worker thread, so nothing here knows about
trio. Every backend (``MemoryQueueStore`` is the executable reference, ``LmdbQueueStore``
the durable one) must pass the same conformance suite in ``tests/storage/conformance.py``.

Vocabulary used by every docstring below:

* **seq** -- a per-queue sequence number assigned by the store. The first message of a
  queue gets 1; each stored message gets the next integer; a seq is never reused, not even
  after the message is deleted and the store is reopened. 0 is never assigned, so
  ``read_range(queue, 0, n)`` reads from the start.
* **producer_seq** -- a positive integer the producer puts on each message, increasing per
  (queue, producer). The store keeps the highest one stored (the *high-water mark*) and
  skips any later item at or below it, so a producer that resends after a crash does not
  create duplicates. Gaps are allowed; going backwards is treated as a resend.
* **durable when it returns** -- after a write method returns, its effect survives the
  process being killed, and, for a backend that syncs (``LmdbQueueStore(sync=True)``),
  the machine losing power. A write method that raises has written nothing.
* **cursor** -- one unsigned 64-bit integer per queue that the consumer stores together
  with its deletes (``delete_batch(..., cursor=)``), in the same transaction, and reads
  back after a restart (``cursor``). The store does not interpret it (the pipe plugin
  keeps the byte offset its readers consumed up to: docs/PIPES.md). 0 until first set.
* **since open** -- some statistics are counters of this store object only; they start at
  0 each time the store is opened.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from types import TracebackType
from typing import NamedTuple, Protocol, Self

import attrs

__all__ = [
    "MAX_NAME_BYTES",
    "NewMessage",
    "QueueStats",
    "QueueStore",
    "StorageClosed",
    "StorageCorrupt",
    "StorageError",
    "StorageFull",
    "StoredMessage",
    "UnknownQueue",
]

#: Longest queue or producer name, in UTF-8 bytes. LMDB keys are limited to 511 bytes and
#: names are parts of keys; every backend enforces the same limit so that code tested on
#: the memory backend does not fail on the durable one.
MAX_NAME_BYTES = 255


class StorageError(Exception):
    """Base of every error a ``QueueStore`` raises for a storage-level failure.

    Argument errors (a malformed name, a negative seq, a body that is not ``bytes``) are
    reported as ``ValueError``/``TypeError`` instead, before anything is written.
    """


class StorageFull(StorageError):
    """The store has no room for this write and may not grow further.

    Nothing of the failed call was written. Deleting messages frees room, so a later
    write may succeed.
    """


class StorageCorrupt(StorageError):
    """The stored data contradicts itself or cannot be decoded.

    Raised instead of guessing: the failed call wrote nothing, but the store should be
    taken out of service and inspected.
    """


class StorageClosed(StorageError):
    """The store was closed; only ``close()`` may still be called."""


class UnknownQueue(StorageError):
    """The queue was never declared with ``declare_queue``."""


class NewMessage(NamedTuple):
    """A message offered to ``append_batch``. A named tuple rather than an attrs class:
    the queue plugin makes one per message it commits, and a tuple is built and read in
    a fraction of the time (values are checked by ``append_batch``, not here).

    Attributes:
        queue: name of a declared queue.
        producer: name of the producer, used for deduplication (1..MAX_NAME_BYTES bytes
            of UTF-8).
        producer_seq: positive, increasing per (queue, producer); see the module docstring.
        body: the payload, stored and returned unchanged (may be empty).
    """

    queue: str
    producer: str
    producer_seq: int
    body: bytes


@attrs.frozen
class StoredMessage:
    """A message as stored, returned by ``read_range``.

    Attributes:
        seq: the seq the store assigned in ``queue``.
        queue: the queue it is stored in.
        producer, producer_seq, body: as given to ``append_batch``.
        delivery_count: how often ``increment_delivery`` was called for it (durable).
    """

    seq: int
    queue: str
    producer: str
    producer_seq: int
    body: bytes
    delivery_count: int


@attrs.frozen
class QueueStats:
    """A snapshot of one queue, returned by ``stats``.

    Durable (the same after reopening):
        depth: messages stored now.
        bytes: total length of their bodies.
        next_seq: the seq the next stored message will get.

    Since open (0 after opening):
        appended: messages stored, by ``append_batch`` or as the target of
            ``move_to_dead_letter``; so ``depth == depth_at_open + appended - deleted``.
        duplicates: ``append_batch`` items skipped as resends.
        deleted: messages removed, by ``delete_batch`` or moved to a dead-letter queue.
        unknown_deleted: seqs given to ``delete_batch`` that were not stored.
        batches: ``append_batch`` calls that stored at least one message here.
        fsyncs: durable commits by ``append_batch``, ``delete_batch``,
            ``increment_delivery`` or ``move_to_dead_letter`` that changed this queue.
            Group commit means one per call however many items it holds. A backend that does not
            sync (``LmdbQueueStore(sync=False)``) reports 0; ``MemoryQueueStore`` counts
            the commits a syncing backend would make, so the contract stays checkable.
    """

    depth: int
    bytes: int
    next_seq: int
    appended: int
    duplicates: int
    deleted: int
    unknown_deleted: int
    batches: int
    fsyncs: int


class QueueStore(Protocol):
    """Durable store-and-forward queues; see the module docstring for the vocabulary.

    Thread safety: every implementation serialises its calls with a lock, so it may be
    called from any thread, but calls never overlap; drive it from one worker thread.
    Each call runs in its own transaction and holds no transaction when it returns.

    Every method raises ``StorageClosed`` after ``close()`` and ``UnknownQueue`` when
    given a queue that was never declared. Any write method may raise ``StorageFull``,
    ``StorageCorrupt`` or another ``StorageError``; when it does, it wrote nothing.
    """

    def declare_queue(self, name: str) -> bool:
        """Create the queue ``name`` if it does not exist.

        Returns:
            True if it was created, False if it already existed.
        Raises:
            ValueError: ``name`` is empty, longer than ``MAX_NAME_BYTES`` in UTF-8, or
                not encodable as UTF-8.
        Durable when it returns. Queues are never removed.
        """
        ...

    def queues(self) -> list[str]:
        """Return the names of all declared queues, sorted by code point."""
        ...

    def append_batch(
        self, items: Sequence[NewMessage], marks: Mapping[tuple[str, str], int] | None = None
    ) -> list[int | None]:
        """Store ``items`` in one transaction with one durable commit (group commit).

        Items are taken in order. An item whose ``producer_seq`` is at or below the
        high-water mark of its (queue, producer) -- including one raised by an earlier
        item of the same batch -- is a duplicate and is skipped; every other item gets
        the next seq of its queue and raises the high-water mark to its ``producer_seq``.

        ``marks`` maps (queue, producer) to a producer_seq: after the items, in the same
        transaction, each such high-water mark is raised to it (never lowered). The queue
        plugin records so the messages consumed without ever being stored, so a resend of
        one after a crash is still recognised.

        Returns:
            One entry per item, in order: the seq assigned, or None for a duplicate.
        Raises:
            UnknownQueue: an item names an undeclared queue.
            ValueError, TypeError: an item or a mark is malformed (see ``NewMessage``).
            StorageFull: no room; nothing was stored.
        Durable when it returns: the stored messages and the new high-water marks. A
        call that stores nothing and raises no mark writes and syncs nothing.
        """
        ...

    def delete_batch(self, queue: str, seqs: Collection[int], *, cursor: int | None = None) -> int:
        """Remove the messages ``seqs`` (acked) from ``queue`` in one transaction.

        Seqs that are not stored (never assigned, already deleted, moved) are ignored and
        counted in ``QueueStats.unknown_deleted``; a seq given twice counts once. With
        ``cursor`` given, the queue's cursor is set to it in the same transaction, so the
        removals and the new cursor are durable together or not at all.

        Returns:
            The number of messages removed.
        Raises:
            ValueError: a seq or ``cursor`` is negative or does not fit in 64 bits.
            TypeError: ``cursor`` is not an int (or None).
        Durable when it returns, with the messages' delivery counts and the cursor. A
        call that removes nothing and leaves the cursor as it was writes and syncs
        nothing.
        """
        ...

    def read_range(self, queue: str, start_seq: int, limit: int) -> list[StoredMessage]:
        """Return up to ``limit`` stored messages of ``queue`` with seq >= ``start_seq``.

        Messages are in increasing seq order. The result is a consistent snapshot, and
        no read transaction is left open when this returns.

        Raises:
            ValueError: ``start_seq`` or ``limit`` is negative.
        """
        ...

    def cursor(self, queue: str) -> int:
        """Return the cursor of ``queue`` (see the module docstring); 0 if never set."""
        ...

    def increment_delivery(self, queue: str, seqs: Collection[int]) -> dict[int, int]:
        """Add one to the delivery count of each stored message in ``seqs``.

        A seq given twice is incremented once; seqs that are not stored are ignored.

        Returns:
            The new delivery count of each incremented message, keyed by seq.
        Raises:
            ValueError: a seq is negative or does not fit in 64 bits.
        Durable when it returns.
        """
        ...

    def move_to_dead_letter(
        self, queue: str, seqs: Collection[int], dlq_name: str
    ) -> dict[int, int]:
        """Move the stored messages ``seqs`` from ``queue`` to the queue ``dlq_name``.

        Moved messages keep producer, producer_seq, body and delivery count, and get new
        seqs in ``dlq_name`` in the order of their old seqs. Deduplication does not apply
        and the dead-letter queue's high-water marks do not change. Seqs that are not
        stored are ignored.

        Returns:
            The new seq in ``dlq_name`` of each moved message, keyed by its old seq.
        Raises:
            ValueError: ``dlq_name == queue``, or a seq is negative or too large.
            UnknownQueue: ``queue`` or ``dlq_name`` was never declared.
        Durable when it returns; the move is atomic.
        """
        ...

    def producer_state(self, queue: str, producer: str) -> int:
        """Return the high-water mark of (queue, producer), or 0 if it stored nothing.

        A producer resuming after a crash continues from this number + 1.
        """
        ...

    def stats(self, queue: str) -> QueueStats:
        """Return a snapshot of ``queue``'s statistics (see ``QueueStats``)."""
        ...

    def close(self) -> None:
        """Release the store. Idempotent; every later call except ``close`` raises
        ``StorageClosed``. Everything a write method returned from is already durable,
        so closing writes nothing."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
