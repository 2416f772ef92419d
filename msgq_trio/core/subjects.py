"""The wildcard matcher: subscription patterns in a token trie, with a bounded result cache.

Pure data structure (no trio, no I/O), after nats-server's sublist (``server/sublist.go``):
a pattern is stored along the path of its tokens, with ``*`` and ``>`` as their own
edges, so looking up a subject walks at most the subject's tokens (and, at each level,
the literal edge and the ``*`` edge): its cost grows with the tokens and the patterns
that actually match, never with the number of patterns. Literal group names are not
here: the router keeps them in a dict (one lookup, whatever the number of groups).

The result of a lookup (subject -> matching subscribers, each once even when several of
its patterns match) is cached. The cache is bounded (:data:`CACHE_MAX` subjects, cleared
when full: a miss costs one walk, so any workload stays O(tokens) per message). A change
(a pattern subscribed or unsubscribed) drops the cached subjects it affects: in a small
cache (up to :data:`SCAN_MAX` subjects) exactly those the pattern matches, found by
testing each, as sublist's ``addToCache``/``removeFromCache`` do, so the rest stays warm;
a larger cache is cleared instead. Testing a cached subject costs about what walking the
trie for it again would, so clearing never costs more work in total, and it keeps a
change O(1): a client leaving with 4,096 patterns does not make the broker test them
against 1,024 cached subjects each.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from ..protocol.names import BROKER_NAME, TOKEN_SEP, WILD_ONE, WILD_REST, pattern_matches

S = TypeVar("S", bound=Hashable)

#: Cached subjects before the cache is cleared; nats-server's sublist keeps 1,024
#: (``slCacheMax``). A change scans the cache, so a larger one makes subscribing dearer.
CACHE_MAX = 1024
#: Largest cache a change scans for the subjects it affects; a larger one is cleared.
SCAN_MAX = 64


class _Node(Generic[S]):
    """One token position: edges to the next token, and the subscribers of the patterns
    that end here (``here``) or continue with ``>`` (``rest``)."""

    __slots__ = ("children", "here", "rest", "star")

    def __init__(self) -> None:
        self.children: dict[str, _Node[S]] = {}
        self.star: _Node[S] | None = None
        self.here: dict[S, None] = {}
        self.rest: dict[S, None] = {}

    def empty(self) -> bool:
        return not (self.children or self.star or self.here or self.rest)


class SubjectTrie(Generic[S]):
    """Wildcard subscriptions: (pattern, subscriber) pairs, and lookups by subject.

    Patterns must be valid (``protocol.names.valid_pattern``); the trie does not check.
    A subscriber is any hashable (the broker's peers). Lookups return subscribers in a
    stable order (the trie's, then subscription order), each once.
    """

    def __init__(self) -> None:
        self._root: _Node[S] = _Node()
        #: pattern -> its subscribers, in subscription order (``members`` of a pattern).
        self.patterns: dict[str, dict[S, None]] = {}
        self._cache: dict[str, tuple[S, ...]] = {}
        #: (pattern, subscriber) pairs held.
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def insert(self, pattern: str, sub: S) -> bool:
        """Subscribe ``sub`` to ``pattern``; False if it already was."""
        subs = self.patterns.setdefault(pattern, {})
        if sub in subs:
            return False
        subs[sub] = None
        node = self._root
        tokens = pattern.split(TOKEN_SEP)
        for t in tokens[:-1]:
            node = self._child(node, t)
        last = tokens[-1]
        if last == WILD_REST:
            node.rest[sub] = None
        else:
            self._child(node, last).here[sub] = None
        self.count += 1
        self._invalidate(pattern)
        return True

    def remove(self, pattern: str, sub: S) -> bool:
        """Unsubscribe ``sub`` from ``pattern``; False if it was not subscribed. Empty
        nodes are pruned, so memory follows the patterns held."""
        subs = self.patterns.get(pattern)
        if subs is None or sub not in subs:
            return False
        del subs[sub]
        if not subs:
            del self.patterns[pattern]
        tokens = pattern.split(TOKEN_SEP)
        path: list[tuple[_Node[S], str]] = []
        node = self._root
        for t in tokens[:-1]:
            nxt = node.star if t == WILD_ONE else node.children.get(t)
            assert nxt is not None, "trie and pattern table disagree"
            path.append((node, t))
            node = nxt
        last = tokens[-1]
        if last == WILD_REST:
            del node.rest[sub]
        else:
            leaf = node.star if last == WILD_ONE else node.children[last]
            assert leaf is not None
            del leaf.here[sub]
            path.append((node, last))
            node = leaf
        # Prune from the leaf up while nodes are empty.
        while path and node.empty():
            parent, t = path.pop()
            if t == WILD_ONE:
                parent.star = None
            else:
                del parent.children[t]
            node = parent
        self.count -= 1
        self._invalidate(pattern)
        return True

    def match(self, subject: str) -> tuple[S, ...]:
        """The subscribers of every pattern matching literal ``subject``, each once."""
        hit = self._cache.get(subject)
        if hit is not None:
            return hit
        found: dict[S, None] = {}
        if self.count:
            tokens = subject.split(TOKEN_SEP)
            root = self._root
            if tokens[0] == BROKER_NAME:
                # A leading wildcard does not match the broker's groups (names.py).
                nxt = root.children.get(BROKER_NAME)
                if nxt is not None:
                    _walk(nxt, tokens, 1, found)
            else:
                _walk(root, tokens, 0, found)
        result = tuple(found)
        cache = self._cache
        if len(cache) >= CACHE_MAX:
            cache.clear()
        cache[subject] = result
        return result

    def _child(self, node: _Node[S], token: str) -> _Node[S]:
        if token == WILD_ONE:
            if node.star is None:
                node.star = _Node()
            return node.star
        nxt = node.children.get(token)
        if nxt is None:
            nxt = node.children[token] = _Node()
        return nxt

    def _invalidate(self, pattern: str) -> None:
        """Drop the cached subjects ``pattern`` matches (their result changed)."""
        cache = self._cache
        if len(cache) > SCAN_MAX:
            cache.clear()
            return
        stale = [s for s in cache if pattern_matches(pattern, s)]
        for s in stale:
            del cache[s]

    def check_empty(self) -> None:
        """Assert that nothing is held (leak check for tests)."""
        assert not self.count and not self.patterns, f"patterns left: {list(self.patterns)[:5]}"
        assert self._root.empty(), "trie nodes left behind"


def _walk(node: _Node[S], tokens: list[str], i: int, found: dict[S, None]) -> None:
    """Collect into ``found`` the subscribers below ``node`` matching ``tokens[i:]``."""
    n = len(tokens)
    while True:
        if node.rest and i < n:
            found.update(node.rest)  # ``prefix.>``: one or more tokens remain
        if i == n:
            found.update(node.here)
            return
        star = node.star
        nxt = node.children.get(tokens[i])
        i += 1
        if star is not None:
            if nxt is None:
                node = star
                continue
            _walk(star, tokens, i, found)
        if nxt is None:
            return
        node = nxt
