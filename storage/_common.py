"""Argument checks and bookkeeping shared by the backends, so they reject and count alike.

Both backends validate everything before they touch their data: a call with one bad
argument writes nothing, whichever backend runs it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Self

import attrs

from .api import MAX_NAME_BYTES, NewMessage, QueueStats, StorageClosed

#: Seqs and producer_seqs are stored as unsigned 64-bit integers.
U64_LIMIT = 1 << 64


def encode_name(name: object, what: str) -> bytes:
    """Return ``name`` as UTF-8, or raise TypeError/ValueError if it is not a valid name."""
    if not isinstance(name, str):
        raise TypeError(f"{what} must be a str, not {type(name).__name__}")
    if not name:
        raise ValueError(f"{what} must not be empty")
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates
        raise ValueError(f"{what} {name!r} is not encodable as UTF-8") from exc
    if len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"{what} is {len(raw)} bytes of UTF-8; the limit is {MAX_NAME_BYTES}")
    return raw


def check_int(value: object, what: str, minimum: int) -> int:
    """Return ``value`` if it is an int in [minimum, 2**64), else raise TypeError/ValueError."""
    # bool is an int subclass; True as a seq is always a caller bug.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    if not minimum <= value < U64_LIMIT:
        raise ValueError(f"{what} must be in [{minimum}, 2**64), got {value}")
    return value


def check_seqs(seqs: Iterable[int]) -> list[int]:
    """Return the distinct seqs in increasing order, or raise if one is not a valid seq."""
    if isinstance(seqs, str | bytes):
        raise TypeError("seqs must be a collection of ints")
    return sorted({check_int(seq, "seq", 0) for seq in seqs})


def check_items(items: Sequence[NewMessage]) -> dict[str, bytes]:
    """Check every item of an ``append_batch`` call before anything is written.

    Returns:
        The UTF-8 encoding of every queue and producer name in the batch, so that a name
        repeated across a batch is checked and encoded once (this loop is a measurable
        part of an append of 1,000 small messages).
    """
    names: dict[str, bytes] = {}
    for index, item in enumerate(items):
        if type(item) is not NewMessage and not isinstance(item, NewMessage):
            raise TypeError(f"item {index} is a {type(item).__name__}, not a NewMessage")
        queue, producer, producer_seq, body = item
        if queue not in names:
            names[queue] = encode_name(queue, f"item {index}: queue")
        if producer not in names:
            names[producer] = encode_name(producer, f"item {index}: producer")
        # The exact-type test first: check_int's full test only for what is not a plain
        # int in range (it raises for those, bool included).
        if type(producer_seq) is not int or not 0 < producer_seq < U64_LIMIT:
            check_int(producer_seq, f"item {index}: producer_seq", 1)
        if type(body) is not bytes and not isinstance(body, bytes):
            raise TypeError(f"item {index}: body must be bytes, not {type(body).__name__}")
    return names


def check_marks(marks: Mapping[tuple[str, str], int] | None) -> dict[tuple[str, str], int]:
    """Check the ``marks`` of an ``append_batch`` call; returns them as a dict."""
    if marks is None:
        return {}
    out: dict[tuple[str, str], int] = {}
    for key, value in marks.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TypeError(f"mark key {key!r} must be a (queue, producer) tuple")
        encode_name(key[0], "mark queue")
        encode_name(key[1], "mark producer")
        out[key] = check_int(value, f"mark of {key!r}", 1)
    return out


@attrs.define
class Counters:
    """The since-open part of ``QueueStats`` for one queue."""

    appended: int = 0
    duplicates: int = 0
    deleted: int = 0
    unknown_deleted: int = 0
    batches: int = 0
    fsyncs: int = 0

    def add(self, other: Counters) -> None:
        self.appended += other.appended
        self.duplicates += other.duplicates
        self.deleted += other.deleted
        self.unknown_deleted += other.unknown_deleted
        self.batches += other.batches
        self.fsyncs += other.fsyncs

    def stats(self, depth: int, size: int, next_seq: int) -> QueueStats:
        return QueueStats(
            depth=depth,
            bytes=size,
            next_seq=next_seq,
            appended=self.appended,
            duplicates=self.duplicates,
            deleted=self.deleted,
            unknown_deleted=self.unknown_deleted,
            batches=self.batches,
            fsyncs=self.fsyncs,
        )


class LockedStore:
    """Serialises calls with one lock and implements the closing half of the protocol.

    Subclasses call ``self._enter()`` (returns the lock's context) at the top of every
    public method and implement ``_close_locked``.
    """

    def __init__(self) -> None:
        # A plain Lock, not an RLock: public methods never call each other while holding
        # it, and a re-entrant call would be a bug we want to hang loudly in tests.
        self._lock = threading.Lock()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StorageClosed(f"{type(self).__name__} is closed")

    def _close_locked(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release the store; idempotent. Later calls (except ``close``) raise StorageClosed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._close_locked()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
