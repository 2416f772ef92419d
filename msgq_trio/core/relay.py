"""Relays and bindings: transparent insertion of a queue in front of a group
(docs/QUEUE.md), and the relayed stamps its binder forwards stored traffic with.

A binding maps a group to the one peer bound to it. A MESSAGE or single-answer REQUEST to
the group (or ``G[?]``) from anyone but that peer goes to that peer alone (``binder``
says what is not redirected, and why); the binder itself reaches the real members. Empty
in a broker without bindings, and every routing path tests ``bindings`` for emptiness
first, so routing costs one truth test more when nothing is bound.

Pure data: no trio, no I/O. Takes routes already resolved (:class:`~.router.Route`).
"""

from __future__ import annotations

import logging

from ..protocol.codes import Flag, FrameType
from ..protocol.framing import Frame
from .peers import Peer
from .router import ANYCAST, DIRECT, GROUP, Route, Router

log = logging.getLogger("msgq_trio.broker")

_NOTIFY = FrameType.NOTIFY
#: A plain int: ``frame.flags & Flag.ALL`` would go through enum.Flag.__and__, which is
#: far slower than an int's and runs per routed frame.
_FLAG_ALL = int(Flag.ALL)


class Relays:
    """The bindings of one broker (group -> the peer bound to it)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.bindings: dict[str, Peer] = {}

    def binder(self, peer: Peer, frame: Frame, route: Route) -> Peer | None:
        """The peer that takes ``frame`` (to ``route``) instead of its target's members,
        or None.

        Redirected to the group's binder: a MESSAGE, or a REQUEST without the ALL flag,
        to a bound group ``G`` or ``G[?]`` from anyone but the binder: what a queue can
        store and later hand to the group (or to one member) as the sender addressed it.
        Never redirected, because a stored copy could not keep their meaning:

        * NOTIFY: a fire-and-forget broadcast to whoever is subscribed now;
        * ``G[N]``: one named instance (a queue cannot hold a message for a process that
          may never return, and its forwarding would lose the index);
        * an ALL request (``call_all``): one answer per member, which one stored request
          cannot give;
        * lnames, ``msgq`` and ``msgq.*``: so the binder's own forwarding to ``l.N`` and
          every answer reach their target.
        """
        kind = route[0]
        if kind != GROUP and kind != ANYCAST:
            return None
        if frame.type == _NOTIFY or frame.flags & _FLAG_ALL:
            return None
        binder = self.bindings.get(route[1])
        if binder is None or binder is peer:
            return None
        return binder

    def source(self, peer: Peer, frame: Frame, route: Route) -> bytes:
        """The source to forward ``frame`` from ``peer`` with: a *relayed stamp* if the
        binder ``peer`` wrote a valid one, else ``peer.stamp`` (a client's own or forged
        source is replaced, as always).

        A relayed stamp is ``peer.stamp NUL origin_lname NUL origin_name``: a binder
        forwarding stored traffic says whom it came from, so members see the original
        producer, marked as relayed by the binder (docs/PROTOCOL.md "Source"). It is
        accepted only from the peer that holds the binding of the target's group, to that
        group (``G``, ``G[?]``, ``G[N]``) or to one of its members by lname: a binder can
        already see and answer all of that group's traffic, so the origin it states gives
        it no power over anyone else. Answers still go to the first lname (the binder).
        """
        src = bytes(frame.source)
        head = peer.stamp + b"\0"
        if not src.startswith(head):
            return peer.stamp
        lname, sep, name = src[len(head) :].partition(b"\0")
        if not sep or not lname.startswith(b"l.") or b"\0" in name:
            return peer.stamp
        try:
            src.decode()
        except UnicodeDecodeError:
            return peer.stamp
        kind, base, index = route
        if kind == DIRECT:
            member = self.router.by_id.get(index)
            if member is not None and any(self.bindings.get(g) is peer for g in member.groups):
                return src
            return peer.stamp
        return src if self.bindings.get(base) is peer else peer.stamp

    @staticmethod
    def no_fds_to(binder: Peer, target: str, route: Route) -> str:
        """The refusal of descriptors sent to a bound group (the binder stores what it
        takes, and a descriptor cannot be stored): names the binding and the way round."""
        return (
            f"{target!r} is bound to {binder.describe()}, which stores its traffic: file "
            f"descriptors cannot be stored; send them to one member ({route[1]}[N] or its "
            "lname)"
        )

    def bind(self, peer: Peer, group: str) -> Peer | None:
        """Bind ``group`` to ``peer`` unless another peer holds it; returns that holder
        (``peer`` itself if it already held it), or None once bound."""
        holder = self.bindings.get(group)
        if holder is not None:
            return holder
        self.bindings[group] = peer
        log.info("group %r bound to %s", group, peer.describe())
        return None

    def unbind(self, peer: Peer, group: str) -> bool:
        """End ``peer``'s binding of ``group``; False if it held none."""
        if self.bindings.get(group) is not peer:
            return False
        del self.bindings[group]
        log.info("binding of group %r to %s removed on request", group, peer.describe())
        return True

    def held_by(self, peer: Peer) -> list[str]:
        """The groups bound to ``peer``."""
        return [g for g, holder in self.bindings.items() if holder is peer]

    def peer_gone(self, peer: Peer) -> None:
        """Drop the bindings of a peer that disconnected."""
        if self.bindings:
            for g in self.held_by(peer):
                del self.bindings[g]
                log.info("binding of group %r to %s removed: it disconnected", g, peer.describe())
