"""Per-user accounting: what each user holds in the broker, against its quotas.

A user is a local uid (SO_PEERCRED, key ``uid:N``) or an authenticated TCP identity
(``tcp:NAME``). What a user holds is charged to it as the *owner*, as dbus-broker does
(bus/user.c: "all resources allocated on that peer are accounted on that pinned user"):
the bytes and descriptors queued for its connections, its connections, its
subscriptions, the requests its connections wait answers for (docs/SECURITY.md,
"Per-user quotas", says why the receiver and not the sender).

The figures are not kept as running totals: they are the sums of the per-connection
figures the broker keeps anyway (``Peer.outq_bytes``, ``outq_fds``, ``groups``,
``pending_out``), so no code path that changes a queue has to remember a second counter.
The sum is taken only when a connection holds more than its even part of its user's
quota (``UserAccount.memory_share`` etc.): if every connection of a user is within its
part, the user is within its quota. The smallest part of any user (``Users.memory_floor``,
``fds_floor``) lowers the bar of the compare delivery already makes per receiver, so a
receiver below it costs nothing more per message; a receiver above it is checked against
its own part, and only above that its user's connections are summed (at most
``quotas.connections``).

Pure data: no trio, no sockets, no logging (given no memory total, :class:`Users` asks
:meth:`QuotaSettings.memory_total`, which reads the machine's figure once).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from ..config import QuotaSettings


class Peer(Protocol):
    """What an account reads of a connection (``core.peers.Peer``, which imports this
    module: named here by its shape, not imported)."""

    outq_bytes: int
    outq_fds: int
    groups: dict[str, int]
    pending_out: set[tuple[int, int]]
    account: Any


#: Above any real figure: the limit of a quota that is off.
UNLIMITED = 1 << 62

#: What each quota counts, for refusals and ``ctl users``.
UNITS = {
    "memory": "bytes queued",
    "connections": "connections",
    "fds": "descriptors queued",
    "subscriptions": "subscriptions",
    "pending_requests": "pending requests",
}


class UserAccount:
    """One user's connections and quotas. Its use is read from its connections."""

    __slots__ = (
        "fds_share",
        "held",
        "key",
        "limits",
        "memory_share",
        "peers",
        "pending_share",
        "refused",
        "subscriptions_share",
    )

    def __init__(self, key: str, limits: dict[str, int]) -> None:
        self.key = key
        self.peers: set[Peer] = set()
        #: Refusals so far, by quota (the connections it cost are counted as ``drops``).
        self.refused: Counter[str] = Counter()
        #: Frames held (their senders waiting) because this user had no room, by quota.
        self.held: Counter[str] = Counter()
        self.limits = limits
        self.memory_share = self.fds_share = self.pending_share = self.subscriptions_share = 0
        self.reshare()

    def __repr__(self) -> str:
        return f"<UserAccount {self.key} connections={len(self.peers)}>"

    def reshare(self) -> None:
        """Recompute each connection's even part of the quotas (after a connection came
        or went, or the limits changed)."""
        n = max(1, len(self.peers))
        lim = self.limits
        self.memory_share = lim["memory"] // n
        self.fds_share = lim["fds"] // n
        self.pending_share = lim["pending_requests"] // n
        self.subscriptions_share = lim["subscriptions"] // n

    # -- use ------------------------------------------------------------------------
    def memory(self) -> int:
        """Bytes queued in the broker for this user's connections."""
        return sum(p.outq_bytes for p in self.peers)

    def fds(self) -> int:
        """Descriptors queued in the broker for this user's connections."""
        return sum(p.outq_fds for p in self.peers)

    def subscriptions(self) -> int:
        return sum(len(p.groups) for p in self.peers)

    def pending_requests(self) -> int:
        """Requests this user's connections made that are not answered yet."""
        return sum(len(p.pending_out) for p in self.peers)

    def use(self) -> dict[str, int]:
        """The use of every quota."""
        return {
            "memory": self.memory(),
            "connections": len(self.peers),
            "fds": self.fds(),
            "subscriptions": self.subscriptions(),
            "pending_requests": self.pending_requests(),
        }

    # -- checks (called when a connection holds more than its part) ---------------------
    def memory_full(self, size: int) -> bool:
        """True if ``size`` more queued bytes would take this user over its memory quota.
        A user with nothing queued may always take one frame (else a frame larger than
        the quota could never be delivered): the quota is overshot by one frame at most."""
        used = self.memory()
        return used > 0 and used + size > self.limits["memory"]

    def fds_full(self, nfds: int) -> bool:
        """True if ``nfds`` more queued descriptors would go over the ``fds`` quota."""
        used = self.fds()
        return used > 0 and used + nfds > self.limits["fds"]


