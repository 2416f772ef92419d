"""``clients`` and ``stats`` with ``fields``: the same figures as the full answers, only
the keys asked for, computed without the full answer's per-task and per-descriptor work;
a wrong ``fields`` is the caller's error, named."""

from __future__ import annotations

import pytest
import trio

import msgq_trio
from msgq_trio.errors import RemoteError
from msgq_trio.ops.control import CLIENT_FIELDS, CLIENTS_SINCE_CALLERS

CONSOLE_CLIENT_FIELDS = ["lname", "name", "pid", "uid", "groups", "queued_bytes", "where"]
CHEAP_STATS = [
    "connections",
    "pending_requests",
    "groups",
    "queued_bytes",
    "rss_bytes",
    "uptime",
    "traffic",
    "capture",
    "config",
]


async def test_clients_fields_are_the_full_rows_cut(broker) -> None:
    async with (
        msgq_trio.connect(broker.path, name="a") as a,
        msgq_trio.connect(broker.path, name="b") as b,
    ):
        await b.subscribe("Zone")
        full = await a.call("msgq", "clients")
        cut = await a.call("msgq", "clients", {"fields": CONSOLE_CLIENT_FIELDS})
        assert [r["lname"] for r in cut] == [r["lname"] for r in full]
        for f, c in zip(full, cut, strict=True):
            assert set(c) == set(CONSOLE_CLIENT_FIELDS)
            assert c == {k: f[k] for k in CONSOLE_CLIENT_FIELDS}
        # Every key of the full row can be asked for, the clock-derived ones included.
        every = await a.call("msgq", "clients", {"fields": sorted(CLIENT_FIELDS)})
        assert set(every[0]) == set(full[0]) == CLIENT_FIELDS
        for f, c in zip(full, every, strict=True):
            assert abs(c["connected_for"] - f["connected_for"]) < 5.0
            assert abs(c["connected_at"] - f["connected_at"]) < 0.5
            assert c["pending_in"] == f["pending_in"] and c["groups"] == f["groups"]


@pytest.mark.parametrize(
    ("fields", "says"),
    [(["lname", "nmae"], "'nmae'"), ("lname", None), ([1], "list of strings")],
)
async def test_clients_wrong_fields_are_refused(broker, fields, says) -> None:
    async with msgq_trio.connect(broker.path, name="a") as a:
        if says is None:  # one name for a list of one: as the other list params
            assert list((await a.call("msgq", "clients", {"fields": fields}))[0]) == ["lname"]
            return
        with pytest.raises(RemoteError) as exc:
            await a.call("msgq", "clients", {"fields": fields})
        assert exc.value.code == "bad-request" and says in exc.value.message


async def test_stats_fields_match_the_full_answer(broker) -> None:
    async with msgq_trio.connect(broker.path, name="a") as a:
        await a.subscribe("Zone")
        full = await a.call("msgq", "stats")
        cut = await a.call("msgq", "stats", {"fields": CHEAP_STATS})
        assert list(cut) == CHEAP_STATS
        for key in ("connections", "pending_requests", "groups", "queued_bytes", "config"):
            assert cut[key] == full[key], key
        assert set(cut["traffic"]) == set(full["traffic"])
        assert cut["traffic"]["messages_in"] >= full["traffic"]["messages_in"]
        assert set(cut["capture"]) == set(full["capture"])
        assert cut["uptime"] >= full["uptime"] > 0
        assert cut["rss_bytes"] > 0
        # A key outside the cheap set comes from the full answer; an unknown one is absent.
        mixed = await a.call("msgq", "stats", {"fields": ["tasks", "uptime", "no-such"]})
        assert list(mixed) == ["tasks", "uptime"] and mixed["tasks"] > 0
        with pytest.raises(RemoteError) as exc:
            await a.call("msgq", "stats", {"fields": {"uptime": 1}})
        assert exc.value.code == "bad-request" and "fields" in exc.value.message


