"""Group names on the wire: which names clients may subscribe to, and the reserved ones.

Part of the wire contract, not of the broker's routing: the broker refuses a SUBSCRIBE
or BIND of an invalid name, and a plugin checks its configured group names with the same
rule at start (so a bad name fails the start instead of the first subscribe).
"""

from __future__ import annotations

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
