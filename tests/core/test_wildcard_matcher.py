"""The wildcard matcher (core/subjects.py) and the name rules (protocol/names.py): unit
tests, and a Hypothesis property test of the trie and its cache against a brute-force
reference matcher."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msgq_trio.core import subjects
from msgq_trio.core.peers import Peer
from msgq_trio.core.router import Router
from msgq_trio.core.subjects import SubjectTrie
from msgq_trio.protocol.names import (
    is_pattern,
    pattern_limits,
    pattern_matches,
    valid_pattern,
    valid_subscription,
    valid_target_name,
)


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("Zone.*", "Zone.a", True),
        ("Zone.*", "Zone", False),
        ("Zone.*", "Zone.a.b", False),
        ("Zone.>", "Zone.a", True),
        ("Zone.>", "Zone.a.b.c", True),
        ("Zone.>", "Zone", False),  # ``>`` is one or more tokens
        ("*.a", "x.a", True),
        ("*.a", "x.b", False),
        ("*.*", "x.y", True),
        (">", "anything.at.all", True),
        (">", "msgq.membership", False),  # a leading wildcard hides the broker's groups
        ("*.membership", "msgq.membership", False),
        ("msgq.*", "msgq.membership", True),
        ("msgq.>", "msgq.membership", True),
        ("Zone.a", "Zone.a", True),  # a literal matches itself only
        ("Zone.a", "Zone.b", False),
    ],
)
def test_pattern_matches(pattern: str, name: str, expected: bool) -> None:
    """NATS semantics: ``*`` one token, ``>`` one or more, last only."""
    assert pattern_matches(pattern, name) is expected
    trie: SubjectTrie[str] = SubjectTrie()
    if is_pattern(pattern):
        trie.insert(pattern, "s")
        assert (trie.match(name) == ("s",)) is expected


def test_name_rules() -> None:
    """Patterns are recognised by whole wildcard tokens and checked for structure;
    targets refuse them, ``G[N]`` included."""
    assert is_pattern("Zone.*") and is_pattern(">") and is_pattern("a.>.b")
    assert not is_pattern("a*b") and not is_pattern("Zone.x>") and not is_pattern("Zone")
    assert valid_pattern("Zone.*") is None and valid_pattern(">") is None
    assert "last token" in str(valid_pattern("a.>.b"))
    assert "empty" in str(valid_pattern("a..*"))
    assert "lnames" in str(valid_pattern("l.*"))
    assert "NUL" in str(valid_pattern("a.*\0"))
    assert valid_subscription("plain name") is None
    assert valid_subscription("Zone.*") is None
    assert "wildcards" in str(valid_target_name("Zone.*"))
    assert "wildcards" in str(valid_target_name("Zone.*[0]"))
    assert "wildcards" in str(valid_target_name("Zone.>[?]"))
    assert valid_target_name("Zone.a[0]") is None and valid_target_name("a*b") is None
    assert "max_pattern_bytes=8" in str(pattern_limits("Zone.abcdef.*", 8, 16))
    assert "max_pattern_bytes=8" in str(pattern_limits("é.é.é.*", 8, 16))  # UTF-8 bytes
    assert "max_pattern_tokens=2" in str(pattern_limits("a.b.*", 100, 2))
    assert pattern_limits("a.*", 100, 2) is None


def test_one_result_per_subscriber_and_pruning() -> None:
    """A subscriber whose several patterns match is returned once; removing every
    pattern leaves an empty trie."""
    trie: SubjectTrie[str] = SubjectTrie()
    for p in ("Zone.*", "Zone.>", "*.a", ">"):
        assert trie.insert(p, "x")
    assert not trie.insert("Zone.*", "x")
    trie.insert("Zone.*", "y")
    assert sorted(trie.match("Zone.a")) == ["x", "y"]
    assert trie.match("Other") == ("x",)  # ``>`` only
    for p in ("Zone.*", "Zone.>", "*.a", ">"):
        assert trie.remove(p, "x")
    assert not trie.remove(">", "x")
    assert trie.match("Zone.a") == ("y",)
    trie.remove("Zone.*", "y")
    trie.check_empty()


def test_cache_is_bounded_and_invalidated() -> None:
    """The result cache never holds more than CACHE_MAX subjects; a change clears a
    large cache, and in a small one drops the cached subjects it affects only."""
    trie: SubjectTrie[int] = SubjectTrie()
    trie.insert("a.*", 1)
    for i in range(subjects.CACHE_MAX + 10):
        trie.match(f"a.{i}")
    assert 0 < len(trie._cache) <= subjects.CACHE_MAX
    for i in range(subjects.SCAN_MAX + 1):
        trie.match(f"c.{i}")
    assert len(trie._cache) > subjects.SCAN_MAX
    trie.insert("b.*", 2)
    assert not trie._cache
    trie.match("b.x")
    trie.match("a.x")
    trie.insert("a.>", 3)
    assert "b.x" in trie._cache and "a.x" not in trie._cache
    assert sorted(trie.match("a.x")) == [1, 3]


# -- property test against a brute-force reference ---------------------------------------

TOKENS = st.sampled_from(["a", "b", "c", "msgq"])
SUBJECT = st.lists(TOKENS, min_size=1, max_size=4).map(".".join)
PATTERN = st.tuples(
    st.lists(st.sampled_from(["a", "b", "*", "msgq"]), min_size=0, max_size=3),
    st.sampled_from(["*", ">", "a"]),
).map(lambda t: ".".join([*t[0], t[1]]))
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("sub"), PATTERN, st.integers(0, 3)),
        st.tuples(st.just("unsub"), PATTERN, st.integers(0, 3)),
        st.tuples(st.just("match"), SUBJECT, st.just(0)),
    ),
    max_size=60,
)


@pytest.mark.parametrize("scan_max", [subjects.SCAN_MAX, 1])
@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_trie_against_reference(scan_max: int, ops: list[tuple[str, str, int]]) -> None:
    """Any sequence of subscribes, unsubscribes and lookups: the trie (and its cache,
    asked again after every change, invalidated by scanning or by clearing) answers what
    testing every pattern would."""
    saved, subjects.SCAN_MAX = subjects.SCAN_MAX, scan_max
    try:
        _check_against_reference(ops)
    finally:
        subjects.SCAN_MAX = saved


def _check_against_reference(ops: list[tuple[str, str, int]]) -> None:
    trie: SubjectTrie[int] = SubjectTrie()
    held: set[tuple[str, int]] = set()
    seen: set[str] = set()
    for op, name, sub in ops:
        if op == "sub":
            if not is_pattern(name):
                continue
            assert trie.insert(name, sub) == ((name, sub) not in held)
            held.add((name, sub))
        elif op == "unsub":
            assert trie.remove(name, sub) == ((name, sub) in held)
            held.discard((name, sub))
        else:
            seen.add(name)
        for subject in seen:  # cached answers after the change, too
            expected = {s for p, s in held if pattern_matches(p, subject)}
            got = trie.match(subject)
            assert len(got) == len(set(got)), "a subscriber twice"
            assert set(got) == expected, (subject, sorted(held))
    for p, s in list(held):
        trie.remove(p, s)
    trie.check_empty()


# A small vocabulary, so that a peer's literal group and its patterns often meet.
SMALL_SUBJECT = st.lists(st.sampled_from(["a", "b"]), min_size=1, max_size=2).map(".".join)
SMALL_NAME = st.lists(st.sampled_from(["a", "b", "*"]), min_size=0, max_size=1).flatmap(
    lambda head: st.sampled_from(["a", "*", ">"]).map(lambda last: ".".join([*head, last]))
)
ROUTER_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("sub"), SMALL_NAME, st.integers(0, 2)),
        st.tuples(st.just("unsub"), SMALL_NAME, st.integers(0, 2)),
        st.tuples(st.just("leave"), st.just(""), st.integers(0, 2)),
        st.tuples(st.just("send"), SMALL_SUBJECT, st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ROUTER_OPS)
def test_router_recipients_against_reference(ops: list[tuple[str, str, int]]) -> None:
    """The router's recipients of a group (literal members, then matching pattern
    subscribers, each once) after any sequence of subscribes, unsubscribes and peers
    leaving, against testing every subscription of every peer."""
    router = Router()
    peers = [Peer(i + 1, f"p{i}", pid=i, uid=0, gid=0, now=0.0) for i in range(3)]
    for p in peers:
        router.add_peer(p)
    for op, name, i in ops:
        peer = peers[i]
        if op == "sub":
            router.subscribe(peer, name)
        elif op == "unsub":
            router.unsubscribe(peer, name)
        elif op == "leave":
            router.remove_peer(peer)
            router.add_peer(peer)
        else:
            got = list(router.with_wildcards(name, router.groups.get(name)))
            assert len(got) == len(set(got)), "a peer twice"
            want = {p for p in peers if any(pattern_matches(g, name) for g in p.groups)}
            assert set(got) == want
            literal = list(router.groups.get(name, ()))
            assert got[: len(literal)] == literal, "literal members first, in join order"
    for p in peers:
        router.remove_peer(p)
    assert not router.groups
    router.wildcards.check_empty()
