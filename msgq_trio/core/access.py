"""Access policy: which identity may send to, call, subscribe to, bind, consume from what.

Pure data (no trio). The configuration's ``[[access.rule]]`` tables are compiled once into
a :class:`Policy`; each admitted peer gets an :class:`Access` (or None: everything is
allowed, the Unix default, which costs the routing hot path one ``is None`` test). An
Access answers ``allowed(verb, name)`` from a per-peer cache, so a burst of frames to one
target costs one dict lookup per frame after the first; the globs are matched only on a
cache miss. Caches are bounded (cleared when full, like the router's parse cache).

Plugin commands: a plugin declares the verb each of its commands needs on the object its
params name (:class:`msgq_trio.config.CommandAccess`); the layer that loads plugins
hands the declarations to :class:`Policy` as data, keyed by group, so this module knows
no plugin's command names.

Identities (docs/SECURITY.md): ``tcp:NAME`` (a token's name or a client certificate's CN),
``unix:USER``, ``uid:N`` and ``gid:N`` (SO_PEERCRED), ``group:NAME`` (each group of that
user in the group database). ``who`` patterns are globs over these; a peer matches a
rule if any of its identities matches any pattern.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from fnmatch import fnmatchcase

from ..config import ACCESS_VERBS, AccessRule, AccessSettings, CommandAccess

#: Per-peer, per-verb cache entries before the cache is cleared.
_CACHE_MAX = 4096

SEND, SUBSCRIBE, CALL, BIND, CONSUME, PRODUCE = ACCESS_VERBS


def hash_token(token: str) -> str:
    """The configuration form of ``token``: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def check_token(token: str, tokens: dict[str, str]) -> str | None:
    """The identity name whose configured hash matches ``token``, or None.

    Every configured hash is compared (hmac.compare_digest, constant time per compare),
    so the time taken does not tell which identity came close.
    """
    presented = hash_token(token).encode()
    found: str | None = None
    for name, h in tokens.items():
        if hmac.compare_digest(presented, h.encode()):
            found = name
    return found


class Access:
    """What one peer may do: the grants of the rules that matched it, with caches."""

    __slots__ = ("_cache", "_patterns", "control", "identity")

    def __init__(self, identity: str, rules: list[AccessRule]) -> None:
        self.identity = identity
        self._patterns: dict[str, tuple[str, ...]] = {
            verb: tuple(p for r in rules for p in getattr(r, verb)) for verb in ACCESS_VERBS
        }
        self.control = any(r.control for r in rules)
        self._cache: dict[str, dict[str, bool]] = {verb: {} for verb in ACCESS_VERBS}

    def allowed(self, verb: str, name: str) -> bool:
        """May this peer do ``verb`` on group/queue ``name``? (Cached.)"""
        cache = self._cache[verb]
        hit = cache.get(name)
        if hit is None:
            hit = any(fnmatchcase(name, p) for p in self._patterns[verb])
            if len(cache) >= _CACHE_MAX:
                cache.clear()
            cache[name] = hit
        return hit


class Policy:
    """The compiled ``[[access.rule]]`` list, and the plugins' declared command verbs.

    Args:
        settings: the ``[access]`` configuration.
        commands: group -> what the commands answered on it need (declared by the plugin
            that answers them; the group is the one the broker enforces it on, already
            resolved, e.g. ``[access] queue_group`` for the queue plugin).
    """

    def __init__(
        self, settings: AccessSettings, commands: Mapping[str, CommandAccess] | None = None
    ) -> None:
        self.rules = list(settings.rules)
        self.commands: dict[str, CommandAccess] = dict(commands or {})

    def for_peer(self, principals: list[str], *, remote: bool) -> Access | None:
        """The Access of a peer known as ``principals`` (e.g. ``["unix:bob", "uid:1000",
        "gid:1000", "group:bob", "group:audio"]``; the first is the identity shown).

        None = unrestricted: a Unix peer that no rule names. A TCP peer no rule names
        gets an Access that grants nothing (a network identity gets only what is granted).
        """
        matched = [
            r for r in self.rules if any(fnmatchcase(p, w) for p in principals for w in r.who)
        ]
        if not matched and not remote:
            return None
        return Access(principals[0], matched)
