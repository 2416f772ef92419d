"""The broker's ``groups`` command on the pure core (no sockets): every group with
members, sorted, with its count; under access rules only the groups the caller may list
the members of."""

from __future__ import annotations

from test_broker_core import Bench

from msgq_trio.config import AccessRule
from msgq_trio.core.access import Access
from msgq_trio.protocol.codes import FrameType


def test_groups_lists_groups_with_members_and_hides_what_access_rules_hide() -> None:
    bench = Bench()
    a, b, c = bench.connect("a"), bench.connect("b"), bench.connect("c")
    bench.subscribe(a, "Zones")
    bench.subscribe(b, "Zones")
    bench.subscribe(b, "Auth")
    bench.subscribe(a, "Secret")
    answer = bench.call_broker(c, "groups")
    assert answer.type == FrameType.REPLY
    assert answer.body() == [
        {"group": "Auth", "members": 1},
        {"group": "Secret", "members": 1},
        {"group": "Zones", "members": 2},
    ]
    bench.call_broker(a, "unsubscribe", {"group": "Secret"})
    assert [g["group"] for g in bench.call_broker(c, "groups").body()] == ["Auth", "Zones"]
    bench.subscribe(a, "Secret")
    # A client under access rules sees the groups it may subscribe to, send or call.
    c.acl = Access("tcp:c", [AccessRule(who=("*",), call=("Zones",), send=("Au*",))])
    assert [g["group"] for g in bench.call_broker(c, "groups").body()] == ["Auth", "Zones"]
    c.acl = Access("tcp:c", [AccessRule(who=("*",), subscribe=("Nothing",))])
    assert bench.call_broker(c, "groups").body() == []