async def test_clients_since_answers_what_changed(broker) -> None:
    """``since``: the first answer is full; then only changed or new rows (the caller's
    own row changes with each request it sends), and the lnames of clients gone; a
    generation that is not the caller's last gets a full answer again."""
    fields = ["lname", "name", "groups", "msgs_in", "connected_at"]
    async with (
        msgq_trio.connect(broker.path, name="a") as a,
        msgq_trio.connect(broker.path, name="idle") as idle,
    ):
        first = await a.call("msgq", "clients", {"fields": fields, "since": 0})
        assert first["full"] is True and first["gone"] == []
        assert {r["lname"] for r in first["rows"]} == {a.lname, idle.lname}
        assert set(first["rows"][0]) == set(fields) and first["now"] > 0

        quiet = await a.call("msgq", "clients", {"fields": fields, "since": first["generation"]})
        assert quiet["full"] is False and quiet["gone"] == []
        assert [r["lname"] for r in quiet["rows"]] == [a.lname]  # its requests count

        async with msgq_trio.connect(broker.path, name="new") as new:
            await idle.subscribe("Zone")
            gen = quiet["generation"]
            moved = await a.call("msgq", "clients", {"fields": fields, "since": gen})
            rows = {r["lname"]: r for r in moved["rows"]}
            assert set(rows) == {a.lname, idle.lname, new.lname}
            assert rows[idle.lname]["groups"] == ["Zone"] and rows[new.lname]["name"] == "new"
            gen = moved["generation"]
        await idle.unsubscribe("Zone")
        # The broker may see the close after a's next request: ask until it is gone.
        gone: list[str] = []
        changed: set[str] = set()
        with trio.fail_after(10):
            while not gone:
                answer = await a.call("msgq", "clients", {"fields": fields, "since": gen})
                assert answer["full"] is False
                gen, gone = answer["generation"], answer["gone"]
                changed |= {r["lname"] for r in answer["rows"]}
        assert gone == [new.lname] and changed == {a.lname, idle.lname}

        stale = await a.call("msgq", "clients", {"fields": fields, "since": gen - 1})
        assert stale["full"] is True and len(stale["rows"]) == 2

        for bad in (-1, "1", True):
            with pytest.raises(RemoteError) as exc:
                await a.call("msgq", "clients", {"since": bad})
            assert exc.value.code == "bad-request" and "since" in exc.value.message


async def test_clients_since_remembers_a_bounded_number_of_callers(broker) -> None:
    """The broker keeps the last ``since`` answer of CLIENTS_SINCE_CALLERS callers, not of
    every caller: once that many others were served after it, a caller's next answer is
    full (as after a lost answer), and a caller still remembered gets only what changed."""
    fields = ["lname", "name"]
    async with trio.open_nursery() as nursery:
        buses = [
            await nursery.start(_connected, broker.path, f"c{i}")
            for i in range(CLIENTS_SINCE_CALLERS + 1)
        ]
        gens = []
        for bus in buses:
            gens.append(
                (await bus.call("msgq", "clients", {"fields": fields, "since": 0}))["generation"]
            )
        # The first caller was served before CLIENTS_SINCE_CALLERS others: forgotten.
        first = await buses[0].call("msgq", "clients", {"fields": fields, "since": gens[0]})
        assert first["full"] is True and len(first["rows"]) == len(buses)
        # The last one is remembered (the first's new answer pushed out the second's).
        last = await buses[-1].call("msgq", "clients", {"fields": fields, "since": gens[-1]})
        assert last["full"] is False and last["rows"] == []
        second = await buses[1].call("msgq", "clients", {"fields": fields, "since": gens[1]})
        assert second["full"] is True
        nursery.cancel_scope.cancel()


async def _connected(
    path: object, name: str, *, task_status: trio.TaskStatus[msgq_trio.Bus]
) -> None:
    async with msgq_trio.connect(path, name=name) as bus:
        task_status.started(bus)
        await trio.sleep_forever()
