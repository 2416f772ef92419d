"""What the console asks the broker for, watched from the broker's side (a dump of the
console connection's commands): nothing while no viewer is connected; the broker card's
cheap figures for a viewer of the broker view; the clients (only the keys the page
shows) once a viewer opens the clients view, pushed to it at once; nothing again after
the last viewer leaves; and a fresh document with every section for ``/api/snapshot``."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import trio
from console_helpers import ConsoleProcess, Viewer

import msgq_trio
from msgq_trio.console.model import client_rows

INTERVAL = 0.2
#: How long each phase is watched: five intervals (at least two snapshots on a busy machine).
WINDOW = 5 * INTERVAL


class Stream:
    """A viewer's event stream on one view, read by a thread: the documents received."""

    def __init__(self, v: Viewer, view: str) -> None:
        self.resp = v.opener.open(f"{v.url}/api/events?view={view}", timeout=30)
        self.docs: list[dict[str, Any]] = []
        self.events: list[str] = []  # the event of each document: snapshot or delta
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for raw in self.resp:
                if raw.startswith(b"event: "):
                    self.events.append(raw[7:].decode().strip())
                if raw.startswith(b"data: "):
                    self.docs.append(json.loads(raw[6:]))
        except (OSError, ValueError, AttributeError):  # closed under the reader
            return

    def close(self) -> None:
        self.resp.close()


async def commands_sent(bus: msgq_trio.Bus, seconds: float) -> Counter[str]:
    """The commands the console sent to ``msgq`` during ``seconds`` (the dump's records;
    ``fields`` and ``since`` appended when they were asked with them)."""
    seen: Counter[str] = Counter()
    with trio.move_on_after(seconds):
        async for msg in bus:
            body = msg.body
            if msg.sender != "l.0" or not isinstance(body, dict):
                continue
            for r in body.get("records") or ():
                name = r["command"]
                params = r.get("body")
                if isinstance(params, dict) and "fields" in params:
                    name += " fields"
                if isinstance(params, dict) and params.get("since"):
                    name += " since"
                seen[name] += 1
    return seen


async def test_the_console_asks_only_for_what_viewers_look_at(
    broker: Any,
    console_factory: Callable[..., ConsoleProcess],
    viewer: Callable[[str], Viewer],
) -> None:
    con = console_factory(broker.path, "--interval", str(INTERVAL))
    v = viewer(con.url)
    await trio.to_thread.run_sync(v.open_page)
    async with msgq_trio.connect(broker.path, name="watcher") as bus:
        await bus.call(
            "msgq",
            "dump-start",
            {"kinds": ["command"], "senders": ["msgq-trio-console"], "body": "json"},
        )
        # The page is open but no event stream: no snapshot at all.
        assert await commands_sent(bus, WINDOW) == Counter()

        broker_view = await trio.to_thread.run_sync(Stream, v, "broker")
        try:
            seen = await commands_sent(bus, WINDOW)
            assert seen["stats fields"] >= 2 and seen["groups"] >= 2, seen
            # Once per connection, and the configuration until its generation moves.
            assert seen["version"] == 1 and seen["config-get"] == 1, seen
            assert not {"clients", "clients fields", "command-stats", "stats"} & set(seen), seen
            assert "capture-status" not in seen, seen  # the stats' capture figures say it
            assert broker_view.docs and broker_view.docs[-1]["sections"] == []
            generation = broker_view.docs[-1]["broker"]["config_generation"]

            # A configuration change: asked for again once, shown with its generation.
            change = {"key": "limits.request_timeout", "value": 7.5}
            await bus.call("msgq", "config-set", change)
            seen = await commands_sent(bus, WINDOW)
            assert seen["config-get"] == 1, seen
            assert broker_view.docs[-1]["broker"]["config_generation"] == generation + 1

            # A viewer on the clients view: the next snapshot has them, at once.
            opened = time.time()
            clients_view = await trio.to_thread.run_sync(Stream, v, "clients")
            try:
                seen = await commands_sent(bus, WINDOW)
                # The first asks for every row, the next ones for what changed since.
                assert seen["clients fields"] == 1 and "clients" not in seen, seen
                assert seen["clients fields since"] >= 1, seen
                doc = clients_view.docs[0]
                assert doc["sections"] == ["clients"] and doc["taken_at"] >= opened - 0.1
                mine = [c for c in doc["clients"] if c["name"] == "watcher"]
                assert mine and mine[0]["identity"].startswith("pid ")
                assert 0 <= mine[0]["connected_for"] < 60
            finally:
                clients_view.close()
            # The clients view closed: its section is no longer asked for.
            await commands_sent(bus, 2 * INTERVAL)
            seen = await commands_sent(bus, WINDOW)
            assert seen["stats fields"] >= 2, seen
            assert not {"clients fields", "clients fields since"} & set(seen), seen
        finally:
            broker_view.close()
        await commands_sent(bus, 2 * INTERVAL)
        assert await commands_sent(bus, WINDOW) == Counter()

        # /api/snapshot when idle: a new snapshot with every section.
        asked = time.time()
        doc = await trio.to_thread.run_sync(v.snapshot)
        assert doc["taken_at"] >= asked - 0.1
        assert doc["sections"] == ["clients", "commands", "queues"]
        assert any(c["name"] == "watcher" for c in doc["clients"])


