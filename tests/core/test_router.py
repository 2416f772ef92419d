"""Unit tests of msgq_trio.core.router: groups, join order, lnames, G[N], G[?], reserved names."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from msgq_trio.core.peers import Peer
from msgq_trio.core.router import (
    ANYCAST,
    BROKER,
    DIRECT,
    GROUP,
    INSTANCE,
    Router,
)
from msgq_trio.protocol.names import valid_group_name


def peer(n: int, name: str = "") -> Peer:
    return Peer(n, name or f"p{n}", pid=1000 + n, uid=0, gid=0, now=0.0)


@pytest.fixture
def router() -> Router:
    return Router(random.Random(1234))


def lnames(peers: object) -> list[str]:
    return [p.lname for p in peers]  # type: ignore[attr-defined]


def test_peer_identity() -> None:
    """A peer's lname is l.<id> and its stamp is lname NUL name (the source section)."""
    p = peer(17, "ZoneMgr")
    assert p.lname == "l.17"
    assert p.stamp == b"l.17\0ZoneMgr"
    assert "l.17" in p.describe() and "ZoneMgr" in p.describe()


def test_group_members_in_join_order(router: Router) -> None:
    """members() lists a group's members in join order; re-subscribing changes nothing."""
    a, b, c = peer(1), peer(2), peer(3)
    for p in (a, b, c):
        router.add_peer(p)
    assert router.subscribe(b, "G")
    assert router.subscribe(a, "G")
    assert router.subscribe(c, "G")
    assert not router.subscribe(b, "G")
    assert lnames(router.members("G")) == ["l.2", "l.1", "l.3"]
    assert router.members("Nobody") == []


def test_group_broadcast_skips_the_sender(router: Router) -> None:
    """A group target resolves to every member but the sender; a non-member sender reaches
    all of them; an unknown or empty group resolves to nobody."""
    a, b, c, out = peer(1), peer(2), peer(3), peer(4)
    for p in (a, b, c, out):
        router.add_peer(p)
        if p is not out:
            router.subscribe(p, "G")
    assert lnames(router.resolve("G", b)) == ["l.1", "l.3"]
    assert lnames(router.resolve("G", out)) == ["l.1", "l.2", "l.3"]
    assert lnames(router.resolve("G", None)) == ["l.1", "l.2", "l.3"]
    assert list(router.resolve("Other", a)) == []
    router.unsubscribe(a, "G")
    router.unsubscribe(b, "G")
    router.unsubscribe(c, "G")
    assert list(router.resolve("G", out)) == []
    assert "G" not in router.groups, "empty groups must be forgotten"


def test_direct_lname(router: Router) -> None:
    """l.N resolves to connection N (including the sender itself); unknown, removed or
    malformed lnames resolve to nobody."""
    a, b = peer(1), peer(2)
    router.add_peer(a)
    router.add_peer(b)
    assert lnames(router.resolve("l.2", a)) == ["l.2"]
    assert lnames(router.resolve("l.1", a)) == ["l.1"]
    assert list(router.resolve("l.3", a)) == []
    for bad in ("l.", "l.x", "l.-1", "l.1.5", "l.\u0663", "l. 1"):
        assert list(router.resolve(bad, a)) == [], bad
    router.remove_peer(b)
    assert list(router.resolve("l.2", a)) == []


def test_instance_by_join_order(router: Router) -> None:
    """G[N] is the N-th member by join order; when G[0] leaves, the next one becomes G[0];
    an index past the end resolves to nobody."""
    ps = [peer(i) for i in range(1, 5)]
    for p in ps:
        router.add_peer(p)
        router.subscribe(p, "Workers")
    for i, p in enumerate(ps):
        assert lnames(router.resolve(f"Workers[{i}]", None)) == [p.lname]
    assert list(router.resolve("Workers[4]", None)) == []
    assert list(router.resolve("Workers[99999999999999999999]", None)) == []
    router.remove_peer(ps[0])
    assert lnames(router.resolve("Workers[0]", None)) == ["l.2"]
    assert lnames(router.resolve("Workers[2]", None)) == ["l.4"]
    assert list(router.resolve("Workers[3]", None)) == []
    # Re-joining puts a member at the end.
    router.unsubscribe(ps[1], "Workers")
    router.subscribe(ps[1], "Workers")
    assert lnames(router.members("Workers")) == ["l.3", "l.4", "l.2"]
    # The sender is not skipped for an instance target.
    assert lnames(router.resolve("Workers[0]", ps[2])) == ["l.3"]


