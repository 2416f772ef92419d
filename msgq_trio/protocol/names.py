"""Group names on the wire: which names clients may subscribe to, and the reserved ones.

Part of the wire contract, not of the broker's routing: the broker refuses a SUBSCRIBE
or BIND of an invalid name, and a plugin checks its configured group names with the same
rule at start (so a bad name fails the start instead of the first subscribe).
"""

from __future__ import annotations

import re

#: Groups whose names start with this are published by the broker only.
BROKER_PREFIX = "msgq."
#: The broker's own address (its commands: ping, members, ...).
BROKER_NAME = "msgq"
#: A client's unique name (lname) is this prefix plus a number: ``l.17``.
LNAME_PREFIX = "l."
#: The broker's notifications of clients joining and leaving.
MEMBERSHIP_GROUP = "msgq.membership"

#: The longest group name: what one length byte can count (AMQP 0-9-1 bounds queue and
#: exchange names, short strings, the same way).
MAX_NAME = 255


def valid_group_name(name: str) -> str | None:
    """Why ``name`` cannot be subscribed to, or None if it can."""
    if not name or len(name) > MAX_NAME:
        return f"group name must be 1..{MAX_NAME} characters"
    if name.startswith(LNAME_PREFIX):
        return f"group names starting with {LNAME_PREFIX!r} are reserved for lnames"
    if name == BROKER_NAME:
        return f"{BROKER_NAME!r} is the broker's own address"
    if any(c in name for c in "[]\0"):
        return "group names may not contain '[', ']' or NUL"
    return None


# -- hierarchical names and subscription patterns ---------------------------------------
# A group name is a sequence of tokens separated by ``.`` (``Zone.example.com`` has three).
# A subscription may be a *pattern*: a name one of whose tokens is a wildcard (NATS's
# syntax and semantics): ``*`` matches exactly one token, ``>`` (the last token only)
# matches one or more. A wildcard is a whole token: ``a*`` or ``x>`` are ordinary
# characters of a literal name, as in NATS. Patterns are for subscribing only: a frame's
# target is always a literal name (docs/PROTOCOL.md, "Group names and wildcards").

#: The token separator of hierarchical names.
TOKEN_SEP = "."
#: Matches exactly one token.
WILD_ONE = "*"
#: Matches one or more tokens; only as the last token of a pattern.
WILD_REST = ">"


#: A wildcard token anywhere in a name: found without splitting it (any length is cheap).
_WILD_TOKEN = re.compile(r"(?:^|\.)[*>](?:\.|$)")


def is_pattern(name: str) -> bool:
    """Whether ``name`` has a wildcard token (``*`` anywhere, ``>`` anywhere: a ``>``
    that is not last makes an invalid pattern, still a pattern, never a literal)."""
    return _WILD_TOKEN.search(name) is not None


def valid_pattern(pattern: str) -> str | None:
    """Why ``pattern`` (a name with a wildcard token) cannot be subscribed to, or None:
    the wire's structural rules. Its size is the broker's configured bound, checked by
    :func:`pattern_limits`."""
    if not pattern:
        return "a pattern must not be empty"
    tokens = pattern.split(TOKEN_SEP)
    if any(not t for t in tokens):
        return "a pattern's tokens must not be empty ('a..b', '.a' and 'a.' are not patterns)"
    if WILD_REST in tokens[:-1]:
        return f"{WILD_REST!r} may only be a pattern's last token"
    if tokens[0] + TOKEN_SEP == LNAME_PREFIX:
        return f"patterns starting with {LNAME_PREFIX!r} are reserved for lnames"
    if any(c in pattern for c in "[]\0"):
        return "patterns may not contain '[', ']' or NUL"
    return None


def pattern_limits(pattern: str, max_bytes: int, max_tokens: int) -> str | None:
    """Which bound ``pattern`` exceeds (``max_pattern_bytes``, ``max_pattern_tokens``:
    the broker's configuration), or None. Cheap on any input: no split, and the length
    in characters is tested before the encoding is measured."""
    if len(pattern) > max_bytes or len(pattern.encode("utf-8", "surrogatepass")) > max_bytes:
        return f"pattern longer than max_pattern_bytes={max_bytes} (UTF-8 bytes)"
    ntokens = pattern.count(TOKEN_SEP) + 1
    if ntokens > max_tokens:
        return f"pattern has {ntokens} tokens, more than max_pattern_tokens={max_tokens}"
    return None


def valid_subscription(name: str) -> str | None:
    """Why ``name`` (a group name or a pattern) cannot be subscribed to, or None (the
    wire's rules; a pattern's size is :func:`pattern_limits`'s)."""
    if is_pattern(name):
        return valid_pattern(name)
    return valid_group_name(name)


def valid_target_name(name: str) -> str | None:
    """Why ``name`` cannot be a frame's target because it is a pattern, or None.

    Only the wildcard rule: the rest of a target's syntax (lnames, ``G[N]``, ``G[?]``) is
    the router's. ``G[N]`` and ``G[?]`` are checked on their group ``G``."""
    base = name
    if name.endswith("]"):
        open_at = name.rfind("[")
        if open_at > 0:
            base = name[:open_at]
    if is_pattern(base):
        return (
            f"{name!r} is a subscription pattern: wildcards ('*', '>') are for subscribing "
            "only, a target must be a literal name"
        )
    return None


def pattern_matches(pattern: str, name: str) -> bool:
    """Whether literal ``name`` is matched by ``pattern`` (NATS semantics); a literal
    ``pattern`` matches itself only. The reference, one pair at a time: the broker's
    matcher (core/subjects.py) answers many patterns at once.

    A pattern whose first token is a wildcard (``>``, ``*.membership``) does not match
    the broker's own groups (``msgq.*``): one must spell ``msgq.`` to see them, as an
    MQTT topic filter starting with a wildcard does not match the ``$``-topics (MQTT
    3.1.1, 4.7.2), so a logger subscribed to ``>`` is not flooded with membership
    events."""
    p = pattern.split(TOKEN_SEP)
    n = name.split(TOKEN_SEP)
    if n[0] == BROKER_NAME and p[0] != BROKER_NAME:
        return False  # the broker's groups are matched only by patterns that name them
    for i, t in enumerate(p):
        if t == WILD_REST and i == len(p) - 1:
            return len(n) > i
        if i >= len(n):
            return False
        if t != WILD_ONE and t != n[i]:
            return False
    return len(n) == len(p)
