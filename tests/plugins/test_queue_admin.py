"""Operating queues: ``msgq-trio queue ls|stats|peek|purge`` as a subprocess against real
broker processes running the queue plugin, the plugin's ``/metrics`` endpoint over real
HTTP, and the purge's races in-process on the memory store (each taken on purpose)."""

from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import cbor2
import pytest
import trio
from msgq_trio.plugins.queue.admin import peek
from msgq_trio.plugins.queue.metrics import AgeTracker
from msgq_trio.plugins.queue.model import Consumer, Msg, Queue, Waiter
from msgq_trio.plugins.queue.settings import parse_settings
from msgq_trio.plugins.queue.tasks import Engine
from plugin_helpers import engine_on_memory_store, eventually
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

import msgq_trio

Start = Callable[..., Any]

#: Small memory bounds: a queue pages to disk past 100 messages.
PAGING = {"resident_messages": 200, "resident_bytes": 1 << 20}


def cli(sock: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m msgq_trio queue --socket SOCK ARGV`` (blocking: run it in a thread)."""
    r = subprocess.run(
        [sys.executable, "-m", "msgq_trio", "queue", "--socket", str(sock), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert "Traceback" not in r.stderr, r.stderr
    return r


async def acli(sock: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return await trio.to_thread.run_sync(lambda: cli(sock, *argv))


async def acli_json(sock: Path, *argv: str) -> Any:
    r = await acli(sock, *argv, "--json")
    assert r.returncode == 0, r
    return json.loads(r.stdout)


def body(i: int) -> str:
    """Message ``i``'s body: all the same size, so bytes divide evenly."""
    return f"m{i:04d}"


async def fill_paged(bus: msgq_trio.Bus, n_memory: int = 200, n_total: int = 1000) -> None:
    """Put ``n_total`` messages into ``q``: the first ``n_memory`` (the memory bound of
    ``PAGING``) in one put, the rest in puts of 100, which go to disk only."""
    q = bus.queue("q", producer="p1")
    await q.put_many([body(i) for i in range(n_memory)])
    for lo in range(n_memory, n_total, 100):
        await q.put_many([body(i) for i in range(lo, min(lo + 100, n_total))])
    st = await q.stats()
    assert (st["depth"], st["resident"], st["paging"]) == (n_total, n_memory, True), st


# -- the command line -------------------------------------------------------------------------
async def test_ls_stats_peek_and_peek_consumes_nothing(queue_broker: Start) -> None:
    """``ls``, ``stats`` and ``peek`` as tables and as JSON agree with the client's stats;
    peek lists ready messages only (not the ones in flight), with producer, seqs,
    deliveries, size and the decoded body (shortened in the table), and consumes nothing:
    depth and deliveries stay, and a consumer then gets every message. An unknown queue
    is the plugin's bad-request, in one line."""
    b = queue_broker({"q": {}, "empty": {}, "sql": {"bind": "SQLWriter"}})
    sock = b.path
    long_text = "y" * 100
    async with msgq_trio.connect(sock, "p") as p:
        q = p.queue("q", producer="p1")
        await q.put_many([{"n": i, "text": long_text} for i in range(30)])
        held = await q.fetch(3, ack_timeout=600)
        assert [m.body["n"] for m in held] == [0, 1, 2]
        before = await q.stats()

        rows = {r["queue"]: r for r in await acli_json(sock, "ls")}
        assert set(rows) == {"q", "empty", "sql"}
        for key in ("depth", "bytes", "ready", "in_flight", "consumers", "paging"):
            assert rows["q"][key] == before[key], key
        assert (rows["q"]["depth"], rows["q"]["ready"], rows["q"]["in_flight"]) == (30, 27, 3)
        assert rows["empty"]["depth"] == 0

        r = await acli(sock, "ls")
        assert r.returncode == 0, r
        header, *lines = r.stdout.splitlines()
        assert header.split() == [
            "QUEUE",
            "DEPTH",
            "BYTES",
            "READY",
            "IN",
            "FLIGHT",
            "CONSUMERS",
            "PAGING",
        ]
        table = {ln.split()[0]: ln.split() for ln in lines}
        assert table["q"][1] == "30" and table["q"][-4:] == ["27", "3", "0", "no"]
        assert table["empty"][1] == "0"

        r = await acli(sock, "stats", "q")
        assert r.returncode == 0, r
        assert {"depth: 30", "ready: 27", "in_flight: 3", "paging: false", "queue: q"} <= set(
            r.stdout.splitlines()
        )
        st = await acli_json(sock, "stats", "q")  # --json after the subcommand
        assert st["depth"] == 30 and st["bytes"] == before["bytes"]

        peeked = await acli_json(sock, "peek", "q", "5")
        assert [m["seq"] for m in peeked] == [4, 5, 6, 7, 8]
        assert [m["producer_seq"] for m in peeked] == [4, 5, 6, 7, 8]
        for i, m in zip(range(3, 8), peeked, strict=True):
            want = {"n": i, "text": long_text}
            assert (m["producer"], m["deliveries"], m["kind"]) == ("p1", 0, "body")
            assert m["body"] == want
            assert base64.b64decode(m["cbor"]) == cbor2.dumps(want)
            assert m["size"] == len(cbor2.dumps(want))

        r = await acli(sock, "peek", "q")  # a table, 10 by default
        assert r.returncode == 0, r
        header, *lines = r.stdout.splitlines()
        assert header.split() == [
            "SEQ",
            "PRODUCER",
            "PRODUCER",
            "SEQ",
            "DELIVERIES",
            "SIZE",
            "KIND",
            "BODY",
        ]
        assert len(lines) == 10
        first = lines[0].split()
        assert first[:3] == ["4", "p1", "4"] and first[5] == "body"
        assert '{"n": 3, "text": "yyy' in lines[0] and lines[0].endswith("...")

        after = await q.stats()
        assert (after["depth"], after["ready"], after["in_flight"], after["delivered"]) == (
            30,
            27,
            3,
            before["delivered"],
        )
        assert await q.ack(held) == 3
        rest = await q.fetch(100)
        assert [m.body["n"] for m in rest] == list(range(3, 30))
        assert [m.deliveries for m in rest] == [1] * 27
        assert await q.ack(rest) == 27

        # A bound queue holds the group's requests and messages (no member: stored).
        assert await p.call("SQLWriter", "write", {"acct": 1}) == {"queued": "sql"}
        await p.send("SQLWriter", {"note": "one-way"})

        async def two_stored() -> bool:
            return bool((await p.queue("sql").stats())["depth"] == 2)

        await eventually(two_stored)
        peeked = await acli_json(sock, "peek", "sql")
        assert [(m["kind"], m["body"], m["attachments"]) for m in peeked] == [
            ("request", ["write", {"acct": 1}], 0),
            ("message", {"note": "one-way"}, 0),
        ]

        for argv in (("stats", "nosuch"), ("peek", "nosuch"), ("purge", "nosuch", "--yes")):
            r = await acli(sock, *argv)
            assert r.returncode == 1, r
            assert r.stderr == "error: bad-request: unknown queue 'nosuch': declare it first\n"
            assert r.stdout == ""


async def test_purge_removes_memory_and_disk_but_not_in_flight(queue_broker: Start) -> None:
    """1,000 messages, 200 in memory and 800 only on disk, 5 held by a fetcher: purge
    without --yes refuses and changes nothing; with --yes it removes 995 (logged at
    WARNING with the caller), leaves the 5 (their acks work), the queue leaves paging
    mode, and a message put afterwards is delivered, alone."""
    b = queue_broker({"q": {}}, **PAGING)
    async with msgq_trio.connect(b.path, "p") as p:
        await fill_paged(p)
        q = p.queue("q")
        held = await q.fetch(5, ack_timeout=600)
        assert [m.body for m in held] == [body(i) for i in range(5)]
        full = await q.stats()

        r = await acli(b.path, "purge", "q")
        assert r.returncode == 2 and r.stdout == "", r
        assert "without --yes" in r.stderr and "995 ready" in r.stderr, r.stderr
        assert len(r.stderr.splitlines()) == 1
        assert (await q.stats())["depth"] == 1000

        # peek reads the disk-only backlog too (in seq order, ready ones only)
        peeked = await acli_json(b.path, "peek", "q", "1000")
        assert [m["body"] for m in peeked] == [body(i) for i in range(5, 1000)]

        r = await acli(b.path, "purge", "q", "--yes")
        assert r.returncode == 0, r
        assert r.stdout == "purged 995 messages from queue 'q'\n"
        assert re.search(
            r"WARNING .*queue q: purged 995 messages for l\.\d+ "
            r"\(msgq-trio-queue\)",
            b.log(),
        ), b.log()[-3000:]

        st = await q.stats()
        assert (st["depth"], st["in_flight"], st["ready"], st["resident"]) == (5, 5, 0, 5), st
        assert st["bytes"] == full["bytes"] * 5 // 1000, st
        assert st["paging"] is False, st
        assert await acli_json(b.path, "peek", "q") == []

        assert await q.ack(held) == 5
        assert (await q.stats())["depth"] == 0
        assert await q.put("after") == "stored"
        got = await q.fetch(1000)
        assert [m.body for m in got] == ["after"]
        assert await q.ack(got) == 1
        assert (await q.stats())["depth"] == 0


async def test_purge_is_durable_when_answered(queue_broker: Start) -> None:
    """After purge answered, a broker SIGKILLed at once (its fetcher still connected: no
    later event makes the plugin commit anything) and restarted on the same store finds
    only the 5 messages that were in flight: the removals, from memory and from disk,
    were committed before the answer."""
    b = queue_broker({"q": {}}, **PAGING)
    async with msgq_trio.connect(b.path, "p") as p:
        await fill_paged(p)
        held = await p.queue("q").fetch(5, ack_timeout=600)
        assert len(held) == 5
        assert await acli_json(b.path, "purge", "q", "--yes") == {"queue": "q", "purged": 995}
        b.kill()
    b2 = queue_broker({"q": {}}, path=b.path, **PAGING)
    async with msgq_trio.connect(b2.path, "c") as c:
        q = c.queue("q")
        assert (await q.stats())["depth"] == 5
        got = await q.fetch(1000)
        assert [m.body for m in got] == [body(i) for i in range(5)]
        assert await q.ack(got) == 5


async def test_cli_without_queue_plugin_fails_in_one_line(broker: Any) -> None:
    """A broker without the queue plugin: every subcommand exits 1 with one line."""
    for argv in (("ls",), ("stats", "q"), ("peek", "q", "--json"), ("purge", "q", "--yes")):
        r = await acli(broker.path, *argv)
        assert r.returncode == 1, r
        assert r.stdout == ""
        assert r.stderr == (
            "error: no queue plugin is running: nobody answers on group "
            "'msgq-queue' (enable it with a [plugins.queue] table)\n"
        ), r


# -- metrics ----------------------------------------------------------------------------------
def scrape(address: str) -> dict[str, Any]:
    """GET http://ADDRESS/metrics over real HTTP, parsed with prometheus_client's parser:
    family name -> family."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams: dict[str, Any], name: str, sample_name: str | None = None, **labels: str) -> float:
    """The value of the one sample ``sample_name`` (default: ``name``) of family ``name``
    whose labels include ``labels``."""
    found = [
        s.value
        for s in fams[name].samples
        if s.name == (sample_name or name) and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, f"{name} {labels}: {fams[name].samples}"
    return float(found[0])


GAUGES = ("depth", "bytes", "ready", "in_flight", "consumers", "resident")
COUNTERS = ("redelivered", "dead_lettered", "writes_skipped", "paged_in")


async def test_metrics_endpoint_matches_stats(queue_broker: Start) -> None:
    """``metrics = "127.0.0.1:0"``: the plugin logs its address and serves each queue's
    figures, equal to its ``stats``, the store counters and a commit histogram whose
    count is the commits; the oldest message's age is at least the time since its put
    was answered, 0 for an empty queue."""
    b = queue_broker({"q": {}, "idle": {}}, metrics="127.0.0.1:0", **PAGING)
    m = re.search(
        r"queue plugin: metrics on http://(127\.0\.0\.1:\d+)/metrics",
        b.log_with("queue plugin: metrics on"),  # the broker's log thread may lag
    )
    assert m, b.log()[-3000:]
    address = m.group(1)
    async with msgq_trio.connect(b.path, "p") as p:
        await fill_paged(p, 200, 300)
        q = p.queue("q")
        held = await q.fetch(4, ack_timeout=600)
        assert len(held) == 4
        # Every message was stored before its put was answered, so at least this long
        # before any scrape below (a lower bound: only a wrong age can fail it).
        await trio.sleep(1.2)

        async def agree() -> tuple[dict[str, Any], dict[str, Any]] | None:
            fams = await trio.to_thread.run_sync(scrape, address)
            st = await q.stats()
            ok = (
                all(sample(fams, f"msgq_queue_{k}", queue="q") == st[k] for k in GAUGES)
                and all(
                    sample(fams, f"msgq_queue_{k}", f"msgq_queue_{k}_total", queue="q") == st[k]
                    for k in COUNTERS
                )
                and sample(fams, "msgq_queue_commits", "msgq_queue_commits_total") == st["commits"]
            )
            return (fams, st) if ok else None

        fams, st = await eventually(agree)
    assert (st["depth"], st["in_flight"], st["resident"]) == (300, 4, 200)
    assert fams["msgq_queue_depth"].type == "gauge"
    assert fams["msgq_queue_redelivered"].type == "counter"
    assert sample(fams, "msgq_queue_depth", queue="idle") == 0
    assert sample(fams, "msgq_queue_fsyncs", "msgq_queue_fsyncs_total") == st["fsyncs"] > 0
    hist = fams["msgq_queue_commit_seconds"]
    assert hist.type == "histogram"
    count = sample(fams, "msgq_queue_commit_seconds", "msgq_queue_commit_seconds_count")
    assert count == st["commits"] > 0
    assert (
        sample(fams, "msgq_queue_commit_seconds", "msgq_queue_commit_seconds_bucket", le="+Inf")
        == count
    )
    assert sample(fams, "msgq_queue_commit_seconds", "msgq_queue_commit_seconds_sum") > 0
    age = sample(fams, "msgq_queue_oldest_age_seconds", queue="q")
    assert age >= 1.2 - 1e-3, age  # (two processes' readings of one monotonic clock)
    assert sample(fams, "msgq_queue_oldest_age_seconds", queue="idle") == 0


def scrape_openmetrics(address: str) -> dict[str, Any]:
    """GET /metrics asking for OpenMetrics, parsed with prometheus_client's strict
    OpenMetrics parser: family name -> family."""
    req = urllib.request.Request(
        f"http://{address}/metrics", headers={"Accept": "application/openmetrics-text"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text"), r.headers[
            "Content-Type"
        ]
        text = r.read().decode()
    return {f.name: f for f in openmetrics_families(text)}


async def test_metrics_openmetrics_and_process(queue_broker: Start) -> None:
    """Asked for OpenMetrics, the plugin's endpoint answers in it: the queue gauges, the
    store counters and the commit histogram (buckets up to ``+Inf`` equal to its count),
    plus the plugin process's own ``process_*`` families."""
    b = queue_broker({"q": {}}, metrics="127.0.0.1:0")
    m = re.search(
        r"queue plugin: metrics on http://(127\.0\.0\.1:\d+)/metrics",
        b.log_with("queue plugin: metrics on"),  # the broker's log thread may lag
    )
    assert m, b.log()[-3000:]
    async with msgq_trio.connect(b.path, "p") as p:
        q = p.queue("q")
        await q.put_many(["a", "b", "c"])
        st = await q.stats()

        async def committed() -> dict[str, Any] | None:
            fams = await trio.to_thread.run_sync(scrape_openmetrics, m.group(1))
            commits = [
                s.value
                for s in fams["msgq_queue_commits"].samples
                if s.name == "msgq_queue_commits_total"
            ]
            return fams if commits and commits[0] > 0 else None

        fams = await eventually(committed)
    depth = fams["msgq_queue_depth"]
    assert depth.type == "gauge"
    assert [(s.labels, s.value) for s in depth.samples] == [({"queue": "q"}, st["depth"])]
    assert st["depth"] == 3
    hist = fams["msgq_queue_commit_seconds"]
    assert hist.type == "histogram"
    by_name: dict[str, list[Any]] = {}
    for s in hist.samples:
        by_name.setdefault(s.name, []).append(s)
    count = by_name["msgq_queue_commit_seconds_count"][0].value
    inf = [s.value for s in by_name["msgq_queue_commit_seconds_bucket"] if s.labels["le"] == "+Inf"]
    assert inf == [count] and count > 0
    assert fams["process_resident_memory_bytes"].samples[0].value > 1 << 20
    assert "process_cpu_seconds" in fams


async def test_metrics_port_in_use_fails_the_start(
    broker_argv: Callable[..., list[str]], short_tmp: Path
) -> None:
    """A ``metrics`` port another socket holds: the plugin cannot bind it before it is
    ready, so the broker's start fails, naming the key."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = short_tmp / "q.toml"
        config.write_text(
            f'[plugins.queue]\ndir = "{short_tmp / "store"}"\nmetrics = "127.0.0.1:{port}"\n'
        )
        argv = broker_argv(short_tmp / "q.sock", "--config", str(config))
        r = await trio.to_thread.run_sync(
            lambda: subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        )
    assert r.returncode != 0 and "listening" not in r.stdout
    assert f"metrics = '127.0.0.1:{port}': cannot listen" in r.stderr, r.stderr
    assert "plugin 'queue' failed to start" in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("table", "error"),
    [
        ({"metrics": "9100"}, "metrics = '9100': metrics address must be HOST:PORT"),
        ({"metrics": "127.0.0.1:70000"}, "metrics = '127.0.0.1:70000': .*0..65535"),
        ({"metrics": 9100}, "metrics = 9100: must be str"),
    ],
)
def test_metrics_setting_refused(table: dict[str, Any], error: str) -> None:
    """A malformed ``metrics`` value is refused naming the key (the broker's start
    fails with exit status 2); a good one is kept."""
    with pytest.raises(ValueError, match=error):
        parse_settings({"dir": "d", **table})
    assert parse_settings({"dir": "d", "metrics": "[::1]:0"}).metrics == "[::1]:0"


# -- the purge's races, in-process on the memory store ----------------------------------------
class Rig:
    """An engine on the memory store with one queue ``q`` (memory bound: 4 messages).
    Waits are for conditions (with a deadline), not for time: the store thread may be
    slow on a loaded machine."""

    def __init__(self, engine: Engine, nursery: trio.Nursery) -> None:
        self.engine, self.nursery = engine, nursery
        self.q: Queue = engine.queues["q"]
        self.pseq = 0
        #: ack 1 of each put, in the order they came
        self.answers: list[str] = []
        #: events a test holds the store thread with: all set at teardown, so a failed
        #: test cannot leave the store thread (and the fixture's exit) waiting forever
        self.gates: list[threading.Event] = []

    def put(self, *bodies: bytes) -> None:
        items = []
        for b in bodies:
            self.pseq += 1
            items.append((self.pseq, b"B" + b))

        def done(w: Waiter) -> None:
            self.answers.append("error" if w.error else f"stored {w.stored}")

        self.engine.put(self.q, "p", items, Waiter(len(items), done))

    async def until(self, cond: Callable[[], bool]) -> None:
        await eventually(cond, timeout=10)

    async def drain(self, n: int) -> list[bytes]:
        """The ``n`` messages a push consumer gets from here on (acked, their deletes
        committed), and that nothing more comes."""
        got: list[Msg] = []
        self.engine.deliver = lambda _q, _c, msgs: got.extend(msgs)
        self.engine.add_consumer(self.q, Consumer("c", "push", 1000, 30.0))
        acked = 0
        with trio.fail_after(10):
            while acked < n:
                for m in got[acked:]:
                    self.engine.ack(m)
                acked = len(got)
                await trio.sleep(0.01)
        await trio.testing.wait_all_tasks_blocked(0.05)
        assert len(got) == n, [m.data for m in got]
        del self.q.consumers["c"]
        await self.until(lambda: self.engine.store.stats("q").depth == self.q.live)
        return [m.data[1:] for m in got]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with engine_on_memory_store() as (engine, nursery):
        r = Rig(engine, nursery)
        try:
            yield r
        finally:
            for gate in r.gates:
                gate.set()


async def test_purge_keeps_messages_waiting_for_their_commit(rig: Rig) -> None:
    """Messages not stored yet (in memory or spilled) are kept, their producers get
    their ack 1 later, and paging goes on for the spilled ones, which a consumer then
    gets in order; stored ones (memory and disk) are gone."""
    engine, q = rig.engine, rig.q
    rig.nursery.start_soon(engine.flush_loop)
    rig.put(b"1", b"2", b"3", b"4")
    rig.put(b"5", b"6")
    await rig.until(lambda: len(rig.answers) == 2)  # 1-4 stored in memory, 5-6 on disk
    await trio.testing.wait_all_tasks_blocked(0.05)  # the flush loop is idle again
    assert q.spilled and q.resident == 4 and q.unstored_spilled == 0
    hold, engine._wake = engine._wake, trio.Event()  # the flush loop sleeps on ``hold``
    rig.put(b"7", b"8")  # spilled, waiting for their commit
    assert q.unstored_spilled == 2
    assert await engine.purge(q) == 6
    assert (q.live, q.spilled, q.resident) == (2, True, 2)
    assert rig.answers == ["stored 4", "stored 2"]
    hold.set()
    await rig.until(lambda: len(rig.answers) == 3)  # 7, 8 answered once committed
    assert rig.answers == ["stored 4", "stored 2", "stored 2"]
    assert await rig.drain(2) == [b"7", b"8"]
    assert (q.live, q.bytes, q.spilled) == (0, 0, False)


async def test_peek_and_purge_with_messages_in_memory_not_stored_yet(rig: Rig) -> None:
    """``peek`` lists stored ready messages, then ready ones waiting for their commit
    (seq None); ``purge`` removes the stored one only, and the others are answered and
    delivered once committed."""
    engine, q = rig.engine, rig.q
    rig.nursery.start_soon(engine.flush_loop)
    rig.put(b"1")
    await rig.until(lambda: len(rig.answers) == 1)  # stored, in memory
    await trio.testing.wait_all_tasks_blocked(0.05)  # the flush loop is idle again
    hold, engine._wake = engine._wake, trio.Event()  # the flush loop sleeps on ``hold``
    rig.put(b"2", b"3")  # in memory, waiting for their commit
    # (the request is only named in errors: none here)
    rows = await peek(engine, {"queue": "q", "n": 10}, None)  # type: ignore[arg-type]
    assert [(r["seq"], r["producer_seq"], r["body"], r["kind"]) for r in rows] == [
        (1, 1, b"1", "body"),
        (None, 2, b"2", "body"),
        (None, 3, b"3", "body"),
    ]
    rows = await peek(engine, {"queue": "q", "n": 2}, None)  # type: ignore[arg-type]
    assert [r["producer_seq"] for r in rows] == [1, 2]
    assert await engine.purge(q) == 1
    assert q.live == 2 and rig.answers == ["stored 1"]
    hold.set()
    await rig.until(lambda: len(rig.answers) == 2)
    assert rig.answers == ["stored 1", "stored 2"]
    assert await rig.drain(2) == [b"2", b"3"]
    assert engine.store.stats("q").depth == 0


async def test_purge_reads_pages_only_after_the_commit_before_them_is_applied(rig: Rig) -> None:
    """A commit that ran on the store thread just before a purge's page read stores
    messages that memory holds (its results not yet applied on the trio side when the
    read returns, in about half the runs): the purge must not take them for messages
    only on disk. Repeated, so both orders of the two results come up; each time only
    the spilled message goes and the four in memory are delivered."""
    engine, q = rig.engine, rig.q
    rig.nursery.start_soon(engine.flush_loop)
    rig.put(b"w")  # the producer's first put reads its state from the store: done here
    assert await rig.drain(1) == [b"w"]
    jobs = engine.thread._jobs  # the store thread's queue of submitted calls
    for _ in range(20):
        gate, holding = threading.Event(), threading.Event()
        rig.gates.append(gate)

        def hold(gate: threading.Event = gate, holding: threading.Event = holding) -> None:
            holding.set()
            gate.wait()

        rig.nursery.start_soon(engine.thread.run, hold)  # holds the store thread
        await rig.until(holding.is_set)
        rig.put(b"a", b"b", b"c", b"d")  # to memory: under the bound when put
        rig.put(b"e")  # past it: spilled
        await rig.until(lambda: engine._flushing)  # the commit waits behind the gate
        assert q.spilled
        result: list[int] = []
        done = trio.Event()

        async def purge(out: list[int], done: trio.Event) -> None:
            out.append(await engine.purge(q))
            done.set()

        rig.nursery.start_soon(purge, result, done)
        await rig.until(lambda: jobs.qsize() == 2)  # its page read waits behind the commit
        gate.set()
        with trio.fail_after(10):
            await done.wait()
        assert result == [1], result
        assert q.live == 4 and not q.spilled
        assert await rig.drain(4) == [b"a", b"b", b"c", b"d"]
        assert q.live == 0 and q.bytes == 0
        assert engine.store.stats("q").depth == 0


async def test_oldest_age_is_bounded_by_the_samples_around_the_store(rig: Rig) -> None:
    """The oldest message's age lies between the time since it was stored and the time
    since the sample before that; a message stored before the tracker started counts
    from the start; an empty queue is 0; a paged queue whose disk-only messages were
    never paged in (``disk_next`` still 0) is not taken for one recovered at start."""
    engine, q = rig.engine, rig.q
    rig.nursery.start_soon(engine.flush_loop)
    rig.put(b"old")
    await rig.until(lambda: len(rig.answers) == 1)  # stored before the tracker starts
    t0 = trio.current_time()
    ages = AgeTracker(engine)
    t1 = trio.current_time()
    await ages.sample()
    await trio.sleep(0.2)
    now = trio.current_time()
    assert now - t1 <= ages.oldest_age(q, now) <= now - t0
    assert await rig.drain(1) == [b"old"]
    assert ages.oldest_age(q, trio.current_time()) == 0
    await trio.sleep(0.2)
    before = trio.current_time()
    await ages.sample()  # the last sample before the puts
    rig.put(b"1", b"2", b"3", b"4")  # in memory
    rig.put(b"5", b"6")  # only on disk, never paged in
    await rig.until(lambda: len(rig.answers) == 3)
    stored = trio.current_time()  # all six are stored by now
    assert q.spilled and q.disk_next == 0 and q.unstored_spilled == 0
    await trio.sleep(0.2)
    await ages.sample()
    now = trio.current_time()
    assert now - stored <= ages.oldest_age(q, now) <= now - before


async def test_peek_shows_a_bound_groups_value_without_its_attachments(rig: Rig) -> None:
    """A bound group's stored request is its CBOR ``[cmd, params]`` followed by a map of
    extensions (attachments): ``peek`` gives the request's CBOR alone, its size, and
    how many attachments it carries."""
    engine, q = rig.engine, rig.q
    rig.nursery.start_soon(engine.flush_loop)
    value = ["write", {"acct": 1}]
    data = b"R" + cbor2.dumps(value) + cbor2.dumps({"attachments": [b"x" * 100, b"y"]})
    stored: list[int] = []
    engine.put(q, "binder", [(1, data)], Waiter(1, lambda w: stored.append(w.stored)))
    await rig.until(lambda: stored == [1])
    rows = await peek(engine, {"queue": "q"}, None)  # type: ignore[arg-type]
    assert rows == [
        {
            "seq": 1,
            "producer": "binder",
            "producer_seq": 1,
            "deliveries": 0,
            "size": len(cbor2.dumps(value)),
            "kind": "request",
            "body": cbor2.dumps(value),
            "attachments": 2,
        }
    ]
