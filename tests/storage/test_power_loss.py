"""Durability proven against a power loss, not inferred from the sync flag.

A SIGKILL cannot tell whether data was fsynced: the kernel's page cache outlives the
process. These tests put the store on ``powerloss_fs``, a FUSE file system that models a
disk with a volatile write cache (every write not yet fsynced, or written through an
``O_DSYNC`` fd, is lost at a power loss), so a store that skipped its sync loses data
here. The sync=False control test shows the model does catch that: the tests are not
vacuous. Removing the sync from ``LmdbQueueStore``'s commit makes the other tests fail.

The FUSE daemon runs as a separate process; a power loss kills it and detaches the mount,
a reboot mounts a new daemon over the durable images. Nothing here is a mock: the store is
the real ``LmdbQueueStore`` on the real kernel FUSE driver, the broker a real process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conformance import ALL
from msgq_trio.storage import LmdbQueueStore, NewMessage
from powerloss_fs import PowerLossDisk, fuse_missing

from msgq_trio import sync

QUEUES = ("orders", "audit")
PRODUCERS = ("p1", "p2")
STOP_TIMEOUT = 15.0


@pytest.fixture
def disk(short_tmp: Path) -> Iterator[PowerLossDisk]:
    """A mounted ``PowerLossDisk`` under ``short_tmp`` (detached at the end)."""
    why = fuse_missing()
    if why is not None:
        pytest.skip(f"FUSE cannot run here: {why}")
    with PowerLossDisk(short_tmp / "disk") as d:
        yield d
    # mfusepy logs an operation that raised anything but OSError (a bug in the model)
    # with its traceback; the kernel only saw EINVAL.
    log = d.daemon_log()
    assert "Traceback" not in log, log


# -- test 1: the store ------------------------------------------------------------------


@dataclass
class Durable:
    """What a store must hold: the effect of every write call that returned.

    ``messages``: queue -> seq -> (producer, producer_seq, body); ``marks``: (queue,
    producer) -> high-water mark; ``cursors`` and ``next_seqs`` per queue.
    """

    messages: dict[str, dict[int, tuple[str, int, bytes]]] = field(default_factory=dict)
    marks: dict[tuple[str, str], int] = field(default_factory=dict)
    cursors: dict[str, int] = field(default_factory=dict)
    next_seqs: dict[str, int] = field(default_factory=dict)


def observe(store: LmdbQueueStore) -> Durable:
    """Read everything ``Durable`` describes from ``store`` (queues it lacks are absent)."""
    found = Durable()
    for q in store.queues():
        found.messages[q] = {
            m.seq: (m.producer, m.producer_seq, m.body) for m in store.read_range(q, 0, ALL)
        }
        found.cursors[q] = store.cursor(q)
        found.next_seqs[q] = store.stats(q).next_seq
        for p in PRODUCERS:
            found.marks[q, p] = store.producer_state(q, p)
    return found


def differences(expected: Durable, found: Durable) -> list[str]:
    """Every way ``found`` fails to hold ``expected``, in words ([] if it holds it)."""
    out: list[str] = []
    for q, messages in expected.messages.items():
        if q not in found.messages:
            out.append(f"queue {q!r} is gone ({len(messages)} acked messages)")
            continue
        have = found.messages[q]
        missing = sorted(messages.keys() - have.keys())
        revived = sorted(have.keys() - messages.keys())
        changed = sorted(s for s in messages.keys() & have.keys() if messages[s] != have[s])
        if missing:
            out.append(f"{q}: {len(missing)} acked messages missing, seqs {missing[:8]}...")
        if revived:
            out.append(f"{q}: {len(revived)} deleted messages back, seqs {revived[:8]}...")
        if changed:
            out.append(f"{q}: messages {changed[:8]} changed")
        for what, want, got in (
            ("cursor", expected.cursors[q], found.cursors[q]),
            ("next_seq", expected.next_seqs[q], found.next_seqs[q]),
            *((f"mark of {p}", expected.marks[q, p], found.marks[q, p]) for p in PRODUCERS),
        ):
            if want != got:
                out.append(f"{q}: {what} is {got}, {want} was returned")
    return out


def write_round(store: LmdbQueueStore, expected: Durable, rng: random.Random, rnd: int) -> None:
    """Append and delete on ``store``; after each call returns, record in ``expected``
    what it made durable. Bodies of 0..6000 bytes make LMDB write leaf and overflow pages.
    """
    for q in QUEUES:
        if store.declare_queue(q):
            expected.messages[q] = {}
            expected.cursors[q] = 0
            expected.next_seqs[q] = 1
            for p in PRODUCERS:
                expected.marks[q, p] = 0
    for _ in range(3):
        items: list[NewMessage] = []
        for p in PRODUCERS:
            q = rng.choice(QUEUES)
            mark = expected.marks[q, p]
            if mark:  # a resend of the last stored one: must stay a duplicate
                items.append(NewMessage(q, p, mark, b"resend"))
            items += [
                NewMessage(q, p, mark + i, rng.randbytes(rng.randrange(6000))) for i in range(1, 11)
            ]
        seqs = store.append_batch(items)
        for item, seq in zip(items, seqs, strict=True):
            if item.body == b"resend":
                assert seq is None
                continue
            assert seq is not None
            expected.messages[item.queue][seq] = (item.producer, item.producer_seq, item.body)
            expected.marks[item.queue, item.producer] = item.producer_seq
            expected.next_seqs[item.queue] = seq + 1
    for q in QUEUES:
        oldest = sorted(expected.messages[q])[:7]
        cursor = rnd * 1000 + len(oldest)
        # one seq never assigned: ignored, as the contract says
        removed = store.delete_batch(q, [*oldest, 1 << 40], cursor=cursor)
        assert removed == len(oldest)
        for s in oldest:
            del expected.messages[q][s]
        expected.cursors[q] = cursor


def test_synced_store_keeps_every_returned_write_through_power_losses(
    disk: PowerLossDisk,
) -> None:
    """Three rounds of appends (with resends) and deletes (with cursors) on an
    ``LmdbQueueStore(sync=True)``, each ended by a power loss: after each reboot the
    store holds exactly what the returned calls wrote (messages, deletions, cursors,
    high-water marks, next seqs), and the next round continues on it."""
    path = disk.mountpoint / "store"
    rng = random.Random(20240611)
    expected = Durable()
    store = LmdbQueueStore(path, sync=True)
    try:
        for rnd in range(1, 4):
            write_round(store, expected, rng, rnd)
            # Closing first is as strict as a crash: LMDB's close only releases its
            # files, which makes nothing durable in the model (close is not fsync).
            store.close()
            disk.power_loss()
            disk.mount()
            store = LmdbQueueStore(path, sync=True)
            problems = differences(expected, observe(store))
            assert not problems, f"after power loss {rnd}:\n" + "\n".join(problems)
        assert sum(len(m) for m in expected.messages.values()) > 100
    finally:
        store.close()


def test_unsynced_store_loses_returned_writes_at_power_loss(disk: PowerLossDisk) -> None:
    """The control: the same writes with ``sync=False`` survive the store being closed
    and reopened (the process dying), and are lost at a power loss. So the model detects
    a missing sync, and the synced test above is not vacuous."""
    path = disk.mountpoint / "store"
    expected = Durable()
    store = LmdbQueueStore(path, sync=False)
    try:
        write_round(store, expected, random.Random(20240611), 1)
        store.close()
        store = LmdbQueueStore(path, sync=False)
        assert differences(expected, observe(store)) == []
        store.close()
        disk.power_loss()
        disk.mount()
        store = LmdbQueueStore(path, sync=False)
        problems = differences(expected, observe(store))
    finally:
        store.close()
    assert any("acked messages missing" in p or "is gone" in p for p in problems), problems


# -- test 2: the queue plugin behind a broker ---------------------------------------------


@dataclass
class QueueBroker:
    """Starts brokers running the queue plugin with its store on ``disk``."""

    disk: PowerLossDisk
    start: Callable[..., Any]  # start(path=None) -> conftest.BrokerProcess


@pytest.fixture
def queue_broker(
    disk: PowerLossDisk, broker_factory: Callable[..., Any], short_tmp: Path
) -> QueueBroker:
    """Brokers with ``[plugins.queue]`` on the power-loss disk (sync on: the default).

    Depends on ``disk`` before ``broker_factory`` so that the brokers are stopped before
    the disk is detached (fixtures are torn down in reverse order).
    """
    cfg = short_tmp / "queue.toml"
    store = disk.mountpoint / "store"
    cfg.write_text(f"[plugins.queue]\ndir = {json.dumps(str(store))}\n")

    def start(path: Path | None = None) -> Any:
        return broker_factory("--config", str(cfg), path=path)

    return QueueBroker(disk, start)


def plugin_pids(broker_pid: int) -> list[int]:
    """The plugin host processes the broker started (children of any of its threads:
    trio may spawn from a worker thread)."""
    pids: list[int] = []
    for task in Path(f"/proc/{broker_pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        for pid in children:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"msgq_trio.plugins.host" in cmdline:
                pids.append(int(pid))
    return pids


def wait_dead(pid: int) -> None:
    """Wait until ``pid`` (not our child: we cannot reap it) has exited."""
    deadline = time.monotonic() + STOP_TIMEOUT
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):  # exited; its files and maps are released
            return
        assert time.monotonic() < deadline, f"process {pid} still running (state {state})"
        time.sleep(0.01)


def test_acked_puts_survive_broker_kill_and_power_loss(queue_broker: QueueBroker) -> None:
    """Puts that got ack 1 ("stored") survive the machine losing power: the broker and
    its queue plugin are SIGKILLed, the disk loses its volatile cache, a new broker runs
    the plugin on the rebooted disk, and a consumer receives every acked message."""
    b = queue_broker.start()
    acked: list[str] = []
    with sync.connect(b.path, "producer") as c:
        q = c.queue("durable", producer="power-loss-producer")
        for n in range(5):
            bodies = [f"batch {n} message {i} " + "x" * (i * 97) for i in range(40)]
            assert q.put_many(bodies) == {"stored": 40, "consumed": 0, "duplicates": 0}
            acked += bodies
        for i in range(5):
            body = f"single {i}"
            assert q.put(body) == "stored"
            acked.append(body)
    plugins = plugin_pids(b.pid)
    assert len(plugins) == 1, plugins
    # The machine dies: broker and plugin at once (the plugin would otherwise notice the
    # broker's death and close its store first), then the disk's cache.
    b.send_signal(signal.SIGKILL)
    b.wait()
    os.kill(plugins[0], signal.SIGKILL)
    wait_dead(plugins[0])
    queue_broker.disk.power_loss()
    queue_broker.disk.mount()

    b = queue_broker.start(path=b.path)
    received: list[str] = []
    with sync.connect(b.path, "consumer") as c:
        q = c.queue("durable")
        while batch := q.fetch(100):
            received += [m.body for m in batch]
            q.ack(batch)
    got = set(received)
    missing = [m[:20] for m in acked if m not in got]
    assert not missing, f"{len(missing)} of {len(acked)} acked messages lost: {missing[:3]}"
    assert sorted(received) == sorted(acked)
