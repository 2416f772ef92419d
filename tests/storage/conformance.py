"""The conformance suite every ``QueueStore`` backend must pass, whatever it stores into.

Use it like trio's ``check_two_way_stream``: a backend's test module subclasses
``QueueStoreConformance`` as ``Test<Backend>`` and provides one fixture, ``open_store``,
returning an ``Opener`` -- a function from a path to an open store. Opening the same path
again after ``close()`` must see everything written before (a restart), so reopening is
tested on every backend. Every test here then runs on that backend; a test added here runs
on all of them.

``QueueStoreMachine`` is the model-based half: a hypothesis state machine that drives a
backend and a pure ``Model`` with the same random operations and compares them after
every step.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from msgq_trio.storage import (
    MAX_NAME_BYTES,
    NewMessage,
    QueueStats,
    QueueStore,
    StorageClosed,
    StorageError,
    StoredMessage,
    UnknownQueue,
)

Opener = Callable[[Path], QueueStore]


@contextlib.contextmanager
def closing_opener(factory: Opener) -> Iterator[Opener]:
    """Wrap ``factory`` so that every store it opened is closed when the block ends.

    A test that fails half-way must not leave an environment open: LMDB refuses to open
    it again in this process.
    """
    opened: list[QueueStore] = []

    def opener(path: Path) -> QueueStore:
        store = factory(path)
        opened.append(store)
        return store

    try:
        yield opener
    finally:
        for store in opened:
            store.close()


def msg(queue: str, producer: str, producer_seq: int, body: bytes = b"") -> NewMessage:
    return NewMessage(queue=queue, producer=producer, producer_seq=producer_seq, body=body)


def batch(queue: str, producer: str, producer_seqs: range, size: int = 8) -> list[NewMessage]:
    """Messages whose body names their producer_seq, so a mix-up shows in the body."""
    return [
        msg(queue, producer, n, f"{producer}:{n}".encode().ljust(size, b".")) for n in producer_seqs
    ]


def seqs_of(messages: list[StoredMessage]) -> list[int]:
    return [m.seq for m in messages]


ALL = 1 << 20  # a read_range limit larger than any queue in these tests


class QueueStoreConformance:
    """The shared tests; see the module docstring. Subclasses define ``open_store``."""

    @pytest.fixture
    def path(self, tmp_path: Path) -> Path:
        return tmp_path / "store"

    @pytest.fixture
    def store(self, open_store: Opener, path: Path) -> QueueStore:
        store = open_store(path)
        store.declare_queue("q")
        return store

    @staticmethod
    def reopen(store: QueueStore, open_store: Opener, path: Path) -> QueueStore:
        store.close()
        return open_store(path)

    # -- queues ---------------------------------------------------------------------

    def test_new_store_is_empty(self, open_store: Opener, path: Path) -> None:
        store = open_store(path)
        assert store.queues() == []

    def test_declare_queue_is_idempotent_and_durable(self, open_store: Opener, path: Path) -> None:
        store = open_store(path)
        assert store.declare_queue("b") is True
        assert store.declare_queue("a") is True
        assert store.declare_queue("b") is False
        assert store.queues() == ["a", "b"]
        store = self.reopen(store, open_store, path)
        assert store.queues() == ["a", "b"]
        assert store.declare_queue("a") is False
        assert store.stats("a") == QueueStats(0, 0, 1, 0, 0, 0, 0, 0, 0)

    def test_unicode_names(self, open_store: Opener, path: Path) -> None:
        # Names that are prefixes of each other, multi-byte, combining, NUL and
        # exactly at the byte limit: every one must be its own queue/producer.
        names = [
            "q",
            "q2",
            "ü",
            "u\u0308",  # the same as "ü" to a human, not to the store
            "队列",
            "🚀 rocket",
            "a\x00b",
            "é" * (MAX_NAME_BYTES // 2),  # 254 bytes of UTF-8
            "x" * MAX_NAME_BYTES,
        ]
        store = open_store(path)
        for name in names:
            assert store.declare_queue(name)
        items = [
            msg(name, producer, 1, f"{name}/{producer}".encode())
            for name in names
            for producer in names
        ]
        result = store.append_batch(items)
        assert None not in result
        store = self.reopen(store, open_store, path)
        assert store.queues() == sorted(names)
        for name in names:
            stored = store.read_range(name, 0, ALL)
            assert [(m.producer, m.body) for m in stored] == [
                (producer, f"{name}/{producer}".encode()) for producer in names
            ]
            assert all(store.producer_state(name, producer) == 1 for producer in names)

    @pytest.mark.parametrize(
        "name",
        ["", "x" * (MAX_NAME_BYTES + 1), "é" * (MAX_NAME_BYTES // 2 + 1), "\ud800"],
        ids=["empty", "too-long", "too-long-in-utf8", "lone-surrogate"],
    )
    def test_bad_names_are_rejected(self, store: QueueStore, name: str) -> None:
        with pytest.raises(ValueError):
            store.declare_queue(name)
        with pytest.raises(ValueError):
            store.append_batch([msg("q", name, 1)])
        with pytest.raises(ValueError):
            store.producer_state("q", name)
        assert store.queues() == ["q"]
        assert store.stats("q").depth == 0

    # -- append and read ------------------------------------------------------------

    def test_append_assigns_per_queue_seqs_and_reads_in_order(
        self, open_store: Opener, path: Path
    ) -> None:
        store = open_store(path)
        store.declare_queue("a")
        store.declare_queue("b")
        # "b" was declared last; appending to "a" afterwards writes keys below the
        # last one in the backend's key space as well as above it.
        assert store.append_batch([msg("b", "p", 1, b"b1")]) == [1]
        result = store.append_batch(
            [msg("a", "p", 1, b"a1"), msg("b", "p", 2, b"b2"), msg("a", "p", 2, b"a2")]
        )
        assert result == [1, 2, 2]
        assert store.read_range("a", 0, ALL) == [
            StoredMessage(1, "a", "p", 1, b"a1", 0),
            StoredMessage(2, "a", "p", 2, b"a2", 0),
        ]
        assert [m.body for m in store.read_range("b", 0, ALL)] == [b"b1", b"b2"]

    def test_read_range_start_and_limit(self, store: QueueStore) -> None:
        store.append_batch(batch("q", "p", range(1, 11)))
        assert seqs_of(store.read_range("q", 0, 3)) == [1, 2, 3]
        assert seqs_of(store.read_range("q", 4, 3)) == [4, 5, 6]
        assert seqs_of(store.read_range("q", 9, 100)) == [9, 10]
        assert store.read_range("q", 11, 100) == []
        assert store.read_range("q", 1, 0) == []
        store.delete_batch("q", [4, 5, 6])
        assert seqs_of(store.read_range("q", 4, 2)) == [7, 8]  # start inside a gap

    def test_bodies_round_trip_exactly(self, store: QueueStore) -> None:
        bodies = [b"", b"\x00", bytes(range(256)), os.urandom(1 << 20), os.urandom(1 << 20) + b"!"]
        assert store.append_batch(
            [msg("q", "p", n + 1, body) for n, body in enumerate(bodies)]
        ) == [
            1,
            2,
            3,
            4,
            5,
        ]
        assert [m.body for m in store.read_range("q", 0, ALL)] == bodies
        assert store.stats("q").bytes == sum(map(len, bodies))
        assert store.delete_batch("q", [4, 5]) == 2
        assert store.stats("q").bytes == 257

    def test_large_bodies_survive_reopen(self, open_store: Opener, path: Path) -> None:
        store = open_store(path)
        store.declare_queue("q")
        bodies = [os.urandom(1 << 20) for _ in range(4)]
        store.append_batch([msg("q", "p", n + 1, body) for n, body in enumerate(bodies)])
        store = self.reopen(store, open_store, path)
        assert [m.body for m in store.read_range("q", 0, ALL)] == bodies

    def test_empty_batch_does_nothing(self, store: QueueStore) -> None:
        assert store.append_batch([]) == []
        assert store.stats("q") == QueueStats(0, 0, 1, 0, 0, 0, 0, 0, 0)

    def test_group_commit_is_one_fsync_per_batch(self, store: QueueStore) -> None:
        store.append_batch(batch("q", "p", range(1, 501)))
        store.append_batch(batch("q", "p", range(501, 502)))
        stats = store.stats("q")
        assert (stats.appended, stats.batches, stats.fsyncs) == (501, 2, 2)

    def test_seqs_never_reused_across_delete_and_reopen(
        self, store: QueueStore, open_store: Opener, path: Path
    ) -> None:
        assert store.append_batch(batch("q", "p", range(1, 4))) == [1, 2, 3]
        assert store.delete_batch("q", [1, 2, 3]) == 3
        store = self.reopen(store, open_store, path)
        assert store.stats("q").next_seq == 4
        assert store.append_batch(batch("q", "p", range(4, 5))) == [4]
        assert seqs_of(store.read_range("q", 0, ALL)) == [4]

    # -- deduplication --------------------------------------------------------------

    def test_marks_raise_high_water_marks_durably_with_the_batch(
        self, store: QueueStore, open_store: Opener, path: Path
    ) -> None:
        """``marks`` raise (never lower) producers' marks in the batch's transaction:
        after it, a resend at or below the mark is a duplicate, also after a restart."""
        store.declare_queue("other")
        assert store.append_batch(batch("q", "p", range(1, 3))) == [1, 2]
        # p's 3 and 4 were consumed unstored; q2's 9 likewise; a lower mark changes nothing
        assert store.append_batch(
            [msg("q", "p", 5)], marks={("q", "p"): 4, ("q", "q2"): 9, ("other", "p"): 1}
        ) == [3]
        assert store.producer_state("q", "p") == 5  # the item's seq is above the mark
        assert store.append_batch([], marks={("q", "q2"): 3}) == []
        store = self.reopen(store, open_store, path)
        assert store.producer_state("q", "q2") == 9
        assert store.producer_state("other", "p") == 1
        assert store.append_batch([msg("q", "q2", 9), msg("q", "q2", 10)]) == [None, 4]
        assert seqs_of(store.read_range("q", 0, ALL)) == [1, 2, 3, 4]
        before = store.stats("q").fsyncs
        store.append_batch([], marks={("q", "p"): 2})  # below: nothing to write
        assert store.stats("q").fsyncs == before

    def test_marks_are_checked_before_anything_is_written(self, store: QueueStore) -> None:
        for bad, error in (
            ({("q", ""): 1}, ValueError),
            ({("q", "p"): 0}, ValueError),
            ({"q": 1}, TypeError),
        ):
            with pytest.raises(error):
                store.append_batch([msg("q", "p", 1)], marks=bad)  # type: ignore[arg-type]
        with pytest.raises(UnknownQueue):
            store.append_batch([msg("q", "p", 1)], marks={("nope", "p"): 1})
        assert store.producer_state("q", "p") == 0
        assert store.read_range("q", 0, ALL) == []

    def test_resends_are_skipped_and_reported(self, store: QueueStore) -> None:
        store.declare_queue("other")
        assert store.append_batch(batch("q", "p", range(1, 4))) == [1, 2, 3]
        result = store.append_batch(
            [
                msg("q", "p", 2),  # resend
                msg("q", "p", 3),  # resend
                msg("q", "p", 7),  # new; gaps are allowed
                msg("q", "p", 7),  # duplicate within the batch
                msg("q", "p", 5),  # below the mark just raised: a resend
                msg("q", "p2", 1),  # another producer has its own mark
                msg("other", "p", 1),  # so has the same producer on another queue
            ]
        )
        assert result == [None, None, 4, None, None, 5, 1]
        assert store.producer_state("q", "p") == 7
        assert store.producer_state("q", "p2") == 1
        assert store.producer_state("other", "p") == 1
        assert store.producer_state("q", "nobody") == 0
        assert [(m.producer, m.producer_seq) for m in store.read_range("q", 4, ALL)] == [
            ("p", 7),
            ("p2", 1),
        ]
        assert store.stats("q").duplicates == 4

    def test_dedup_survives_reopen_and_deletion(
        self, store: QueueStore, open_store: Opener, path: Path
    ) -> None:
        store.append_batch(batch("q", "p", range(1, 4)))
        store.delete_batch("q", [1, 2, 3])  # acked and gone; the mark must stay
        store = self.reopen(store, open_store, path)
        assert store.producer_state("q", "p") == 3
        assert store.append_batch(batch("q", "p", range(2, 6))) == [None, None, 4, 5]

    def test_batch_of_only_duplicates_writes_nothing(self, store: QueueStore) -> None:
        store.append_batch(batch("q", "p", range(1, 3)))
        before = store.stats("q")
        assert store.append_batch(batch("q", "p", range(1, 3))) == [None, None]
        after = store.stats("q")
        assert after == attrs.evolve(before, duplicates=2)  # in particular, no fsync

    # -- delete ---------------------------------------------------------------------

    def test_delete_batch(self, store: QueueStore, open_store: Opener, path: Path) -> None:
        store.append_batch(batch("q", "p", range(1, 6)))
        assert store.delete_batch("q", [2, 4, 4, 99, 0]) == 2
        assert seqs_of(store.read_range("q", 0, ALL)) == [1, 3, 5]
        assert store.delete_batch("q", [2]) == 0  # already gone
        assert store.delete_batch("q", []) == 0
        stats = store.stats("q")
        assert (stats.depth, stats.deleted, stats.unknown_deleted, stats.fsyncs) == (3, 2, 3, 2)
        store = self.reopen(store, open_store, path)
        assert seqs_of(store.read_range("q", 0, ALL)) == [1, 3, 5]
        assert store.stats("q").depth == 3

    def test_cursor_is_set_with_deletes_atomically_and_durably(
        self, store: QueueStore, open_store: Opener, path: Path
    ) -> None:
        """The cursor (the pipe plugin's consumed offset) is 0 until set, is set by the
        same commit as the deletes it goes with, is per queue, survives a reopen, and a
        call that changes nothing costs no fsync."""
        store.declare_queue("other")
        assert store.cursor("q") == 0
        store.append_batch(batch("q", "p", range(1, 5)))
        fsyncs = store.stats("q").fsyncs
        assert store.delete_batch("q", [1, 2], cursor=1000) == 2
        assert store.cursor("q") == 1000 and store.cursor("other") == 0
        assert store.stats("q").fsyncs == fsyncs + 1  # one commit for both
        # A cursor-only change is a commit of its own; the same cursor again is nothing.
        assert store.delete_batch("q", [], cursor=1500) == 0
        assert store.stats("q").fsyncs == fsyncs + 2
        assert store.delete_batch("q", [], cursor=1500) == 0
        assert store.delete_batch("q", [99]) == 0  # no cursor given: unchanged
        assert store.stats("q").fsyncs == fsyncs + 2
        assert store.delete_batch("q", [3], cursor=(1 << 64) - 1) == 1
        store = self.reopen(store, open_store, path)
        assert store.cursor("q") == (1 << 64) - 1 and store.cursor("other") == 0
        assert seqs_of(store.read_range("q", 0, ALL)) == [4]
        assert store.delete_batch("q", [], cursor=7) == 0  # may go back: not interpreted
        assert store.cursor("q") == 7

    def test_bad_cursor_writes_nothing(self, store: QueueStore) -> None:
        store.append_batch(batch("q", "p", range(1, 3)))
        for bad, error in (
            (-1, ValueError),
            (1 << 64, ValueError),
            ("1", TypeError),
            (True, TypeError),
        ):
            with pytest.raises(error):
                store.delete_batch("q", [1], cursor=bad)  # type: ignore[arg-type]
        assert seqs_of(store.read_range("q", 0, ALL)) == [1, 2]
        assert store.cursor("q") == 0
        with pytest.raises(UnknownQueue):
            store.cursor("nope")
        with pytest.raises(UnknownQueue):
            store.delete_batch("nope", [], cursor=1)

    # -- delivery counts and dead letters -------------------------------------------

    def test_delivery_counts(self, store: QueueStore, open_store: Opener, path: Path) -> None:
        store.append_batch(batch("q", "p", range(1, 4)))
        assert store.increment_delivery("q", [1, 1, 2, 42]) == {1: 1, 2: 1}
        assert store.increment_delivery("q", [1]) == {1: 2}
        assert store.increment_delivery("q", [42]) == {}
        store = self.reopen(store, open_store, path)
        assert [m.delivery_count for m in store.read_range("q", 0, ALL)] == [2, 1, 0]
        store.delete_batch("q", [1])
        assert store.increment_delivery("q", [1]) == {}
        assert store.increment_delivery("q", [2, 3]) == {2: 2, 3: 1}

    def test_move_to_dead_letter(self, store: QueueStore, open_store: Opener, path: Path) -> None:
        store.declare_queue("dlq")
        store.append_batch(batch("dlq", "x", range(1, 2)))  # dlq already holds seq 1
        store.append_batch(batch("q", "p", range(1, 5)))
        store.increment_delivery("q", [2, 4])
        store.increment_delivery("q", [4])
        assert store.move_to_dead_letter("q", [4, 2, 99], "dlq") == {2: 2, 4: 3}
        assert seqs_of(store.read_range("q", 0, ALL)) == [1, 3]
        store = self.reopen(store, open_store, path)
        moved = store.read_range("dlq", 2, ALL)
        assert [(m.seq, m.queue, m.producer, m.producer_seq, m.delivery_count) for m in moved] == [
            (2, "dlq", "p", 2, 1),
            (3, "dlq", "p", 4, 2),
        ]
        assert [m.body for m in moved] == [b"p:2.....", b"p:4....."]
        assert store.producer_state("dlq", "p") == 0  # moves bypass deduplication
        assert store.producer_state("q", "p") == 4  # and the source keeps its mark
        assert (store.stats("q").depth, store.stats("dlq").depth) == (2, 3)
        assert store.stats("dlq").bytes == 24

    def test_move_to_dead_letter_counters(self, store: QueueStore) -> None:
        store.declare_queue("dlq")
        store.append_batch(batch("q", "p", range(1, 4)))
        assert store.move_to_dead_letter("q", [1, 3], "dlq") == {1: 1, 3: 2}
        assert store.move_to_dead_letter("q", [1, 3], "dlq") == {}
        src, dlq = store.stats("q"), store.stats("dlq")
        assert (src.depth, src.appended, src.deleted, src.fsyncs) == (1, 3, 2, 2)
        assert (dlq.depth, dlq.appended, dlq.deleted, dlq.batches, dlq.fsyncs) == (2, 2, 0, 0, 1)

    def test_move_to_dead_letter_rejects_bad_targets(self, store: QueueStore) -> None:
        store.append_batch(batch("q", "p", range(1, 3)))
        with pytest.raises(ValueError):
            store.move_to_dead_letter("q", [1], "q")
        with pytest.raises(UnknownQueue):
            store.move_to_dead_letter("q", [1], "nowhere")
        assert seqs_of(store.read_range("q", 0, ALL)) == [1, 2]

    # -- stats ----------------------------------------------------------------------

    def test_stats_durable_and_since_open_parts(
        self, store: QueueStore, open_store: Opener, path: Path
    ) -> None:
        store.append_batch(batch("q", "p", range(1, 4), size=10))
        store.append_batch(batch("q", "p", range(3, 5), size=10))
        store.delete_batch("q", [1, 7])
        store.increment_delivery("q", [2])
        assert store.stats("q") == QueueStats(
            depth=3,
            bytes=30,
            next_seq=5,
            appended=4,
            duplicates=1,
            deleted=1,
            unknown_deleted=1,
            batches=2,
            fsyncs=4,
        )
        store = self.reopen(store, open_store, path)
        assert store.stats("q") == QueueStats(3, 30, 5, 0, 0, 0, 0, 0, 0)

    # -- errors ---------------------------------------------------------------------

    def test_unknown_queue(self, store: QueueStore) -> None:
        calls: list[Callable[[], object]] = [
            lambda: store.append_batch([msg("q", "p", 1), msg("nope", "p", 1)]),
            lambda: store.delete_batch("nope", [1]),
            lambda: store.read_range("nope", 0, 1),
            lambda: store.increment_delivery("nope", [1]),
            lambda: store.move_to_dead_letter("nope", [1], "q"),
            lambda: store.producer_state("nope", "p"),
            lambda: store.stats("nope"),
        ]
        for call in calls:
            with pytest.raises(UnknownQueue):
                call()
        # The batch naming an unknown queue stored none of its items.
        assert store.stats("q").next_seq == 1
        assert store.producer_state("q", "p") == 0

    @pytest.mark.parametrize(
        ("bad", "error"),
        [
            (msg("q", "p", 0), ValueError),
            (msg("q", "p", -1), ValueError),
            (msg("q", "p", 1 << 64), ValueError),
            (msg("q", "p", True), TypeError),
            (NewMessage("q", "p", 1, "text"), TypeError),  # type: ignore[arg-type]
            (NewMessage("q", b"p", 1, b""), TypeError),  # type: ignore[arg-type]
            (("q", "p", 1, b""), TypeError),
        ],
        ids=["zero", "negative", "too-big", "bool", "str-body", "bytes-producer", "tuple"],
    )
    def test_malformed_item_fails_whole_batch(
        self, store: QueueStore, bad: NewMessage, error: type[Exception]
    ) -> None:
        with pytest.raises(error):
            store.append_batch([msg("q", "p", 1), bad])
        assert store.stats("q").next_seq == 1
        assert store.producer_state("q", "p") == 0

    def test_bad_seq_arguments(self, store: QueueStore) -> None:
        store.append_batch(batch("q", "p", range(1, 3)))
        store.declare_queue("dlq")
        for call in (
            lambda seqs: store.delete_batch("q", seqs),
            lambda seqs: store.increment_delivery("q", seqs),
            lambda seqs: store.move_to_dead_letter("q", seqs, "dlq"),
        ):
            with pytest.raises(ValueError):
                call([1, -1])
            with pytest.raises(ValueError):
                call([1, 1 << 64])
            with pytest.raises(TypeError):
                call([1, "2"])
        with pytest.raises(ValueError):
            store.read_range("q", -1, 1)
        with pytest.raises(ValueError):
            store.read_range("q", 0, -1)
        # None of the failed calls touched seq 1.
        assert store.read_range("q", 0, ALL)[0] == StoredMessage(1, "q", "p", 1, b"p:1.....", 0)

    def test_closed_store_raises(self, store: QueueStore) -> None:
        store.declare_queue("dlq")
        store.close()
        store.close()  # idempotent
        calls: list[Callable[[], object]] = [
            lambda: store.declare_queue("q"),
            store.queues,
            lambda: store.append_batch([msg("q", "p", 1)]),
            lambda: store.append_batch([]),
            lambda: store.delete_batch("q", [1]),
            lambda: store.read_range("q", 0, 1),
            lambda: store.increment_delivery("q", [1]),
            lambda: store.move_to_dead_letter("q", [1], "dlq"),
            lambda: store.producer_state("q", "p"),
            lambda: store.stats("q"),
            lambda: store.cursor("q"),
            lambda: store.delete_batch("q", [], cursor=1),
        ]
        for call in calls:
            with pytest.raises(StorageClosed):
                call()

    def test_context_manager_closes(self, open_store: Opener, path: Path) -> None:
        with open_store(path) as store:
            store.declare_queue("q")
        with pytest.raises(StorageClosed):
            store.queues()
        with open_store(path) as store:  # closed, so it may be opened again
            assert store.queues() == ["q"]

    def test_path_cannot_be_open_twice(
        self, store: QueueStore, open_store: Opener, path: Path
    ) -> None:
        with pytest.raises(StorageError) as info:
            open_store(path)
        assert not isinstance(info.value, StorageClosed)
        store.close()
        assert open_store(path).queues() == ["q"]

    def test_calls_from_several_threads_are_serialised(self, store: QueueStore) -> None:
        def produce(producer: str) -> list[int]:
            seqs: list[int] = []
            for n in range(0, 100, 5):
                result = store.append_batch(batch("q", producer, range(n + 1, n + 6)))
                seqs += [seq for seq in result if seq is not None]
            return seqs

        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(produce, ["t0", "t1", "t2", "t3"]))
        for seqs in results:
            assert seqs == sorted(seqs)
        assert sorted(itertools.chain(*results)) == list(range(1, 401))
        assert seqs_of(store.read_range("q", 0, ALL)) == list(range(1, 401))
        assert all(store.producer_state("q", f"t{n}") == 100 for n in range(4))

    # -- model-based ----------------------------------------------------------------

    def test_agrees_with_model(self, open_store: Opener, tmp_path: Path) -> None:
        paths = (tmp_path / f"machine-{n}" for n in itertools.count())
        run_state_machine_as_test(
            lambda: QueueStoreMachine(open_store, next(paths)),
            settings=settings(
                max_examples=60,
                stateful_step_count=30,
                deadline=None,  # fsync latency varies
                database=None,  # no .hypothesis directory in the repository
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )


# -- the model ------------------------------------------------------------------------

NOTHING_SINCE_OPEN = QueueStats(0, 0, 0, 0, 0, 0, 0, 0, 0)


@attrs.define
class ModelQueue:
    next_seq: int = 1
    messages: dict[int, StoredMessage] = attrs.Factory(dict)
    marks: dict[str, int] = attrs.Factory(dict)
    cursor: int = 0
    since_open: QueueStats = NOTHING_SINCE_OPEN

    def count(self, **deltas: int) -> None:
        self.since_open = attrs.evolve(
            self.since_open, **{k: getattr(self.since_open, k) + v for k, v in deltas.items()}
        )

    def stats(self) -> QueueStats:
        return attrs.evolve(
            self.since_open,
            depth=len(self.messages),
            bytes=sum(len(m.body) for m in self.messages.values()),
            next_seq=self.next_seq,
        )


class Model:
    """What a QueueStore must do, with no storage concerns at all."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.queues = {name: ModelQueue() for name in names}

    def append(self, items: list[NewMessage]) -> list[int | None]:
        result: list[int | None] = []
        touched: set[str] = set()
        for item in items:
            q = self.queues[item.queue]
            if item.producer_seq <= q.marks.get(item.producer, 0):
                q.count(duplicates=1)
                result.append(None)
                continue
            seq = q.next_seq
            q.next_seq += 1
            q.marks[item.producer] = item.producer_seq
            q.messages[seq] = StoredMessage(
                seq, item.queue, item.producer, item.producer_seq, item.body, 0
            )
            q.count(appended=1)
            touched.add(item.queue)
            result.append(seq)
        for name in touched:
            self.queues[name].count(batches=1, fsyncs=1)
        return result

    def delete(self, queue: str, seqs: list[int], cursor: int | None = None) -> int:
        q = self.queues[queue]
        wanted = set(seqs)
        removed = [seq for seq in wanted if q.messages.pop(seq, None) is not None]
        q.count(deleted=len(removed), unknown_deleted=len(wanted) - len(removed))
        moved = cursor is not None and cursor != q.cursor
        if cursor is not None:
            q.cursor = cursor
        if removed or moved:
            q.count(fsyncs=1)
        return len(removed)

    def increment(self, queue: str, seqs: list[int]) -> dict[int, int]:
        q = self.queues[queue]
        counts = {}
        for seq in set(seqs) & set(q.messages):
            m = q.messages[seq]
            q.messages[seq] = attrs.evolve(m, delivery_count=m.delivery_count + 1)
            counts[seq] = m.delivery_count + 1
        if counts:
            q.count(fsyncs=1)
        return counts

    def dead_letter(self, queue: str, seqs: list[int], dlq_name: str) -> dict[int, int]:
        src, dlq = self.queues[queue], self.queues[dlq_name]
        moved = {}
        for seq in sorted(set(seqs) & set(src.messages)):
            m = src.messages.pop(seq)
            moved[seq] = dlq.next_seq
            dlq.messages[dlq.next_seq] = attrs.evolve(m, seq=dlq.next_seq, queue=dlq_name)
            dlq.next_seq += 1
        if moved:
            src.count(deleted=len(moved), fsyncs=1)
            dlq.count(appended=len(moved), fsyncs=1)
        return moved

    def read(self, queue: str, start: int, limit: int) -> list[StoredMessage]:
        messages = self.queues[queue].messages
        return [messages[seq] for seq in sorted(messages) if seq >= start][:limit]

    def reopen(self) -> None:
        for q in self.queues.values():
            q.since_open = NOTHING_SINCE_OPEN


QUEUES = ("q", "dead letters", "ünïcødé ✉")
PRODUCERS = ("a", "ab", "生产者")


class QueueStoreMachine(RuleBasedStateMachine):
    """Random operations on a backend and on ``Model``; they must agree after each step.

    Producer seqs come from a small range so that resends, in-batch duplicates and gaps
    are common; seqs for delete/increment/dead-letter are mostly stored ones, with some
    that miss.
    """

    def __init__(self, open_store: Opener, path: Path) -> None:
        super().__init__()
        self.open_store = open_store
        self.path = path
        self.store = open_store(path)
        self.model = Model(QUEUES)

    @initialize()
    def declare(self) -> None:
        for name in QUEUES:
            assert self.store.declare_queue(name)

    def teardown(self) -> None:
        self.store.close()

    def _seqs(self, data: st.DataObject, queue: str) -> list[int]:
        q = self.model.queues[queue]
        anything = st.integers(0, q.next_seq + 1)
        # Mostly stored seqs, so that operations compose (incremented, then moved).
        element = st.sampled_from(sorted(q.messages)) | anything if q.messages else anything
        return data.draw(st.lists(element, max_size=6), label="seqs")

    @rule(
        items=st.lists(
            st.builds(
                NewMessage,
                queue=st.sampled_from(QUEUES),
                producer=st.sampled_from(PRODUCERS),
                producer_seq=st.integers(1, 12),
                body=st.binary(max_size=40),
            ),
            max_size=6,
        )
    )
    def append(self, items: list[NewMessage]) -> None:
        assert self.store.append_batch(items) == self.model.append(items)

    @rule(data=st.data(), queue=st.sampled_from(QUEUES))
    def delete(self, data: st.DataObject, queue: str) -> None:
        seqs = self._seqs(data, queue)
        cursor = data.draw(st.none() | st.integers(0, 3), label="cursor")
        got = self.store.delete_batch(queue, seqs, cursor=cursor)
        assert got == self.model.delete(queue, seqs, cursor)

    @rule(data=st.data(), queue=st.sampled_from(QUEUES))
    def increment(self, data: st.DataObject, queue: str) -> None:
        seqs = self._seqs(data, queue)
        assert self.store.increment_delivery(queue, seqs) == self.model.increment(queue, seqs)

    @rule(data=st.data(), pair=st.permutations(QUEUES))
    def dead_letter(self, data: st.DataObject, pair: list[str]) -> None:
        queue, dlq_name = pair[0], pair[1]
        seqs = self._seqs(data, queue)
        got = self.store.move_to_dead_letter(queue, seqs, dlq_name)
        assert got == self.model.dead_letter(queue, seqs, dlq_name)

    @rule(data=st.data(), queue=st.sampled_from(QUEUES), limit=st.integers(0, 4))
    def read(self, data: st.DataObject, queue: str, limit: int) -> None:
        start = data.draw(st.integers(0, self.model.queues[queue].next_seq + 1), label="start")
        assert self.store.read_range(queue, start, limit) == self.model.read(queue, start, limit)

    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = self.open_store(self.path)
        self.model.reopen()

    @invariant()
    def agrees(self) -> None:
        assert self.store.queues() == sorted(QUEUES)
        for name, q in self.model.queues.items():
            assert self.store.stats(name) == q.stats()
            assert self.store.read_range(name, 0, ALL) == self.model.read(name, 0, ALL)
            assert self.store.cursor(name) == q.cursor
            for producer in PRODUCERS:
                assert self.store.producer_state(name, producer) == q.marks.get(producer, 0)
