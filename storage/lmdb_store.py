"""The durable ``QueueStore``: queues in one LMDB environment, one transaction per call.

Layout (named databases; every integer is big-endian and fixed-width, so LMDB's byte
order is numeric order and a queue's messages are contiguous and sorted by seq):

* ``queues``:    queue name (UTF-8)            -> qid (u32; 1, 2, ... in declaration order)
* ``meta``:      qid (u32)                     -> next_seq, depth, bytes (3 x u64)
                 b"format"                     -> the layout version, checked at open
                 b"cursor" + qid (u32)         -> the queue's cursor (u64); absent means 0
                 (added without a format change: older stores simply have no cursor)
* ``messages``:  qid (u32) + seq (u64)         -> producer_seq (u64), producer length (u16),
                                                  producer (UTF-8), body
* ``producers``: qid (u32) + producer (UTF-8)  -> highest producer_seq stored (u64)
* ``delivery``:  qid (u32) + seq (u64)         -> delivery count (u64); absent means 0

Queues are addressed by qid rather than by name so that message keys stay fixed-width
whatever the name. ``meta`` carries depth and bytes so ``stats`` costs one lookup.

LMDB facts this module is built around:

* A write transaction belongs to the thread that began it. Every public method begins
  and ends its transaction inside one call, under a lock, so the store may be called from
  any thread as long as calls do not need to overlap (they are serialised).
* A read transaction left open pins the pages of its snapshot; freed pages cannot be
  reused and the file grows without bound. Reads happen in ``with`` blocks that copy
  everything out (``buffers=False``) and end before the method returns.
* ``put(..., append=True)`` with a key that is not above the last key, and
  ``put(..., overwrite=False)`` with a key that exists, return False and write nothing.
  Every put's result is checked; False means the stored data contradicts ``meta`` and
  raises ``StorageCorrupt``.
* ``MapFullError`` can come from any put or from commit. The transaction is aborted,
  the map doubled (``set_mapsize``, with no transaction open) up to ``max_map_size`` and
  the whole call retried; at the maximum, ``StorageFull`` -- nothing was written.
* Pages freed by a commit are reusable only two commits later (the previous snapshot
  stays readable). So at the maximum size, before giving up, one tiny commit is made
  and the call retried once: otherwise the first append after a delete in a full map
  would fail although the delete made room.
* With ``sync=True`` each commit is one fsync, so callers batch: one message per
  ``append_batch`` runs at the disk's fsync rate, while batches of hundreds to a
  thousand messages make the fsync a small part of each commit.

One process should own a directory at a time: growth is not coordinated between
processes (LMDB's ``MapResizedError`` is not handled).
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, TypeAlias, TypeVar

import attrs
import lmdb

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
    StorageCorrupt,
    StorageError,
    StorageFull,
    StoredMessage,
    UnknownQueue,
)

__all__ = ["LmdbQueueStore"]

_T = TypeVar("_T")
#: Every transaction here copies values out (buffers=False), so values are bytes.
_Txn: TypeAlias = "lmdb.Transaction[bytes]"

_FORMAT_KEY = b"format"
#: Prefix of the cursor records in ``meta``: 10-byte keys, distinct from the 4-byte qid
#: keys and from ``format``.
_CURSOR_KEY = b"cursor"
_FORMAT = b"msgq_trio.storage.lmdb/1"

_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_MSG_KEY = struct.Struct(">IQ")
_META = struct.Struct(">QQQ")
_MSG_HEAD = struct.Struct(">QH")

MiB = 1 << 20
GiB = 1 << 30


#: Message bytes read, written or deleted between two releases of the map's pages
#: (``release_mapped_pages``): a process's resident memory then stays within about this
#: much of the store file however much of it a backlog passes through.
RELEASE_EVERY = 32 * MiB

#: A commit that fails while its file system has less than this free is reported as
#: ``StorageFull``: more than one commit of the queue plugin (``max_batch`` small
#: messages, about 1 MiB) needs, so a nearly full disk is not mistaken for a healthy one.
FS_FULL_BELOW = 16 * MiB

_libc = ctypes.CDLL(None, use_errno=True)
_MADV_DONTNEED = 4


def release_mapped_pages(path: str) -> int:
    """Drop this process's page-table entries for every mapping of ``path``
    (``madvise(MADV_DONTNEED)``); returns the bytes of mappings released.

    Why: LMDB reads through a read-only shared map of the data file, and every page a
    read or a B-tree update touched stays counted in the process's RSS until unmapped: a
    queue draining a 4 GiB backlog would show 4 GiB resident although none of it is the
    process's own memory. Dropping the entries is safe for a read-only shared file
    mapping (writemap is off, so it holds no dirty page): the pages stay in the page
    cache and the next access maps them again. Call it between transactions (the store
    serialises its calls and copies every value out, so no pointer into the map lives).
    Linux only; elsewhere (no /proc/self/maps) it releases nothing.
    """
    real = os.path.realpath(path)
    released = 0
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5].rstrip("\n") != real:
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) == 0:
            released += end - start
    return released


def _translate(exc: lmdb.Error) -> StorageError:
    """Map an LMDB exception to the storage error tree."""
    if isinstance(exc, lmdb.MapFullError):
        return StorageFull(f"LMDB map is full: {exc}")
    if isinstance(
        exc,
        lmdb.CorruptedError
        | lmdb.PageNotFoundError
        | lmdb.InvalidError
        | lmdb.VersionMismatchError
        | lmdb.BadChecksumError,
    ):
        return StorageCorrupt(f"LMDB reports corruption: {exc}")
    return StorageError(f"LMDB error: {exc}")


def _encode_message(producer_raw: bytes, producer_seq: int, body: bytes) -> bytes:
    return _MSG_HEAD.pack(producer_seq, len(producer_raw)) + producer_raw + body


def _decode_message(value: bytes) -> tuple[str, int, bytes]:
    """Return (producer, producer_seq, body) of a ``messages`` value."""
    try:
        producer_seq, producer_len = _MSG_HEAD.unpack_from(value)
        start = _MSG_HEAD.size
        if len(value) < start + producer_len:
            raise ValueError("value shorter than its header says")
        producer = value[start : start + producer_len].decode("utf-8")
    except (struct.error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise StorageCorrupt(f"undecodable message value: {exc}") from exc
    return producer, producer_seq, value[start + producer_len :]


def _body_size(value: bytes) -> int:
    producer_len: int = _MSG_HEAD.unpack_from(value)[1]
    return len(value) - _MSG_HEAD.size - producer_len


def _decode_u64(value: bytes, what: str) -> int:
    try:
        result: int = _U64.unpack(value)[0]
    except struct.error as exc:
        raise StorageCorrupt(f"undecodable {what}: {value!r}") from exc
    return result


@attrs.define
class _Meta:
    """The ``meta`` record of one queue, loaded and written inside one transaction."""

    qid: int
    next_seq: int
    depth: int
    bytes: int


@attrs.define
class _Mark:
    """A producer's high-water mark while an append transaction runs."""

    key: bytes  # in the producers database
    high: int
    changed: bool = False


