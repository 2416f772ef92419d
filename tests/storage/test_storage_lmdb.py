"""Runs the conformance suite on ``LmdbQueueStore`` and tests what only a real LMDB can show.

No mocks: a map that is really full, a writer that is really SIGKILLed, a file whose size
is really measured. A few tests are white-box (they open the environment with ``lmdb``
directly, or hold a read transaction on the store's environment) to create states the
public interface cannot: those say so.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
from conformance import ALL, Opener, QueueStoreConformance, batch, closing_opener, msg
from msgq_trio.storage import (
    LmdbQueueStore,
    StorageCorrupt,
    StorageError,
    StorageFull,
)

MiB = 1 << 20


class TestLmdbQueueStore(QueueStoreConformance):
    @pytest.fixture
    def open_store(self) -> Iterator[Opener]:
        # A small initial map, so that the large-body tests also exercise growth.
        def factory(path: Path) -> LmdbQueueStore:
            return LmdbQueueStore(path, map_size=2 * MiB, max_map_size=1024 * MiB)

        with closing_opener(factory) as opener:
            yield opener


# -- a full map -----------------------------------------------------------------------


def test_full_map_without_growth_raises_storage_full_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "store"
    store = LmdbQueueStore(path, map_size=1 * MiB, max_map_size=1 * MiB)
    store.declare_queue("q")
    stored: dict[int, bytes] = {}
    producer_seq = 0
    # 1 MiB cannot hold 2,000 x 10 x 1 KiB, so the loop must end in StorageFull.
    with pytest.raises(StorageFull):
        for _ in range(2000):
            items = [msg("q", "p", producer_seq + i + 1, os.urandom(1024)) for i in range(10)]
            before = store.stats("q")
            seqs = store.append_batch(items)
            stored.update(
                (seq, item.body) for seq, item in zip(seqs, items, strict=True) if seq is not None
            )
            producer_seq += 10
    assert len(stored) >= 300, "the map should hold a few hundred messages before filling"
    # The failed batch stored nothing and did not move the producer's mark.
    assert store.stats("q") == before
    assert store.producer_state("q", "p") == producer_seq
    assert store.map_size == 1 * MiB

    store.close()
    store = LmdbQueueStore(path, map_size=1 * MiB, max_map_size=1 * MiB)
    messages = store.read_range("q", 0, ALL)
    assert {m.seq: m.body for m in messages} == stored
    assert [m.producer_seq for m in messages] == list(range(1, producer_seq + 1))

    # Deleting the older half makes room again; the failed batch consumed no seq.
    assert store.delete_batch("q", sorted(stored)[: len(stored) // 2]) == len(stored) // 2
    next_seq = max(stored) + 1
    assert store.append_batch(
        batch("q", "p", range(producer_seq + 1, producer_seq + 11), 1024)
    ) == list(range(next_seq, next_seq + 10))
    store.close()


def test_full_map_grows_up_to_max_map_size(tmp_path: Path) -> None:
    path = tmp_path / "store"
    store = LmdbQueueStore(path, map_size=1 * MiB, max_map_size=8 * MiB)
    store.declare_queue("q")
    # One batch needing more than twice the current map: growth repeats until it fits.
    bodies = [os.urandom(MiB) for _ in range(3)]
    assert store.append_batch([msg("q", "p", n + 1, body) for n, body in enumerate(bodies)]) == [
        1,
        2,
        3,
    ]
    assert store.map_size == 4 * MiB
    bodies += [os.urandom(MiB) for _ in range(3)]
    store.append_batch([msg("q", "p", n + 1, body) for n, body in enumerate(bodies) if n >= 3])
    assert store.map_size == 8 * MiB
    with pytest.raises(StorageFull):
        store.append_batch([msg("q", "p", 7, os.urandom(3 * MiB))])
    assert store.map_size == 8 * MiB
    store.close()
    with LmdbQueueStore(path, map_size=1 * MiB, max_map_size=8 * MiB) as store:
        # LMDB keeps the map at least as large as the data it holds.
        assert store.map_size > 6 * MiB
        assert [m.body for m in store.read_range("q", 0, ALL)] == bodies


# -- crashes --------------------------------------------------------------------------

# Appends batches forever, printing "seq:producer_seq ..." for each batch only after
# append_batch returned: every printed seq was acked. It resumes from producer_state,
# as a real producer would after a crash.
CHILD = textwrap.dedent(
    """
    import sys
    from msgq_trio.storage import LmdbQueueStore, NewMessage

    path, size = sys.argv[1], int(sys.argv[2])
    store = LmdbQueueStore(path, map_size=64 << 20)
    store.declare_queue("q")
    next_p = store.producer_state("q", "child") + 1
    print("ready", flush=True)
    while True:
        ps = range(next_p, next_p + size)
        seqs = store.append_batch([NewMessage("q", "child", p, b"%d" % p * 30) for p in ps])
        print(" ".join(f"{s}:{p}" for s, p in zip(seqs, ps)), flush=True)
        next_p += size
    """
)


def test_sigkill_loses_nothing_acked(tmp_path: Path) -> None:
    path = tmp_path / "store"
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    size = 50
    acked: dict[int, int] = {}
    for round_ in range(4):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path), str(size)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert child.stdout is not None and child.stderr is not None
        try:
            assert child.stdout.readline() == b"ready\n", child.stderr.read().decode()
            lines = [child.stdout.readline() for _ in range(rng.randint(1, 30))]
        finally:
            # Killed while it keeps appending: the kill lands at a random point of a
            # transaction, a commit or a print.
            child.send_signal(signal.SIGKILL)
            child.wait()
        rest = child.stdout.read()
        child.stdout.close()
        child.stderr.close()
        assert child.returncode == -signal.SIGKILL
        lines += rest.splitlines(keepends=True)
        complete = [line for line in lines if line.endswith(b"\n")]  # not a half-printed one
        assert complete, f"seed {seed}, round {round_}: the child acked nothing"
        for line in complete:
            for pair in line.split():
                seq, producer_seq = map(int, pair.split(b":"))
                acked[seq] = producer_seq

        with LmdbQueueStore(path, map_size=64 * MiB) as store:
            messages = store.read_range("q", 0, ALL)
            found = {m.seq: m.producer_seq for m in messages}
            missing = sorted(set(acked) - set(found))
            assert not missing, f"seed {seed}, round {round_}: acked seqs lost: {missing[:10]}"
            assert all(found[seq] == p for seq, p in acked.items())
            # Batches are atomic and resends were deduplicated: the store holds whole
            # batches, seq n carrying producer_seq n, and intact bodies.
            assert len(messages) % size == 0, f"seed {seed}: a partial batch is stored"
            assert [m.seq for m in messages] == list(range(1, len(messages) + 1))
            assert all(m.producer_seq == m.seq for m in messages)
            assert all(m.body == b"%d" % m.seq * 30 for m in messages)
            assert store.stats("q").depth == len(messages)


# -- file size ------------------------------------------------------------------------


def _append_read_delete_rounds(store: LmdbQueueStore, rounds: range) -> list[int]:
    """Append 1,000 x 1 KiB, read them, delete them; return the file size after each round."""
    body = os.urandom(1024)
    sizes = []
    for round_ in rounds:
        items = [msg("q", "p", round_ * 1000 + i + 1, body) for i in range(1000)]
        seqs = store.append_batch(items)
        assert len(store.read_range("q", 0, ALL)) == 1000
        assert store.delete_batch("q", [seq for seq in seqs if seq is not None]) == 1000
        sizes.append((Path(store.path) / "data.mdb").stat().st_size)
    return sizes


def test_file_size_stays_bounded_when_appending_and_deleting(tmp_path: Path) -> None:
    with LmdbQueueStore(tmp_path / "store", map_size=64 * MiB, max_map_size=64 * MiB) as store:
        store.declare_queue("q")
        sizes = _append_read_delete_rounds(store, range(50))
    # Freed pages are reused: the file settles at about twice one round (LMDB keeps the
    # previous snapshot's pages until the next commit).
    assert max(sizes) <= 3 * sizes[0], sizes


def test_file_size_check_detects_a_pinned_reader(tmp_path: Path) -> None:
    # White-box: hold a read transaction on the store's own environment, as a read that
    # leaked its transaction would. This shows the bound above is not vacuous: with
    # page reuse blocked, ten rounds already break it.
    with LmdbQueueStore(tmp_path / "store", map_size=64 * MiB, max_map_size=64 * MiB) as store:
        store.declare_queue("q")
        pin = store._env.begin()
        try:
            sizes = _append_read_delete_rounds(store, range(10))
        finally:
            pin.abort()
    assert sizes[-1] > 3 * sizes[0], sizes


# -- corruption and configuration -----------------------------------------------------


def test_refused_put_raises_storage_corrupt_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with LmdbQueueStore(path) as store:
        store.declare_queue("a")
        store.declare_queue("b")
        store.append_batch([msg("a", "p", 1, b"first"), msg("b", "p", 1, b"b")])
    # White-box: rewind queue "a"'s next_seq (qid 1) to 1, so the store's next append
    # targets a key that exists. LMDB's put then returns False instead of raising.
    env = lmdb.open(str(path), max_dbs=5)
    meta = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        assert txn.put(struct.pack(">I", 1), struct.pack(">QQQ", 1, 1, 5), db=meta)
    env.close()
    with LmdbQueueStore(path) as store:
        with pytest.raises(StorageCorrupt, match="already stored"):
            store.append_batch([msg("b", "p", 2, b"b2"), msg("a", "p", 2, b"second")])
        # The whole batch was aborted, including the item for the healthy queue.
        assert [m.body for m in store.read_range("a", 0, ALL)] == [b"first"]
        assert [m.body for m in store.read_range("b", 0, ALL)] == [b"b"]
        assert store.producer_state("a", "p") == store.producer_state("b", "p") == 1


def test_no_delivery_records_outlive_their_messages(tmp_path: Path) -> None:
    # White-box: seqs are never reused, so a leaked delivery count is invisible through
    # the interface; only the space it takes would show, much later.
    path = tmp_path / "store"
    with LmdbQueueStore(path) as store:
        store.declare_queue("q")
        store.declare_queue("dlq")
        store.append_batch(batch("q", "p", range(1, 5)))
        store.increment_delivery("q", [1, 2, 3, 4])
        store.delete_batch("q", [1, 2])
        store.move_to_dead_letter("q", [3, 4], "dlq")
        store.delete_batch("dlq", [1, 2])
        assert store.stats("q").depth == store.stats("dlq").depth == 0
    env = lmdb.open(str(path), max_dbs=5)
    try:
        with env.begin() as txn:
            for name in (b"messages", b"delivery"):
                assert txn.stat(env.open_db(name, txn=txn, create=False))["entries"] == 0, name
    finally:
        env.close()


def test_not_an_lmdb_file_raises_storage_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "store"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"not lmdb" * 4096)
    with pytest.raises(StorageCorrupt):
        LmdbQueueStore(path)


def test_foreign_lmdb_layout_raises_storage_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "store"
    env = lmdb.open(str(path), max_dbs=5)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"something-else/9", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StorageCorrupt, match="format"):
        LmdbQueueStore(path)
    # and the failed open released the environment: LMDB would refuse a second open.
    env = lmdb.open(str(path), max_dbs=5)
    env.close()


def test_missing_parent_directory_raises_storage_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError):
        LmdbQueueStore(tmp_path / "missing" / "store")


def test_map_size_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        LmdbQueueStore(tmp_path / "store", map_size=2 * MiB, max_map_size=1 * MiB)
    with pytest.raises(ValueError):
        LmdbQueueStore(tmp_path / "store", map_size=0)


def test_without_sync_no_fsyncs_are_counted_but_data_persists(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with LmdbQueueStore(path, sync=False) as store:
        store.declare_queue("q")
        store.append_batch(batch("q", "p", range(1, 4)))
        stats = store.stats("q")
        assert (stats.batches, stats.fsyncs) == (1, 0)
    with LmdbQueueStore(path) as store:
        assert [m.producer_seq for m in store.read_range("q", 0, ALL)] == [1, 2, 3]


def _mapped_rss(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process (from /proc/self/smaps)."""
    real, total, inside = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = len(head) >= 6 and head[5] == real
            elif inside and head and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_mapped_pages_are_released_as_a_backlog_passes(tmp_path: Path) -> None:
    """Reading and deleting 160 MiB of messages leaves at most about RELEASE_EVERY of the
    store file resident in this process (LMDB's map would otherwise keep every page it
    touched), and the data read back is intact."""
    from msgq_trio.storage import NewMessage
    from msgq_trio.storage.lmdb_store import RELEASE_EVERY

    body = bytes(range(256)) * 64  # 16 KiB
    n = 160 * MiB // len(body)
    with LmdbQueueStore(
        tmp_path / "store", map_size=512 * MiB, max_map_size=512 * MiB, sync=False
    ) as store:
        store.declare_queue("q")
        for lo in range(0, n, 500):
            store.append_batch(
                [NewMessage("q", "p", i + 1, body) for i in range(lo, min(n, lo + 500))]
            )
        data = tmp_path / "store" / "data.mdb"
        peak, start, seen = 0, 0, 0
        while chunk := store.read_range("q", start, 500):
            assert all(m.body == body for m in chunk)
            seen += len(chunk)
            store.delete_batch("q", [m.seq for m in chunk])
            start = chunk[-1].seq + 1
            peak = max(peak, _mapped_rss(data))
        assert seen == n
        assert peak <= RELEASE_EVERY + 16 * MiB, f"{peak >> 20} MiB of the map resident"


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs (needs root, as CI and the development machines run)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_full_file_system_is_storage_full_and_recovers(small_fs: Path) -> None:
    """A file system that fills before the map's bound gives StorageFull (the queue
    plugin answers queue-full), not an I/O error; nothing of the failed call is stored,
    and after deletes the store takes writes again. (The failed commit leaves room for
    the deletes here because it needed 100 KiB; LMDB needs some free space even to
    delete, which is why the plugin's default bound keeps a tenth of the disk free.)"""
    from msgq_trio.storage import NewMessage

    with LmdbQueueStore(small_fs / "s", map_size=MiB, max_map_size=64 * MiB) as store:
        store.declare_queue("q")
        stored = 0
        with pytest.raises(StorageFull, match="file system"):
            for i in range(10_000):
                store.append_batch(
                    [NewMessage("q", "p", i * 100 + k + 1, b"x" * 1000) for k in range(100)]
                )
                stored += 100
        assert stored > 0
        assert store.stats("q").depth == stored
        assert store.delete_batch("q", range(1, stored + 1)) == stored
        assert store.append_batch([NewMessage("q", "p", 10**6, b"again")]) == [stored + 1]
