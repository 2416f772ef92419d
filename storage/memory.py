"""The reference ``QueueStore``: plain dicts, written to be read as the executable spec.

``MemoryQueueStore`` is what the conformance suite's model and the LMDB backend are
checked against, so it favours obviousness over speed (``read_range`` sorts, ``stats``
sums). It is durable only in the sense the suite needs: stores opened with the same
``path`` share one class-level state for the life of the process, so closing and opening
again models a restart. Nothing touches the file system.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import attrs

from ._common import (
    Counters,
    LockedStore,
    check_int,
    check_items,
    check_marks,
    check_seqs,
    encode_name,
)
from .api import (
    NewMessage,
    QueueStats,
    QueueStore,
    StorageError,
    StoredMessage,
    UnknownQueue,
)

__all__ = ["MemoryQueueStore"]


@attrs.frozen
class _Message:
    producer: str
    producer_seq: int
    body: bytes


@attrs.define
class _Queue:
    next_seq: int = 1
    messages: dict[int, _Message] = attrs.Factory(dict)
    # Absent means 0, as in the LMDB backend.
    delivery: dict[int, int] = attrs.Factory(dict)
    producers: dict[str, int] = attrs.Factory(dict)
    cursor: int = 0


@attrs.define
class _State:
    """Everything that survives a close and reopen of the same path."""

    queues: dict[str, _Queue] = attrs.Factory(dict)


class MemoryQueueStore(LockedStore):
    """A ``QueueStore`` in process memory; see the module docstring.

    Args:
        path: key of the shared state. Opening the same path again after ``close()``
            sees everything written before, as a reopened durable store would. None gives
            a private state that is lost on close.
    Raises:
        StorageError: a store with this path is already open in this process (as
            ``LmdbQueueStore`` refuses to open one environment twice).
    """

    _registry: ClassVar[dict[str, _State]] = {}
    _open_paths: ClassVar[set[str]] = set()
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        key = None if path is None else os.path.abspath(os.fspath(path))
        with self._registry_lock:
            if key is None:
                state = _State()
            else:
                if key in self._open_paths:
                    raise StorageError(f"a MemoryQueueStore for {key!r} is already open")
                state = self._registry.setdefault(key, _State())
                self._open_paths.add(key)
        self._key = key
        self._state = state
        self._counters: dict[str, Counters] = {}

    def _close_locked(self) -> None:
        if self._key is not None:
            with self._registry_lock:
                self._open_paths.discard(self._key)

    def _queue(self, name: str) -> _Queue:
        encode_name(name, "queue")
        try:
            return self._state.queues[name]
        except KeyError:
            raise UnknownQueue(f"queue {name!r} was never declared") from None

    def _count(self, name: str) -> Counters:
        return self._counters.setdefault(name, Counters())

    def declare_queue(self, name: str) -> bool:
        encode_name(name, "queue")
        with self._lock:
            self._check_open()
            if name in self._state.queues:
                return False
            self._state.queues[name] = _Queue()
            return True

    def queues(self) -> list[str]:
        with self._lock:
            self._check_open()
            return sorted(self._state.queues)

    def append_batch(
        self, items: Sequence[NewMessage], marks: Mapping[tuple[str, str], int] | None = None
    ) -> list[int | None]:
        items = list(items)  # read twice below; a one-shot iterable would append nothing
        check_items(items)
        raised = check_marks(marks)
        with self._lock:
            self._check_open()
            # Resolve every queue first: an unknown queue must fail the batch before any
            # item is stored.
            for item in items:
                self._queue(item.queue)
            for queue_name, _producer in raised:
                self._queue(queue_name)
            result: list[int | None] = []
            delta: dict[str, Counters] = {}
            for item in items:
                queue = self._state.queues[item.queue]
                counters = delta.setdefault(item.queue, Counters())
                if item.producer_seq <= queue.producers.get(item.producer, 0):
                    counters.duplicates += 1
                    result.append(None)
                    continue
                seq = queue.next_seq
                queue.next_seq += 1
                queue.messages[seq] = _Message(item.producer, item.producer_seq, item.body)
                queue.producers[item.producer] = item.producer_seq
                counters.appended += 1
                result.append(seq)
            marked: set[str] = set()
            for (queue_name, producer), high in raised.items():
                queue = self._state.queues[queue_name]
                if high > queue.producers.get(producer, 0):
                    queue.producers[producer] = high
                    marked.add(queue_name)
                    delta.setdefault(queue_name, Counters())
            for name, counters in delta.items():
                if counters.appended:
                    counters.batches = 1
                if counters.appended or name in marked:
                    counters.fsyncs = 1
                self._count(name).add(counters)
            return result

    def delete_batch(self, queue: str, seqs: Collection[int], *, cursor: int | None = None) -> int:
        wanted = check_seqs(seqs)
        if cursor is not None:
            check_int(cursor, "cursor", 0)
        with self._lock:
            self._check_open()
            q = self._queue(queue)
            removed = 0
            for seq in wanted:
                if q.messages.pop(seq, None) is not None:
                    q.delivery.pop(seq, None)
                    removed += 1
            moved = cursor is not None and cursor != q.cursor
            if cursor is not None:
                q.cursor = cursor
            counters = self._count(queue)
            counters.deleted += removed
            counters.unknown_deleted += len(wanted) - removed
            if removed or moved:
                counters.fsyncs += 1
            return removed

    def cursor(self, queue: str) -> int:
        with self._lock:
            self._check_open()
            return self._queue(queue).cursor

    def read_range(self, queue: str, start_seq: int, limit: int) -> list[StoredMessage]:
        check_int(start_seq, "start_seq", 0)
        check_int(limit, "limit", 0)
        with self._lock:
            self._check_open()
            q = self._queue(queue)
            seqs = sorted(seq for seq in q.messages if seq >= start_seq)[:limit]
            return [
                StoredMessage(
                    seq=seq,
                    queue=queue,
                    producer=q.messages[seq].producer,
                    producer_seq=q.messages[seq].producer_seq,
                    body=q.messages[seq].body,
                    delivery_count=q.delivery.get(seq, 0),
                )
                for seq in seqs
            ]

    def increment_delivery(self, queue: str, seqs: Collection[int]) -> dict[int, int]:
        wanted = check_seqs(seqs)
        with self._lock:
            self._check_open()
            q = self._queue(queue)
            counts = {}
            for seq in wanted:
                if seq in q.messages:
                    q.delivery[seq] = counts[seq] = q.delivery.get(seq, 0) + 1
            if counts:
                self._count(queue).fsyncs += 1
            return counts

    def move_to_dead_letter(
        self, queue: str, seqs: Collection[int], dlq_name: str
    ) -> dict[int, int]:
        wanted = check_seqs(seqs)
        encode_name(dlq_name, "dlq_name")
        if dlq_name == queue:
            raise ValueError(f"cannot dead-letter queue {queue!r} into itself")
        with self._lock:
            self._check_open()
            src = self._queue(queue)
            dlq = self._queue(dlq_name)
            moved = {}
            for seq in wanted:
                message = src.messages.pop(seq, None)
                if message is None:
                    continue
                new_seq = dlq.next_seq
                dlq.next_seq += 1
                dlq.messages[new_seq] = message
                count = src.delivery.pop(seq, 0)
                if count:
                    dlq.delivery[new_seq] = count
                moved[seq] = new_seq
            if moved:
                for name, appended, deleted in ((queue, 0, len(moved)), (dlq_name, len(moved), 0)):
                    counters = self._count(name)
                    counters.appended += appended
                    counters.deleted += deleted
                    counters.fsyncs += 1
            return moved

    def producer_state(self, queue: str, producer: str) -> int:
        encode_name(producer, "producer")
        with self._lock:
            self._check_open()
            return self._queue(queue).producers.get(producer, 0)

    def stats(self, queue: str) -> QueueStats:
        with self._lock:
            self._check_open()
            q = self._queue(queue)
            size = sum(len(message.body) for message in q.messages.values())
            return self._count(queue).stats(len(q.messages), size, q.next_seq)


if TYPE_CHECKING:  # mypy proves here that the class implements the protocol

    def _implements_queue_store(store: MemoryQueueStore) -> QueueStore:
        return store