async def test_unknown_view_is_refused(
    broker: Any, console_factory: Callable[..., ConsoleProcess], viewer: Callable[[str], Viewer]
) -> None:
    con = console_factory(broker.path)
    v = viewer(con.url)
    await trio.to_thread.run_sync(v.open_page)
    status, _, body = await trio.to_thread.run_sync(lambda: v.request("/api/events?view=nope"))
    assert status == 400 and "unknown view 'nope'" in json.loads(body)["error"]


def test_connected_for_from_the_answers_time() -> None:
    """Rows of a ``clients`` answer with ``since`` come without ``connected_for``: the
    table has it from the answer's ``now`` (the broker's clock, not the console's)."""
    rows = client_rows([{"lname": "l.3", "connected_at": 100.0}], now=160.5)
    assert rows[0]["connected_for"] == 60.5 and rows[0]["connected_at"] == 100.0
    given = client_rows([{"lname": "l.3", "connected_at": 100.0, "connected_for": 2.0}], 160.5)
    assert given[0]["connected_for"] == 2.0


def test_client_rows_reuse_the_rows_the_broker_did_not_send_again() -> None:
    """The table row of a broker row that is the same object as in the previous call is
    reused (not rebuilt), with ``connected_for`` made anew; a row sent again is rebuilt;
    a client no longer listed leaves the cache."""
    cache: dict[str, Any] = {}
    idle = {"lname": "l.2", "name": "idle", "groups": ["G"], "msgs_in": 1, "connected_at": 10.0}
    busy = {"lname": "l.10", "name": "busy", "groups": [], "msgs_in": 1, "connected_at": 20.0}
    first = client_rows([idle, busy], 30.0, cache)
    assert [r["lname"] for r in first] == ["l.2", "l.10"]
    busy2 = {**busy, "msgs_in": 9}
    second = client_rows([idle, busy2], 31.0, cache)
    assert second[0]["groups"] is first[0]["groups"]  # the same table row's data
    assert second[0]["connected_for"] == 21.0 and first[0]["connected_for"] == 20.0
    assert second[1]["msgs_in"] == 9 and first[1]["msgs_in"] == 1
    client_rows([busy2], 32.0, cache)
    assert set(cache) == {"l.10"}


def apply(table: dict[str, dict[str, Any]], event: str, doc: dict[str, Any]) -> None:
    """What the page does with a document of its stream (app.js)."""
    if event == "snapshot":
        table.clear()
        table.update({r["lname"]: r for r in doc["clients"]})
        return
    assert "clients" not in doc
    for lname in doc["clients_delta"]["gone"]:
        del table[lname]
    for r in doc["clients_delta"]["set"]:
        table[r["lname"]] = r


async def test_the_stream_sends_the_changes_of_the_clients_table(
    broker: Any,
    console_factory: Callable[..., ConsoleProcess],
    viewer: Callable[[str], Viewer],
    component: Callable[..., Any],
) -> None:
    """After its first document, a stream on the clients view gets deltas: the rows that
    changed (a new client, the console's own) and the lnames gone, never the whole idle
    table; applied as the page does, they give the table of a full snapshot."""
    idle = [await trio.to_thread.run_sync(component, broker.path) for _ in range(3)]
    con = console_factory(broker.path, "--interval", str(INTERVAL))
    v = viewer(con.url)
    await trio.to_thread.run_sync(v.open_page)
    stream = await trio.to_thread.run_sync(Stream, v, "clients")
    try:
        await trio.sleep(4 * INTERVAL)
        comp = await trio.to_thread.run_sync(component, broker.path, "Xfrout", "xfrout")
        await trio.sleep(4 * INTERVAL)
        comp.proc.kill()
        await trio.to_thread.run_sync(comp.proc.wait)
        await trio.sleep(4 * INTERVAL)
        n = len(stream.docs)
        events, docs = stream.events[:n], stream.docs[:n]
    finally:
        stream.close()
    assert events[0] == "snapshot" and events.count("delta") >= n - 2 >= 3, events
    table: dict[str, dict[str, Any]] = {}
    added = gone = False
    for event, doc in zip(events, docs, strict=True):
        apply(table, event, doc)
        if event == "delta":
            changed = {r["lname"] for r in doc["clients_delta"]["set"]}
            assert not changed & {c.lname for c in idle}, changed  # idle rows: not again
            added |= comp.lname in changed
            gone |= comp.lname in doc["clients_delta"]["gone"]
        assert doc["clients_total"] == len(table)
    assert added and gone and comp.lname not in table
    full = await trio.to_thread.run_sync(v.snapshot)
    assert set(table) <= {r["lname"] for r in full["clients"]} | {comp.lname}
    assert {c.lname for c in idle} <= set(table)
