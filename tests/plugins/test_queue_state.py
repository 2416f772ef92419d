"""The queue engine's state machine driven by plain calls, without trio: time is passed
in, the commit's waits come back as deadlines, and its store calls run here on the
memory store (``store_commit``), as the trio tasks (tasks.py) would run them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from msgq_trio.plugins.queue.commit import GroupCommit, store_commit
from msgq_trio.plugins.queue.model import DONE, Consumer, Msg, Queue, Waiter
from msgq_trio.plugins.queue.settings import QueueSettings
from msgq_trio.storage.memory import MemoryQueueStore

QUEUE_DIR = Path(__file__).resolve().parents[2] / "plugins" / "queue"


def runtime_imports(path: Path) -> set[str]:
    """Top-level modules ``path`` imports when it runs (not under ``TYPE_CHECKING``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


@pytest.mark.parametrize("name", ["state.py", "commit.py", "model.py"])
def test_state_machine_does_not_import_trio(name: str) -> None:
    """The state machine and its data never import trio: the tasks layer owns the clock
    and the waits."""
    assert "trio" not in runtime_imports(QUEUE_DIR / name)


class Machine:
    """A state machine with queue ``q``, producer ``p`` (high-water mark 0, as the store
    would answer) and the answers its waiters got."""

    def __init__(self, **settings: float) -> None:
        self.st = GroupCommit(QueueSettings(dir="unused", **settings))
        self.q: Queue = self.st.set_options("q", None)
        self.answers: list[Waiter] = []
        self.delivered: list[Msg] = []
        self.st.deliver = lambda _q, _c, msgs: self.delivered.extend(msgs)
        self.pseq = 0

    def put(self, *bodies: bytes) -> Waiter:
        items = []
        for body in bodies:
            self.pseq += 1
            items.append((self.pseq, b"B" + body))
        w = Waiter(len(items), self.answers.append)
        self.st.put(self.q, "p", items, w)
        p = self.st.producers[("q", "p")]
        if p.hwm is None:  # the first put waits for the store's mark (tasks.py reads it)
            self.st.producer_loaded(self.q, "p", p, 0)
        return w

    def commit(self, store: MemoryQueueStore, now: float, grace: bool) -> None:
        batch = self.st.choose(now, grace)
        assert not batch.idle
        self.st.committed(batch, store_commit(store, batch))


def test_messages_nobody_holds_are_committed_and_answered_stored() -> None:
    """Without a consumer the commit does not wait: it takes every pending message, the
    store gives them seqs, and the producer's ack 1 says stored."""
    m = Machine(ack_grace=0.05)
    w = m.put(b"a", b"b")
    assert not m.st.grace_wanted()
    with MemoryQueueStore() as store:
        store.declare_queue("q")
        m.commit(store, now=10.0, grace=False)
        assert [s.body for s in store.read_range("q", 0, 10)] == [b"Ba", b"Bb"]
    assert m.answers == [w] and w.stored == 2 and w.error is None
    assert sorted(m.q.mem) == [1, 2] and not m.st.pending
    assert m.st.counters["commits"] == 1 and m.st.counters["batch_max"] == 2


def test_young_delivery_holds_the_commit_until_a_deadline_and_its_ack_skips_the_write() -> None:
    """A message in flight for less than ``ack_grace`` holds the commit back until the
    deadline the state machine returns; acked before it, the message is never written,
    only its producer's mark goes to the store, with the next commit (so a resend is
    still a duplicate), and its producer is answered consumed once that mark is
    durable."""
    m = Machine(ack_grace=0.05)
    w = m.put(b"x")
    m.st.add_consumer(m.q, Consumer("c", "push", 10, 30.0))
    m.st.dispatch_pending(now=100.0)
    [msg] = m.delivered
    assert msg.sent == 100.0
    assert m.st.grace_wanted()
    assert m.st.grace_wake(100.01) == pytest.approx(100.05)
    held = m.st.choose(100.01, grace=True)
    assert held.idle and held.wake == pytest.approx(100.05) and not held.items
    assert list(m.st.pending) == [msg]  # still waiting for its ack or its grace
    m.st.ack(msg)
    assert msg.state == DONE and m.answers == [] and w.consumed == 0
    assert m.q.stats["writes_skipped"] == 1
    assert m.st.grace_wake(100.02) is None  # its ack 1 waits for the mark: commit now
    assert not m.st.pending  # the acked message left pending unwritten
    with MemoryQueueStore() as store:
        store.declare_queue("q")
        m.commit(store, now=100.02, grace=True)
        assert store.read_range("q", 0, 10) == []
        assert store.producer_state("q", "p") == 1
    assert m.answers == [w] and w.consumed == 1  # the mark is durable: ack 1
    assert m.st.stats(m.q)["marks_pending"] == 0