def test_anycast_picks_one_member_roughly_uniformly(router: Router) -> None:
    """G[?] resolves to exactly one member, chosen at random over all members."""
    ps = [peer(i) for i in range(1, 4)]
    for p in ps:
        router.add_peer(p)
        router.subscribe(p, "Any")
    counts: Counter[str] = Counter()
    for _ in range(3000):
        chosen = list(router.resolve("Any[?]", None))
        assert len(chosen) == 1
        counts[chosen[0].lname] += 1
    assert set(counts) == {"l.1", "l.2", "l.3"}
    assert all(800 <= n <= 1200 for n in counts.values()), counts
    assert list(router.resolve("Empty[?]", None)) == []


def test_malformed_instance_syntax_resolves_to_nobody(router: Router) -> None:
    """G[], G[x], G[-1], [0] and G[1 ] are not instance targets and reach nobody, even when
    G has members."""
    a = peer(1)
    router.add_peer(a)
    router.subscribe(a, "G")
    for t in ("G[]", "G[x]", "G[-1]", "[0]", "G[1 ]", "G[?x]", "G[\u0661]"):
        assert list(router.resolve(t, None)) == [], t


@pytest.mark.parametrize(
    "target,kind",
    [
        ("msgq", BROKER),
        ("l.0", BROKER),
        ("l.5", DIRECT),
        ("G", GROUP),
        ("G[3]", INSTANCE),
        ("G[?]", ANYCAST),
        ("a.b.c", GROUP),
        ("G[x]", DIRECT),
    ],
)
def test_parse_target_kinds(router: Router, target: str, kind: int) -> None:
    """parse_target classifies targets (and caches the answer consistently)."""
    assert router.parse_target(target)[0] == kind
    assert router.parse_target(target)[0] == kind


def test_broker_address_resolves_to_nobody(router: Router) -> None:
    """The broker's own addresses are not routable through resolve()."""
    a = peer(1)
    router.add_peer(a)
    assert list(router.resolve("msgq", a)) == []
    assert list(router.resolve("l.0", a)) == []


def test_remove_peer_returns_groups_in_join_order(router: Router) -> None:
    """remove_peer() unsubscribes the peer from all its groups and returns them in the
    order it joined them; the other members keep their order."""
    a, b = peer(1), peer(2)
    router.add_peer(a)
    router.add_peer(b)
    for g in ("Z", "A", "M"):
        router.subscribe(a, g)
        router.subscribe(b, g)
    assert router.remove_peer(a) == ["Z", "A", "M"]
    for g in ("Z", "A", "M"):
        assert lnames(router.members(g)) == ["l.2"]
    assert a.groups == {}
    assert router.remove_peer(a) == []


@pytest.mark.parametrize(
    "name",
    [
        "",
        "x" * 256,
        "l.5",
        "l.anything",
        "msgq",
        "G[0]",
        "G]",
        "a[b",
        "nul\0byte",
    ],
)
def test_reserved_and_invalid_group_names(name: str) -> None:
    """Names that are empty, too long, lname-like, the broker's address, or contain
    '[', ']' or NUL cannot be subscribed to."""
    assert valid_group_name(name) is not None


@pytest.mark.parametrize("name", ["G", "x" * 255, "Zone.Manager", "msgq.membership", "l", "ü"])
def test_valid_group_names(name: str) -> None:
    """Ordinary names (and the broker-published msgq.* groups) are valid to subscribe to."""
    assert valid_group_name(name) is None


def test_parse_cache_is_bounded(router: Router) -> None:
    """Parsing many distinct targets keeps answering correctly (the cache is bounded)."""
    a = peer(1)
    router.add_peer(a)
    router.subscribe(a, "G")
    for i in range(70_000):
        router.parse_target(f"T{i}")
    assert len(router._parsed) <= 65536
    assert lnames(router.resolve("G[0]", None)) == ["l.1"]
