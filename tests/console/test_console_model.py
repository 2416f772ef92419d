"""The console's model without HTTP or a broker: broker answers in, view data out; the
call form's fields and their parsing; the listen rules."""

from __future__ import annotations

import json
import math

import pytest

from msgq_trio.console.cli import check_listen, is_loopback, split_listen
from msgq_trio.console.model import (
    FormError,
    History,
    Raw,
    form_fields,
    parse_form,
    view,
)
from msgq_trio.ops.ctl_client import CliUsageError

CLIENT = {
    "lname": "l.10",
    "name": "zonemgr",
    "pid": 42,
    "uid": 1000,
    "groups": ["ZoneMgr", "msgq.membership"],
    "msgs_in": 5,
    "msgs_out": 7,
    "queued_bytes": 0,
    "connected_at": 1000.0,
    "connected_for": 3.5,
    "where": "",
}
TCP = {**CLIENT, "lname": "l.2", "name": "remote", "uid": -1, "where": "tcp:alice@10.0.0.2:4"}


def raw(t: float, **kw: object) -> Raw:
    r = Raw(taken_at=t)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_view_clients_groups_and_identity() -> None:
    doc = view(raw(1.0, clients=[CLIENT, TCP]), History())
    assert [c["lname"] for c in doc["clients"]] == ["l.2", "l.10"]  # numeric order
    assert doc["clients"][0]["identity"] == "tcp:alice@10.0.0.2:4"
    assert doc["clients"][1]["identity"] == "pid 42 uid 1000"
    assert doc["groups"][0] == {
        "group": "ZoneMgr",
        "members": [{"lname": "l.2", "name": "remote"}, {"lname": "l.10", "name": "zonemgr"}],
    }
    json.dumps(doc, allow_nan=False)  # what the browsers get is strict JSON


def test_view_bounds_rows_but_counts_them() -> None:
    clients = [{**CLIENT, "lname": f"l.{i}"} for i in range(1, 51)]
    doc = view(raw(1.0, clients=clients), History(), max_rows=10)
    assert len(doc["clients"]) == 10 and doc["clients_total"] == 50


def test_command_rates_errors_and_latency() -> None:
    def stats(requests: int, p99: float) -> dict[str, object]:
        return {
            "commands": [
                {
                    "group": "ZoneMgr",
                    "command": "get",
                    "requests": requests,
                    "outcomes": {"ok": requests - 2, "error": 2},
                    "errors": {"not-found": 2},
                    "latency": {"p50": 0.00025, "p99": p99},
                }
            ]
        }

    h = History()
    first = view(raw(10.0, command_stats=stats(10, 0.001)), h)["commands"][0]
    assert first["rate"] is None and first["failed"] == 2
    assert first["errors"] == {"not-found": 2} and first["p50"] == 0.00025
    second = view(raw(12.0, command_stats=stats(30, math.inf)), h)["commands"][0]
    assert second["rate"] == 10.0
    assert second["p99"] is None and second["p99_over"] is True  # no infinity in JSON


def test_rates_history_is_bounded_and_never_negative() -> None:
    h = History(maxlen=3)
    for t, n in ((0, 0), (2, 20), (4, 60), (6, 10)):  # the last: a restarted broker
        view(raw(float(t), stats={"traffic": {"messages_in": n, "messages_out": n}}), h)
    rates = h.rates()
    assert len(h.points) == 3 and [r["in"] for r in rates] == [20.0, 0.0]


def test_broker_card_plugins_and_listeners() -> None:
    doc = view(
        raw(
            1.0,
            version={"broker": "0.1.0", "protocol": 1},
            config={
                "socket": "/run/bus.sock",
                "tcp": {"listen": ["0.0.0.0:7777"], "certfile": "/c.pem"},
                "plugins": {"queue": {}, "pipe": {}},
                "access": {"queue_group": "q"},
            },
            groups=[{"group": "q", "members": 1}],
            stats={"uptime": 5.0, "config": {"file": "/etc/b.toml", "generation": 2}},
        ),
        History(),
    )
    b = doc["broker"]
    assert b["listeners"] == ["unix:/run/bus.sock", "tls://0.0.0.0:7777"]
    assert b["plugins"] == [
        {"name": "pipe", "group": "msgq-pipe", "state": "down"},
        {"name": "queue", "group": "q", "state": "running"},
    ]
    assert b["config_file"] == "/etc/b.toml"


