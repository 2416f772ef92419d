"""The broker's own commands: requests to ``msgq`` (``subscribe``, ``members``, ``bind``...).

A command handler takes (peer, params) and returns the answer's body, or raises
:class:`CommandError` (the answer is an ERROR with its code). Operations code adds its
commands to the same table (``Broker.commands``). Pure: no trio, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..protocol.codes import PROTOCOL_VERSION, ErrorCode, FrameType
from ..protocol.errors import RemoteProtocolError
from ..protocol.framing import Frame, encode_cbor, encode_frame
from ..protocol.names import (
    is_pattern,
    pattern_limits,
    valid_group_name,
    valid_subscription,
)
from .access import BIND, CALL, SEND, SUBSCRIBE
from .delivery import BROKER_STAMP
from .host import BrokerHost
from .peers import Peer
from .router import GROUP

_REPLY = FrameType.REPLY


class CommandError(Exception):
    """Raised by a broker command handler: becomes an ERROR answer with ``code``."""

    def __init__(self, code: ErrorCode, message: str, data: object = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data


Command = Callable[[Peer, Any], object]


class BrokerCommands:
    """The command table of one broker and the built-in commands."""

    def __init__(self, broker: BrokerHost) -> None:
        self._broker = broker
        self.table: dict[str, Command] = {
            "subscribe": self._subscribe,
            "unsubscribe": self._unsubscribe,
            "members": self._members,
            "groups": self._groups,
            "version": self._version,
            "ping": lambda _peer, _params: "pong",
            "bind": self._bind,
            "unbind": self._unbind,
            "trace": self._trace,
        }

    def run(self, peer: Peer, frame: Frame, command: str) -> None:
        """Answer ``peer``'s REQUEST ``frame`` to the broker (``command`` from its header)."""
        rid = frame.request_id
        delivery = self._broker.delivery
        fn = self.table.get(command)
        if fn is None:
            delivery.reply_error(
                peer,
                rid,
                ErrorCode.UNKNOWN_COMMAND,
                f"the broker has no command {command!r}",
                data=sorted(self.table),
            )
            return
        try:
            result = fn(peer, frame.body())
        except CommandError as exc:
            delivery.reply_error(peer, rid, exc.code, str(exc), data=exc.data)
            return
        except RemoteProtocolError as exc:
            delivery.reply_error(peer, rid, ErrorCode.BAD_REQUEST, str(exc))
            return
        pieces = encode_frame(
            _REPLY,
            target=peer.lname,
            request_id=rid,
            body=encode_cbor(result),
            source=BROKER_STAMP,
        )
        delivery.send_from_broker(peer, pieces, "an answer it asked for")

    @staticmethod
    def _group_param(params: object) -> str:
        group = params.get("group") if isinstance(params, dict) else None
        if not isinstance(group, str):
            raise CommandError(ErrorCode.BAD_REQUEST, "params must be {'group': str}")
        return group

    def _subscribe(self, peer: Peer, params: object) -> bool:
        b = self._broker
        group = self._group_param(params)
        limits = b.limits
        # A pattern's bounds first, before splitting it into tokens costs memory.
        if is_pattern(group):
            over = pattern_limits(group, limits.max_pattern_bytes, limits.max_pattern_tokens)
            if over:
                raise CommandError(ErrorCode.LIMIT_EXCEEDED, over)
        why = valid_subscription(group)
        if why:
            raise CommandError(ErrorCode.BAD_REQUEST, why)
        if peer.acl is not None and not peer.acl.allowed(SUBSCRIBE, group):
            raise CommandError(ErrorCode.FORBIDDEN, b.refuse(peer, "subscribe to", group))
        limit = b.limits.max_subscriptions
        if group not in peer.groups and len(peer.groups) >= limit:
            raise CommandError(ErrorCode.LIMIT_EXCEEDED, f"max_subscriptions={limit} reached")
        acct = peer.account
        if group not in peer.groups and len(peer.groups) >= acct.subscriptions_share:
            # Over its even part of its user's quota: the user's sum decides (core/users.py).
            used, quota = acct.subscriptions(), acct.limits["subscriptions"]
            if used >= quota:
                raise CommandError(
                    ErrorCode.LIMIT_EXCEEDED,
                    b.quota_refused(peer, "subscriptions", used, quota, acct.key),
                )
        added = b.router.subscribe(peer, group)
        if added:
            b.publish_membership(
                "subscribed", {"lname": peer.lname, "name": peer.name, "group": group}
            )
        return added

    def _unsubscribe(self, peer: Peer, params: object) -> bool:
        b = self._broker
        group = self._group_param(params)
        removed = b.router.unsubscribe(peer, group)
        if removed:
            b.publish_membership(
                "unsubscribed",
                {"lname": peer.lname, "name": peer.name, "group": group, "reason": "request"},
            )
        return removed

    def _members(self, peer: Peer, params: object) -> list[dict[str, object]]:
        b = self._broker
        group = self._group_param(params)
        acl = peer.acl
        if acl is not None and not any(acl.allowed(v, group) for v in (SUBSCRIBE, SEND, CALL)):
            raise CommandError(ErrorCode.FORBIDDEN, b.refuse(peer, "list members of", group))
        return [{"lname": p.lname, "name": p.name, "pid": p.pid} for p in b.router.members(group)]

    def _groups(self, peer: Peer, _params: object) -> list[dict[str, object]]:
        """``groups``: every group with members, sorted, as ``{"group", "members"}`` (the
        count); a client under access rules sees the groups it may list the members of."""
        b = self._broker
        acl = peer.acl
        return [
            {"group": g, "members": len(members)}
            for g, members in sorted(b.router.groups.items())
            if members and (acl is None or any(acl.allowed(v, g) for v in (SUBSCRIBE, SEND, CALL)))
        ]

    def _bind(self, peer: Peer, params: object) -> bool:
        """``bind {"group"}``: from now on messages and single-answer requests to the group
        (or ``G[?]``) from anyone but ``peer`` go to ``peer``, the rest as before (see
        ``Relays.binder``; transparent insertion of a queue, docs/QUEUE.md). Returns False
        if ``peer`` already held the binding. The binding ends with ``unbind`` or when
        ``peer`` disconnects.

        Raises (as answers): bad-request for an invalid group name, forbidden when another
        client holds the binding (named in the message)."""
        b = self._broker
        group = self._group_param(params)
        why = valid_group_name(group)
        if why:
            raise CommandError(ErrorCode.BAD_REQUEST, why)
        if b.router.parse_target(group)[0] != GROUP:
            raise CommandError(ErrorCode.BAD_REQUEST, f"{group!r} cannot be bound")
        if peer.acl is not None and not peer.acl.allowed(BIND, group):
            raise CommandError(ErrorCode.FORBIDDEN, b.refuse(peer, "bind", group))
        holder = b.relays.bind(peer, group)
        if holder is peer:
            return False
        if holder is not None:
            raise CommandError(
                ErrorCode.FORBIDDEN, f"group {group!r} is already bound to {holder.describe()}"
            )
        return True

    def _unbind(self, peer: Peer, params: object) -> bool:
        """``unbind {"group"}``: end ``peer``'s binding; False if it held none."""
        return self._broker.relays.unbind(peer, self._group_param(params))

    def _trace(self, peer: Peer, params: object) -> dict[str, object]:
        """``trace {"trace_id": 32 hex digits}``: the hops of that trace the broker
        recorded (core/traces.py; docs/PROTOCOL.md, "Trace context"). A client an
        access policy restricts may not read them: hops name other clients and their
        commands."""
        tid = params.get("trace_id") if isinstance(params, dict) else None
        if not isinstance(tid, str) or len(tid) != 32 or not set(tid) <= set("0123456789abcdef"):
            raise CommandError(
                ErrorCode.BAD_REQUEST, "params must be {'trace_id': 32 lowercase hex digits}"
            )
        if peer.acl is not None:
            raise CommandError(
                ErrorCode.FORBIDDEN, self._broker.refuse(peer, "read the hops of trace", tid)
            )
        return self._broker.traces.hops(tid)

    def _version(self, _peer: Peer, _params: object) -> dict[str, object]:
        return {"broker": self._broker.version, "protocol": PROTOCOL_VERSION}
