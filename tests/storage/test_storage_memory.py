"""Runs the conformance suite on ``MemoryQueueStore`` and checks what is memory-specific."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conformance import Opener, QueueStoreConformance, closing_opener, msg
from msgq_trio.storage import MemoryQueueStore


class TestMemoryQueueStore(QueueStoreConformance):
    @pytest.fixture
    def open_store(self) -> Iterator[Opener]:
        with closing_opener(MemoryQueueStore) as opener:
            yield opener


def test_stores_without_a_path_share_nothing() -> None:
    with MemoryQueueStore() as first, MemoryQueueStore() as second:
        first.declare_queue("q")
        first.append_batch([msg("q", "p", 1)])
        assert second.queues() == []
    with MemoryQueueStore() as third:
        assert third.queues() == []