@attrs.frozen
class _Outcome(Generic[_T]):
    """What a write transaction's body returns to ``_write``.

    ``changed`` says whether to commit (and sync) or abort: a call that changed nothing
    costs no fsync. ``counters`` are applied only once the commit succeeded.
    """

    result: _T
    changed: set[str]
    counters: dict[str, Counters]


class LmdbQueueStore(LockedStore):
    """A durable ``QueueStore`` in an LMDB environment directory; see the module docstring.

    Args:
        path: directory of the environment; created if missing (its parent must exist).
        map_size: initial size of the memory map in bytes. The file only grows as data is
            written; this bounds it. If the data already stored needs more, LMDB raises
            it to fit.
        max_map_size: the map doubles up to this size when full. ``max_map_size ==
            map_size`` disables growth.
        sync: fsync on every commit (the durability promised in ``QueueStore``). With
            False, data returned from a write survives the process being killed but not
            the machine crashing.
    Raises:
        ValueError: map sizes are not positive or ``max_map_size < map_size``.
        StorageCorrupt: the directory holds something that is not this store's layout.
        StorageError: the environment cannot be opened, e.g. its parent directory is
            missing or it is already open in this process (LMDB forbids opening one
            environment twice in a process).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        map_size: int = 64 * MiB,
        max_map_size: int = 8 * GiB,
        sync: bool = True,
    ) -> None:
        if map_size <= 0 or max_map_size <= 0:
            raise ValueError("map sizes must be positive")
        if max_map_size < map_size:
            raise ValueError(f"max_map_size {max_map_size} < map_size {map_size}")
        super().__init__()
        self._path = os.fspath(path)
        self._max_map_size = max_map_size
        self._sync = sync
        try:
            self._env = lmdb.open(
                self._path,
                map_size=map_size,
                max_dbs=5,
                subdir=True,
                sync=sync,
                metasync=sync,
                lock=True,
                # A read-only map: a stray pointer write in the process cannot corrupt
                # the database.
                writemap=False,
            )
        except lmdb.Error as exc:
            raise _translate(exc) from exc
        except OSError as exc:  # e.g. the parent directory is missing
            raise StorageError(f"cannot open LMDB environment {self._path!r}: {exc}") from exc
        try:
            # Slots of readers that died without ending their transaction would pin
            # pages forever; clear them.
            self._stale_readers_cleared: int = self._env.reader_check()
            self._queues_db = self._env.open_db(b"queues", create=True)
            self._meta_db = self._env.open_db(b"meta", create=True)
            self._messages_db = self._env.open_db(b"messages", create=True)
            self._producers_db = self._env.open_db(b"producers", create=True)
            self._delivery_db = self._env.open_db(b"delivery", create=True)
            self._qids: dict[str, int] = {}
            self._check_format_and_load()
            self._map_size: int = self._env.info()["map_size"]
        except BaseException as exc:
            self._env.close()
            if isinstance(exc, lmdb.Error):
                raise _translate(exc) from exc
            raise
        self._counters: dict[str, Counters] = {}
        self._traffic = 0

    # -- properties -----------------------------------------------------------------

    @property
    def path(self) -> str:
        """The environment directory."""
        return self._path

    @property
    def map_size(self) -> int:
        """The current size of the memory map in bytes (grows when the map fills)."""
        return self._map_size

    # -- transactions ---------------------------------------------------------------

    def _check_format_and_load(self) -> None:
        with self._env.begin(write=False, buffers=False) as txn:
            found = txn.get(_FORMAT_KEY, db=self._meta_db)
            empty = txn.stat(self._queues_db)["entries"] == 0
        if found is None and empty:
            with self._env.begin(write=True) as txn:
                if not txn.put(_FORMAT_KEY, _FORMAT, db=self._meta_db, overwrite=False):
                    raise StorageCorrupt("format marker appeared while being written")
        elif found != _FORMAT:
            raise StorageCorrupt(
                f"{self._path!r} has format {found!r}; this code reads {_FORMAT!r}"
            )
        with self._env.begin(write=False, buffers=False) as txn:
            for raw, value in txn.cursor(db=self._queues_db):
                try:
                    name = raw.decode("utf-8")
                    (qid,) = _U32.unpack(value)
                except (UnicodeDecodeError, struct.error) as exc:
                    raise StorageCorrupt(f"bad queue record {raw!r}: {exc}") from exc
                self._qids[name] = qid
                self._load_meta(txn, name)  # every declared queue must have its meta

    def _read(self, body: Callable[[_Txn], _T]) -> _T:
        """Run ``body`` in a read transaction that ends before this returns."""
        try:
            with self._env.begin(write=False, buffers=False) as txn:
                return body(txn)
        except lmdb.Error as exc:
            raise _translate(exc) from exc

    def _write(self, body: Callable[[_Txn], _Outcome[_T]]) -> _T:
        """Run ``body`` in one write transaction, growing the map and retrying if full.

        Commits (one fsync) if the outcome changed something, aborts otherwise; on any
        exception aborts, so a call that raises wrote nothing.
        """
        released = False
        while True:
            txn = self._env.begin(write=True, buffers=False)
            try:
                outcome = body(txn)
                if outcome.changed:
                    txn.commit()  # may itself raise MapFullError: it allocates pages
                else:
                    txn.abort()
            except lmdb.MapFullError:
                txn.abort()
                # The transaction is gone, so set_mapsize is allowed. Growing in a loop
                # rather than once lets one batch bigger than the current map succeed
                # when max_map_size allows; each step doubles, so the loop is short.
                if self._grow():
                    continue
                if not released and self._release_freed_pages():
                    released = True
                    continue
                raise StorageFull(
                    f"LMDB map of {self._path!r} is full at its maximum of "
                    f"{self._map_size} bytes; nothing was written"
                ) from None
            except lmdb.Error as exc:
                txn.abort()
                if self._file_system_full():
                    raise StorageFull(
                        f"the file system of {self._path!r} is full ({exc}); nothing was written"
                    ) from exc
                raise _translate(exc) from exc
            except BaseException:
                txn.abort()
                raise
            for name, delta in outcome.counters.items():
                if self._sync and name in outcome.changed:
                    delta.fsyncs += 1
                self._counters.setdefault(name, Counters()).add(delta)
            return outcome.result

    def _release_freed_pages(self) -> bool:
        """Commit a rewrite of one record, so pages freed by the last commit can be reused.

        LMDB keeps the previous snapshot intact, so the pages a commit frees become
        reusable only two commits later; aborted transactions do not count. Without this,
        in a full map, the first append after a ``delete_batch`` would still fail even
        though the delete made room. Returns False if even this small commit did not fit.
        """
        try:
            with self._env.begin(write=True) as txn:
                if not txn.put(_FORMAT_KEY, _FORMAT, db=self._meta_db):
                    raise StorageCorrupt("LMDB refused to rewrite the format marker")
        except lmdb.MapFullError:
            return False
        except lmdb.Error as exc:
            raise _translate(exc) from exc
        return True

    def _file_system_full(self) -> bool:
        """Whether the store's file system has less than ``FS_FULL_BELOW`` free: LMDB
        reports a write that found no room as an I/O error (the errno is not kept), so
        a failed commit on a nearly full file system is taken for a full store."""
        try:
            st = os.statvfs(self._path)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < FS_FULL_BELOW

    def _account(self, nbytes: int) -> None:
        """Count the message bytes a call read, wrote or deleted; past
        ``RELEASE_EVERY``, release the pages of the map this process touched."""
        self._traffic += nbytes
        if self._traffic >= RELEASE_EVERY:
            self._traffic = 0
            release_mapped_pages(os.path.join(self._path, "data.mdb"))

    def _grow(self) -> bool:
        if self._map_size >= self._max_map_size:
            return False
        try:
            self._env.set_mapsize(min(self._map_size * 2, self._max_map_size))
            self._map_size = self._env.info()["map_size"]
        except lmdb.Error as exc:
            raise _translate(exc) from exc
        return True

    # -- record helpers (called inside a transaction) -----------------------------------

    def _qid(self, name: str) -> int:
        # The cache is authoritative: one process owns the directory (module docstring).
        encode_name(name, "queue")
        qid = self._qids.get(name)
        if qid is None:
            raise UnknownQueue(f"queue {name!r} was never declared")
        return qid

    def _load_meta(self, txn: _Txn, name: str) -> _Meta:
        qid = self._qids[name]
        value = txn.get(_U32.pack(qid), db=self._meta_db)
        if value is None:
            raise StorageCorrupt(f"queue {name!r} (qid {qid}) has no meta record")
        try:
            next_seq, depth, size = _META.unpack(value)
        except struct.error as exc:
            raise StorageCorrupt(f"bad meta record of queue {name!r}: {value!r}") from exc
        return _Meta(qid, next_seq, depth, size)

    def _store_meta(self, txn: _Txn, meta: _Meta) -> None:
        if meta.depth < 0 or meta.bytes < 0:
            raise StorageCorrupt(f"meta of qid {meta.qid} went negative: {meta}")
        value = _META.pack(meta.next_seq, meta.depth, meta.bytes)
        if not txn.put(_U32.pack(meta.qid), value, db=self._meta_db):
            raise StorageCorrupt(f"LMDB refused to overwrite meta of qid {meta.qid}")

    def _put_messages(self, txn: _Txn, records: list[tuple[bytes, bytes]]) -> None:
        """Insert new ``messages`` records, refusing to overwrite any.

        Records are written in key order, with ``append=True`` for those above the last
        key of the database (dense pages, no search) -- the usual case for the most
        recently declared queue -- and ``overwrite=False`` for the rest (MDB_APPEND
        compares with the last key of the whole database, not of the queue).
        """
        records.sort()
        with txn.cursor(db=self._messages_db) as cursor:
            last = cursor.key() if cursor.last() else b""
            if records and records[0][0] > last:
                # All above the last key (sorted): one C loop of MDB_APPEND puts.
                _consumed, added = cursor.putmulti(records, append=True)
                if added != len(records):
                    raise StorageCorrupt(
                        f"{len(records) - added} of {len(records)} new messages were "
                        "already stored: a queue's next_seq is behind its messages"
                    )
                return
            for key, value in records:
                if key > last:
                    ok = cursor.put(key, value, append=True)
                    last = key
                else:
                    ok = cursor.put(key, value, overwrite=False)
                if not ok:
                    qid, seq = _MSG_KEY.unpack(key)
                    raise StorageCorrupt(
                        f"seq {seq} of qid {qid} is already stored or out of order: "
                        "the queue's next_seq is behind its messages"
                    )

    # -- QueueStore -----------------------------------------------------------------

    def _close_locked(self) -> None:
        self._env.close()

    def declare_queue(self, name: str) -> bool:
        raw = encode_name(name, "queue")
        with self._lock:
            self._check_open()
            if name in self._qids:
                return False

            def body(txn: _Txn) -> _Outcome[int]:
                qid = int(txn.stat(self._queues_db)["entries"]) + 1
                if not txn.put(raw, _U32.pack(qid), db=self._queues_db, overwrite=False):
                    raise StorageCorrupt(f"queue {name!r} is stored but was not loaded")
                meta = _META.pack(1, 0, 0)
                if not txn.put(_U32.pack(qid), meta, db=self._meta_db, overwrite=False):
                    raise StorageCorrupt(f"qid {qid} already has a meta record")
                return _Outcome(qid, {name}, {})

            self._qids[name] = self._write(body)
            return True

    def queues(self) -> list[str]:
        with self._lock:
            self._check_open()
            # UTF-8 byte order is code point order, so the cache sorts like the database.
            return sorted(self._qids)

    def append_batch(
        self, items: Sequence[NewMessage], marks: Mapping[tuple[str, str], int] | None = None
    ) -> list[int | None]:
        items = list(items)  # read twice below; a one-shot iterable would append nothing
        names = check_items(items)
        raised = check_marks(marks)
        for _queue, producer in raised:
            names.setdefault(producer, producer.encode("utf-8"))
        with self._lock:
            self._check_open()
            if not items and not raised:
                return []
            result = self._write(lambda txn: self._append(txn, items, names, raised))
            self._account(sum(len(item.body) for item in items))
            return result

    def _append(
        self,
        txn: _Txn,
        items: Sequence[NewMessage],
        names: dict[str, bytes],
        raised: dict[tuple[str, str], int],
    ) -> _Outcome[list[int | None]]:
        # Resolve every queue before storing anything; UnknownQueue aborts the batch.
        queues = list(
            dict.fromkeys(
                [*(item.queue for item in items), *(queue for queue, _producer in raised)]
            )
        )
        for name in queues:
            self._qid(name)
        metas = {name: self._load_meta(txn, name) for name in queues}
        counters = {name: Counters() for name in queues}
        marks: dict[tuple[str, str], _Mark] = {}
        records: list[tuple[bytes, bytes]] = []
        result: list[int | None] = []
        head, key_of = _MSG_HEAD.pack, _MSG_KEY.pack
        for queue, producer, producer_seq, body in items:
            meta = metas[queue]
            mark = marks.get((queue, producer))
            if mark is None:
                key = _U32.pack(meta.qid) + names[producer]
                stored = txn.get(key, db=self._producers_db)
                high = 0 if stored is None else _decode_u64(stored, "producer mark")
                mark = marks[queue, producer] = _Mark(key, high)
            if producer_seq <= mark.high:
                counters[queue].duplicates += 1
                result.append(None)
                continue
            mark.high = producer_seq
            mark.changed = True
            seq = meta.next_seq
            meta.next_seq += 1
            meta.depth += 1
            meta.bytes += len(body)
            raw = names[producer]
            # _encode_message, inline: this loop runs once per message committed.
            records.append((key_of(meta.qid, seq), head(producer_seq, len(raw)) + raw + body))
            counters[queue].appended += 1
            result.append(seq)
        marked: set[str] = set()
        for (queue, producer), high in raised.items():
            mark = marks.get((queue, producer))
            if mark is None:
                key = _U32.pack(metas[queue].qid) + names[producer]
                stored = txn.get(key, db=self._producers_db)
                low = 0 if stored is None else _decode_u64(stored, "producer mark")
                mark = marks[queue, producer] = _Mark(key, low)
            if high > mark.high:
                mark.high = high
                mark.changed = True
                marked.add(queue)
        if not records and not marked:
            return _Outcome(result, set(), counters)
        if records:
            self._put_messages(txn, records)
        for mark in marks.values():
            if mark.changed and not txn.put(mark.key, _U64.pack(mark.high), db=self._producers_db):
                raise StorageCorrupt(f"LMDB refused the producer mark {mark.key!r}")
        changed_queues = {name for name, c in counters.items() if c.appended}
        for name in changed_queues:
            self._store_meta(txn, metas[name])
            counters[name].batches = 1
        return _Outcome(result, changed_queues | marked, counters)

    def delete_batch(self, queue: str, seqs: Collection[int], *, cursor: int | None = None) -> int:
        wanted = check_seqs(seqs)
        if cursor is not None:
            check_int(cursor, "cursor", 0)
        with self._lock:
            self._check_open()

            def body(txn: _Txn) -> _Outcome[int]:
                self._qid(queue)
                meta = self._load_meta(txn, queue)
                removed = 0
                for seq in wanted:
                    key = _MSG_KEY.pack(meta.qid, seq)
                    value = txn.pop(key, db=self._messages_db)
                    if value is None:
                        continue
                    txn.delete(key, db=self._delivery_db)  # False (no count) is fine
                    removed += 1
                    meta.depth -= 1
                    meta.bytes -= self._checked_body_size(value)
                counters = {queue: Counters(deleted=removed, unknown_deleted=len(wanted) - removed)}
                moved = False
                if cursor is not None:
                    key = _CURSOR_KEY + _U32.pack(meta.qid)
                    if self._load_cursor(txn, key) != cursor:
                        if not txn.put(key, _U64.pack(cursor), db=self._meta_db):
                            raise StorageCorrupt(f"LMDB refused the cursor of {queue!r}")
                        moved = True
                if not removed and not moved:
                    return _Outcome(0, set(), counters)
                if removed:
                    freed[0] = self._load_meta(txn, queue).bytes - meta.bytes
                    self._store_meta(txn, meta)
                return _Outcome(removed, {queue}, counters)

            freed = [0]
            result = self._write(body)
            self._account(freed[0])
            return result

    def _load_cursor(self, txn: _Txn, key: bytes) -> int:
        stored = txn.get(key, db=self._meta_db)
        return 0 if stored is None else _decode_u64(stored, "cursor")

    def cursor(self, queue: str) -> int:
        with self._lock:
            self._check_open()

            def body(txn: _Txn) -> int:
                qid = self._qid(queue)
                return self._load_cursor(txn, _CURSOR_KEY + _U32.pack(qid))

            return self._read(body)

    @staticmethod
    def _checked_body_size(value: bytes) -> int:
        try:
            return _body_size(value)
        except struct.error as exc:
            raise StorageCorrupt(f"undecodable message value: {exc}") from exc

    def read_range(self, queue: str, start_seq: int, limit: int) -> list[StoredMessage]:
        check_int(start_seq, "start_seq", 0)
        check_int(limit, "limit", 0)
        with self._lock:
            self._check_open()

            def body(txn: _Txn) -> list[StoredMessage]:
                qid = self._qid(queue)
                prefix = _U32.pack(qid)
                found: list[StoredMessage] = []
                if limit == 0:
                    return found
                with txn.cursor(db=self._messages_db) as cursor:
                    if not cursor.set_range(_MSG_KEY.pack(qid, start_seq)):
                        return found
                    for key, value in cursor.iternext():
                        if not key.startswith(prefix):
                            break
                        producer, producer_seq, message_body = _decode_message(value)
                        count = txn.get(key, db=self._delivery_db)
                        found.append(
                            StoredMessage(
                                seq=_MSG_KEY.unpack(key)[1],
                                queue=queue,
                                producer=producer,
                                producer_seq=producer_seq,
                                body=message_body,
                                delivery_count=0 if count is None else _decode_u64(count, "count"),
                            )
                        )
                        if len(found) == limit:
                            break
                return found

            messages = self._read(body)
            self._account(sum(len(m.body) for m in messages))
            return messages

    def increment_delivery(self, queue: str, seqs: Collection[int]) -> dict[int, int]:
        wanted = check_seqs(seqs)
        with self._lock:
            self._check_open()

            def body(txn: _Txn) -> _Outcome[dict[int, int]]:
                qid = self._qid(queue)
                counts: dict[int, int] = {}
                with txn.cursor(db=self._messages_db) as cursor:
                    for seq in wanted:
                        key = _MSG_KEY.pack(qid, seq)
                        # set_key positions without copying the (possibly large) body.
                        if not cursor.set_key(key):
                            continue
                        stored = txn.get(key, db=self._delivery_db)
                        count = 1 + (0 if stored is None else _decode_u64(stored, "count"))
                        if not txn.put(key, _U64.pack(count), db=self._delivery_db):
                            raise StorageCorrupt(f"LMDB refused the delivery count of {seq}")
                        counts[seq] = count
                return _Outcome(counts, {queue} if counts else set(), {queue: Counters()})

            return self._write(body)

    def move_to_dead_letter(
        self, queue: str, seqs: Collection[int], dlq_name: str
    ) -> dict[int, int]:
        wanted = check_seqs(seqs)
        encode_name(dlq_name, "dlq_name")
        if dlq_name == queue:
            raise ValueError(f"cannot dead-letter queue {queue!r} into itself")
        with self._lock:
            self._check_open()

            def body(txn: _Txn) -> _Outcome[dict[int, int]]:
                self._qid(queue)
                self._qid(dlq_name)
                src = self._load_meta(txn, queue)
                dlq = self._load_meta(txn, dlq_name)
                moved: dict[int, int] = {}
                records: list[tuple[bytes, bytes]] = []
                counts: list[tuple[bytes, bytes]] = []
                for seq in wanted:
                    key = _MSG_KEY.pack(src.qid, seq)
                    value = txn.pop(key, db=self._messages_db)
                    if value is None:
                        continue
                    size = self._checked_body_size(value)
                    new_key = _MSG_KEY.pack(dlq.qid, dlq.next_seq)
                    moved[seq] = dlq.next_seq
                    dlq.next_seq += 1
                    for meta, sign in ((src, -1), (dlq, 1)):
                        meta.depth += sign
                        meta.bytes += sign * size
                    # The value holds no queue or seq, so it moves unchanged.
                    records.append((new_key, value))
                    count = txn.pop(key, db=self._delivery_db)
                    if count is not None:
                        counts.append((new_key, count))
                n = len(moved)
                counters = {queue: Counters(deleted=n), dlq_name: Counters(appended=n)}
                if not moved:
                    return _Outcome(moved, set(), counters)
                self._put_messages(txn, records)
                for new_key, count in counts:
                    if not txn.put(new_key, count, db=self._delivery_db, overwrite=False):
                        raise StorageCorrupt("a dead-letter seq already had a delivery count")
                self._store_meta(txn, src)
                self._store_meta(txn, dlq)
                return _Outcome(moved, {queue, dlq_name}, counters)

            return self._write(body)

    def producer_state(self, queue: str, producer: str) -> int:
        producer_raw = encode_name(producer, "producer")
        with self._lock:
            self._check_open()

            def body(txn: _Txn) -> int:
                qid = self._qid(queue)
                stored = txn.get(_U32.pack(qid) + producer_raw, db=self._producers_db)
                return 0 if stored is None else _decode_u64(stored, "producer mark")

            return self._read(body)

    def stats(self, queue: str) -> QueueStats:
        with self._lock:
            self._check_open()

            def body(txn: _Txn) -> _Meta:
                self._qid(queue)
                return self._load_meta(txn, queue)

            meta = self._read(body)
            counters = self._counters.get(queue, Counters())
            return counters.stats(meta.depth, meta.bytes, meta.next_seq)


if TYPE_CHECKING:  # mypy proves here that the class implements the protocol

    def _implements_queue_store(store: LmdbQueueStore) -> QueueStore:
        return store