class Users:
    """The accounts of the users connected now, and the quotas in force.

    An account exists while its user has a connection. Quotas are recomputed for every
    account when the settings change (:meth:`configure`): a tightened quota refuses new
    use from then on and drops nothing already held.
    """

    def __init__(self, settings: QuotaSettings | None = None, memory_total: int = 0) -> None:
        self.accounts: dict[str, UserAccount] = {}
        #: The smallest ``memory_share`` / ``fds_share`` of any account: a receiver
        #: holding less is within its user's quota whoever its user is, so delivery
        #: looks closer only at receivers above it (core/delivery.py).
        self.memory_floor = self.fds_floor = UNLIMITED
        #: Called after the floors changed (``Delivery.recap``).
        self.on_floors: Callable[[], None] | None = None
        self.settings = settings or QuotaSettings()
        self.memory_total = 0
        self.configure(self.settings, memory_total)

    def configure(self, settings: QuotaSettings, memory_total: int = 0) -> None:
        """Enforce ``settings`` from now on (``memory_total`` 0: the settings' own
        figure, which may read the machine's memory)."""
        self.settings = settings
        self.memory_total = memory_total or settings.memory_total()
        for acct in self.accounts.values():
            acct.limits = self.limits_for(acct.key)
            acct.reshare()
        self._floors()

    def _floors(self) -> None:
        accts = self.accounts.values()
        self.memory_floor = min((a.memory_share for a in accts), default=UNLIMITED)
        self.fds_floor = min((a.fds_share for a in accts), default=UNLIMITED)
        if self.on_floors is not None:
            self.on_floors()

    def limits_for(self, key: str) -> dict[str, int]:
        """The quotas of user ``key`` (all :data:`UNLIMITED` while quotas are off)."""
        limits = self.settings.for_user(key, self.memory_total)
        if not self.settings.enabled:
            return dict.fromkeys(limits, UNLIMITED)
        return limits

    @staticmethod
    def key_for(uid: int, remote: bool, principals: list[str] | None) -> str:
        """The user a connection is charged to: its authenticated ``tcp:NAME`` over TCP,
        else ``uid:N``."""
        if remote and principals:
            return principals[0]
        return f"uid:{uid}"

    def admit(self, key: str) -> str:
        """Why a new connection of user ``key`` is refused ("" if it is not): the
        ``connections`` quota. Counted as a refusal."""
        acct = self.accounts.get(key)
        have = len(acct.peers) if acct is not None else 0
        limit = self.limits_for(key)["connections"] if acct is None else acct.limits["connections"]
        if have < limit:
            return ""
        if acct is not None:
            acct.refused["connections"] += 1
        return quota_message("connections", key, have, limit)

    def attach(self, peer: Peer, key: str) -> UserAccount:
        """Charge ``peer`` to user ``key`` from now on."""
        acct = self.accounts.get(key)
        if acct is None:
            acct = self.accounts[key] = UserAccount(key, self.limits_for(key))
        acct.peers.add(peer)
        acct.reshare()
        self._floors()
        peer.account = acct
        return acct

    def detach(self, peer: Peer) -> None:
        """``peer`` is gone: its user no longer holds what it held. Idempotent."""
        acct: UserAccount = peer.account
        if acct.peers:
            key = acct.key
            acct.peers.discard(peer)
            if acct.peers:
                acct.reshare()
            elif self.accounts.get(key) is acct:
                del self.accounts[key]
            self._floors()

    def rows(self) -> list[dict[str, object]]:
        """One row per connected user: use and limit of each quota, the quotas at their
        limit (for memory and descriptors: within one held frame of it), refusals and
        holds so far; the users using most memory first."""
        rows: list[dict[str, object]] = []
        for acct in self.accounts.values():
            use = acct.use()
            rows.append(
                {
                    "user": acct.key,
                    "use": use,
                    "limits": dict(acct.limits),
                    "at_limit": sorted(
                        q
                        for q, v in use.items()
                        if v >= acct.limits[q]
                        or (q in ("memory", "fds") and v and q in acct.held and at_edge(acct, q))
                    ),
                    "refused": dict(acct.refused),
                    "held": dict(acct.held),
                }
            )
        rows.sort(key=lambda r: (-r["use"]["memory"], r["user"]))  # type: ignore[index]
        return rows


def at_edge(acct: UserAccount, quota: str) -> bool:
    """True if the user's ``memory`` (``fds``) is full for the smallest frame that
    could come, the one the last hold was for being unknown here: within 1/16 of it."""
    limit = acct.limits[quota]
    use = acct.memory() if quota == "memory" else acct.fds()
    return use > limit - limit // 16


def quota_message(quota: str, key: str, used: int, limit: int) -> str:
    """The text of a refusal: names the quota, the user and the figures."""
    return f"quota {quota!r} of user {key} reached: {used} {UNITS[quota]} of {limit}"


#: The account of a peer no :class:`Users` charges (a core built without quotas, a
#: test's bare Peer): every check passes.
UNACCOUNTED = UserAccount("none", dict.fromkeys(UNITS, UNLIMITED))