def test_garbage_from_the_broker_does_not_crash_the_view() -> None:
    doc = view(
        raw(
            1.0,
            clients=[{"lname": "x", "groups": None, "msgs_in": "many"}],
            command_stats={"commands": [{"requests": True}]},
            pipes={"brokers": [{"pipes": [{"name": "p", "ends": [3, {"role": "w"}]}, "x"]}, 7]},
        ),
        History(),
    )
    assert doc["clients"][0]["msgs_in"] == 0
    assert doc["pipes"][0]["writers"] == ["?"]


def test_pipes_and_their_ends() -> None:
    listing = {
        "brokers": [
            {
                "node": "vm:/run/bus.sock",
                "pipes": [
                    {
                        "name": "logs",
                        "mode": "share",
                        "persistent": False,
                        "buffered": 10,
                        "ends": [
                            {"handle": 1, "role": "w", "owner": "l.4"},
                            {"handle": 2, "role": "r", "owner": "l.7"},
                            {"handle": 3, "role": "r", "owner": "l.8"},
                        ],
                    }
                ],
            }
        ]
    }
    (row,) = view(raw(1.0, pipes=listing), History())["pipes"]
    assert (row["name"], row["writers"], row["readers"]) == ("logs", ["l.4"], ["l.7", "l.8"])
    assert row["node"] == "vm:/run/bus.sock" and row["buffered"] == 10


DECL = {
    "name": "get_zone_count",
    "params": [
        {"name": "zone_class", "type": "str", "required": False, "default": "IN"},
        {"name": "limit", "type": "int", "required": True},
        {"name": "ratio", "type": "float", "required": False},
        {"name": "verbose", "type": "bool", "required": False, "default": False},
        {"name": "tags", "type": "list[str]", "required": False},
    ],
}


def test_form_fields_from_a_declaration() -> None:
    fields = form_fields(DECL)
    assert [(f["name"], f["input"]) for f in fields] == [
        ("zone_class", "text"),
        ("limit", "number"),
        ("ratio", "number"),
        ("verbose", "checkbox"),
        ("tags", "json"),
    ]
    assert fields[0]["default"] == "IN"


def test_parse_form_types_and_errors() -> None:
    fields = form_fields(DECL)
    assert parse_form(fields, {"limit": "3", "tags": '["a"]', "verbose": "on"}) == {
        "limit": 3,
        "tags": ["a"],
        "verbose": True,
    }
    with pytest.raises(FormError) as e:
        parse_form(fields, {})
    assert e.value.field == "limit"
    with pytest.raises(FormError, match="limit: expected an integer"):
        parse_form(fields, {"limit": "x"})
    with pytest.raises(FormError, match="ratio: expected a finite number"):
        parse_form(fields, {"limit": "1", "ratio": "nan"})
    with pytest.raises(FormError, match="tags: not JSON"):
        parse_form(fields, {"limit": "1", "tags": "[oops"})
    with pytest.raises(FormError, match="'bogus' is not a declared parameter"):
        parse_form(fields, {"limit": "1", "bogus": "1"})


def test_listen_rules() -> None:
    assert split_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    assert split_listen("[::1]:8470") == ("::1", 8470)
    with pytest.raises(CliUsageError):
        split_listen("host")
    assert is_loopback("localhost") and is_loopback("::1") and not is_loopback("0.0.0.0")
    check_listen("127.0.0.1", tls=False, login=False, broker=None)
    check_listen("0.0.0.0", tls=True, login=True, broker="tls://bus:7777")
    with pytest.raises(CliUsageError, match="TLS"):
        check_listen("0.0.0.0", tls=False, login=True, broker="tls://bus:7777")
    with pytest.raises(CliUsageError, match="tcp:// or tls://"):
        check_listen("10.1.2.3", tls=True, login=True, broker="/run/bus.sock")
