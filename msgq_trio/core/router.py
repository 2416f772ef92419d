"""Addressing: groups with join order, lnames, ``Group[N]`` instances and ``Group[?]`` anycast.

Pure data structure (no trio, no I/O); errors are returned as codes, not raised, because a
routing miss is a normal answer (no-recipient), not an exception in the broker.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from ..protocol.names import BROKER_NAME, BROKER_PREFIX, LNAME_PREFIX, is_pattern
from .access import SUBSCRIBE
from .peers import Peer
from .subjects import SubjectTrie

# Target kinds returned by parse_target.
# RESERVED: a group under ``msgq.`` (published by the broker only; clients may subscribe).
# PATTERN: a subscription pattern (``Zone.*``, also as ``Zone.*[0]``): never a target.
DIRECT, GROUP, INSTANCE, ANYCAST, BROKER, RESERVED, PATTERN = range(7)

_PARSE_CACHE_MAX = 65536


#: A target string resolved once per frame: (kind, base name, number). The base name is
#: the group of ``G[N]``/``G[?]``, else the target itself; the number is ``N``, or the
#: lname's id (-1 for a malformed one). A plain tuple, not a NamedTuple: the hot path
#: indexes and unpacks it per frame, which CPython specializes for exact tuples only.
Route = tuple[int, str, int]

#: A group's literal members in join order: a 1-tuple while it has one member (most
#: groups: 56 bytes against a dict's 220), a dict (insertion order) from the second
#: member on. Readers only iterate, test ``in`` and take ``len``, alike for both.
Members = tuple[Peer, ...] | dict[Peer, None]


class Router:
    """The subscription table and target resolution.

    Join order is kept per group (dict insertion order), so ``Group[0]`` is the member that
    joined first among those still present and ``Group[N]`` the N-th.

    Literal groups are a dict (``groups``); wildcard subscriptions (``Zone.*``) are in a
    :class:`~.subjects.SubjectTrie` (``wildcards``), consulted for one-way frames to a
    group only while ``wildcards.count`` is non-zero, so a bus without patterns routes as
    before. ``G[N]``, ``G[?]`` and calls choose among literal members only
    (docs/PROTOCOL.md, "Group names and wildcards").
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self.groups: dict[str, Members] = {}
        self.by_id: dict[int, Peer] = {}
        self._rng = rng or random.Random()
        self._parsed: dict[str, Route] = {}
        self.wildcards: SubjectTrie[Peer] = SubjectTrie()

    # -- membership -------------------------------------------------------------------
    def add_peer(self, peer: Peer) -> None:
        self.by_id[peer.id] = peer

    def remove_peer(self, peer: Peer) -> list[str]:
        """Forget the peer; returns the groups it implicitly left, in join order."""
        self.by_id.pop(peer.id, None)
        left = list(peer.groups)
        for g in left:
            self.unsubscribe(peer, g)
        return left

    def subscribe(self, peer: Peer, group: str) -> bool:
        """Add ``peer`` to ``group`` (a name or a valid pattern); False if it already was
        a member."""
        if is_pattern(group):
            if not self.wildcards.insert(group, peer):
                return False
            peer.groups[group] = len(peer.groups)
            return True
        groups = self.groups
        members = groups.get(group)
        if members is None:
            groups[group] = (peer,)
        elif peer in members:
            return False
        elif isinstance(members, tuple):
            groups[group] = dict.fromkeys((*members, peer))
        else:
            members[peer] = None
        peer.groups[group] = len(peer.groups)
        return True

    def unsubscribe(self, peer: Peer, group: str) -> bool:
        if group in peer.groups and is_pattern(group):
            self.wildcards.remove(group, peer)
            del peer.groups[group]
            return True
        members = self.groups.get(group)
        if members is None or peer not in members:
            return False
        if isinstance(members, tuple):
            del self.groups[group]  # its only member (a dict stays one till empty)
        else:
            del members[peer]
            if not members:
                del self.groups[group]
        del peer.groups[group]
        return True

    def members(self, group: str) -> list[Peer]:
        """The literal members of ``group`` in join order; for a pattern, the peers
        subscribed to that very pattern."""
        if is_pattern(group):
            return list(self.wildcards.patterns.get(group, ()))
        return list(self.groups.get(group, ()))

    def with_wildcards(self, group: str, members: Members | None) -> Iterable[Peer]:
        """Who a one-way frame to literal ``group`` reaches: its ``members`` (the literal
        ones, ``groups.get(group)``) and every wildcard subscriber whose pattern matches
        and whom the access policy lets subscribe to ``group`` itself (decided per
        delivery, from each peer's cached answers), each once. Ask only while
        ``wildcards.count`` is non-zero."""
        extra = self.wildcards.match(group)
        if not extra:
            return members or ()
        if members:
            out = list(members)
            for p in extra:
                if p not in members and (p.acl is None or p.acl.allowed(SUBSCRIBE, group)):
                    out.append(p)
            return out
        return [p for p in extra if p.acl is None or p.acl.allowed(SUBSCRIBE, group)]

    # -- resolution -------------------------------------------------------------------
    def parse_target(self, target: str) -> Route:
        """The ``Route`` of a target string; cached."""
        hit = self._parsed.get(target)
        if hit is not None:
            return hit
        parsed = _parse(target)
        if len(self._parsed) >= _PARSE_CACHE_MAX:
            self._parsed.clear()  # bounded: any workload re-parses in O(1) per target
        self._parsed[target] = parsed
        return parsed

    def resolve(self, target: str, sender: Peer | None) -> Iterable[Peer]:
        """Recipients of a frame to ``target``. Broadcast to a group skips the sender.

        Returns an empty sequence for unknown targets, including the broker's own address
        (the caller handles ``BROKER`` before asking).
        """
        return self.recipients(self.parse_target(target), sender)

    def recipients(self, route: Route, sender: Peer | None) -> Iterable[Peer]:
        """:meth:`resolve` for a target already parsed."""
        kind, base, index = route
        if kind == GROUP or kind == RESERVED:
            members = self.groups.get(base)
            if not members:
                return ()
            if sender is not None and sender in members:
                return [p for p in members if p is not sender]
            return members
        if kind == DIRECT:
            peer = self.by_id.get(index)
            return (peer,) if peer is not None else ()
        if kind == INSTANCE:
            members = self.groups.get(base)
            if not members or index >= len(members):
                return ()
            for i, p in enumerate(members):
                if i == index:
                    return (p,)
            return ()
        if kind == ANYCAST:
            members = self.groups.get(base)
            if not members:
                return ()
            return (self._rng.choice(list(members)),)
        return ()


def _parse(target: str) -> Route:
    if target == BROKER_NAME or target == "l.0":
        return (BROKER, target, 0)
    if target.startswith(LNAME_PREFIX):
        num = target[len(LNAME_PREFIX) :]
        if num.isdigit() and num.isascii():
            return (DIRECT, target, int(num))
        return (DIRECT, target, -1)
    if target.endswith("]"):
        open_at = target.rfind("[")
        if open_at > 0:
            base, inner = target[:open_at], target[open_at + 1 : -1]
            if is_pattern(base):
                return (PATTERN, base, 0)
            if inner == "?":
                return (ANYCAST, base, 0)
            if inner.isdigit() and inner.isascii():
                return (INSTANCE, base, int(inner))
        return (DIRECT, target, -1)  # malformed instance syntax: resolves to nobody
    if is_pattern(target):
        return (PATTERN, target, 0)
    if target.startswith(BROKER_PREFIX):
        return (RESERVED, target, 0)
    return (GROUP, target, 0)
