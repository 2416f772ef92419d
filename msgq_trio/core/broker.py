"""The broker core: one object that owns a broker's state and the lifecycle of its peers.

Pure and deterministic: no trio, no sockets; time comes in as ``now``. The I/O layer
calls :meth:`Broker.handle_many` for every batch of frames a client sends; the core
queues outgoing buffers on the receivers' ``Peer.outq`` and records what that asks of the
I/O layer in :attr:`Broker.effects` (writers to wake, peers to drop, senders to pause or
hold), which the I/O layer applies and resets.

The jobs live apart: :mod:`.dispatch` (one dispatcher, one set of checks per frame),
:mod:`.delivery` (queues, bounds, backpressure decisions, the broker's error answers),
:mod:`.relay` (bindings and relayed stamps), :mod:`.commands` (the broker's own
commands), :mod:`.tap` (the capture hooks), :mod:`.rpc` (pending calls), :mod:`.router`
(groups and targets), :mod:`.access` (the access policy), :mod:`.peers` (one peer's
state). This module holds what ties them together: connecting and forgetting peers,
dropping them, the access policy in force, membership notifications, heartbeats and
RPC deadlines.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Collection, Mapping

from ..config import AccessSettings, CommandAccess, Limits, QuotaSettings
from ..protocol.codes import PROTOCOL_VERSION, ErrorCode, FrameType
from ..protocol.framing import Frame, Run, encode_cbor, encode_frame
from ..protocol.names import MEMBERSHIP_GROUP
from .access import BIND, SUBSCRIBE, Access, Policy
from .cmdstats import CommandStats
from .commands import BrokerCommands, Command, CommandError
from .delivery import BROKER_LNAME, BROKER_STAMP, Delivery
from .dispatch import Dispatcher
from .effects import Effects
from .peers import Peer
from .relay import Relays
from .router import ANYCAST, Router
from .rpc import Failure, PendingReplies
from .tap import TapFn, TapRunFn, Taps
from .traces import Traces
from .users import Users, quota_message

log = logging.getLogger("msgq_trio.broker")


class Broker:
    """The routing core of one broker process.

    Args:
        limits: the bounds to enforce (see :class:`msgq_trio.config.Limits`).
        version: the broker's software version, reported to clients.
        rng: random source for ``Group[?]`` (seed it in tests).
        dup_fd, close_fd: descriptor operations, injected so the core stays free of I/O
            in tests.
    """

    def __init__(
        self,
        limits: Limits,
        *,
        version: str,
        rng: random.Random | None = None,
        dup_fd: Callable[[int], int] = os.dup,
        close_fd: Callable[[int], None] = os.close,
        quotas: QuotaSettings | None = None,
        memory_total: int = 0,
    ) -> None:
        self._limits = limits
        #: Per-user accounting and quotas (core/users.py); ``memory_total`` 0 = the
        #: figure ``quotas`` names (the machine's memory by default).
        self.users = Users(quotas, memory_total)
        self.version = version
        self.close_fd = close_fd
        self.router = Router(rng)
        self.rpc = PendingReplies(CommandStats(limits.max_command_stats, limits.max_command_codes))
        self._next_id = 1  # l.0 is the broker itself; lnames are never reused
        #: What the core decided for the I/O layer (see :class:`~.effects.Effects`).
        self.effects = Effects()
        self.taps = Taps()
        self.traces = Traces(limits.trace_max_traces, limits.trace_max_hops)
        #: Called as ``on_disconnect(peer, reason)`` once per peer when it is forgotten
        #: (operations: lifetime counters for metrics, ending a dump). None = nothing.
        self.on_disconnect: Callable[[Peer, str], None] | None = None
        # Broker-wide counters of rare events; per-message counts live on each Peer.
        # no_recipient counts one-way messages and requests that reached nobody;
        # discarded_frames, frames of a client that hung up while its reads were paused
        # by backpressure and that were never delivered (io/connection.py).
        self.stats = {
            "no_recipient": 0,
            "discarded_frames": 0,
            "late_answers": 0,
            "timeouts": 0,
            "dropped_peers": 0,
            "forbidden": 0,
            "quota_refusals": 0,
            "quota_drops": 0,
        }
        #: The access policy (core/access.py); None = no rules configured.
        self.policy: Policy | None = None
        self._heartbeat_id = 0
        self.relays = Relays(self.router)
        self.delivery = Delivery(
            limits, self.effects, self.stats, self.taps, self.kick, dup_fd, self.users
        )
        self.own_commands = BrokerCommands(self)
        #: The broker's command table (name -> handler); operations code adds to it.
        self.commands: dict[str, Command] = self.own_commands.table
        self._dispatcher = Dispatcher(self)
        #: See :meth:`.dispatch.Dispatcher.handle_many` (bound here: no extra call).
        self.handle_many = self._dispatcher.handle_many
        #: See :meth:`.dispatch.Dispatcher.handle`.
        self.handle = self._dispatcher.handle
        #: Queue a frame for a peer within its bounds (see :meth:`.delivery.Delivery.enqueue`).
        self.enqueue = self.delivery.enqueue

    # -- configuration ------------------------------------------------------------------
    @property
    def limits(self) -> Limits:
        return self._limits

    @limits.setter
    def limits(self, limits: Limits) -> None:
        """New bounds, in force from the next frame (a lowered ``request_timeout`` for
        new requests)."""
        self._limits = limits
        self.delivery.limits = limits
        # Pairs already tracked stay; a lowered bound only stops new ones.
        self.rpc.stats.max_pairs = limits.max_command_stats
        self.rpc.stats.max_codes = limits.max_command_codes
        self.delivery.recap()
        self.traces.max_traces = limits.trace_max_traces
        self.traces.max_hops = limits.trace_max_hops

    @property
    def tap(self) -> TapFn | None:
        """The capture hook (see :mod:`.tap`); None = capture off."""
        return self.taps.frame

    @tap.setter
    def tap(self, fn: TapFn | None) -> None:
        self.taps.frame = fn

    @property
    def tap_run(self) -> TapRunFn | None:
        """The capture hook's companion for a whole :class:`Run` (see :mod:`.tap`)."""
        return self.taps.run

    @tap_run.setter
    def tap_run(self, fn: TapRunFn | None) -> None:
        self.taps.run = fn

    @property
    def bindings(self) -> dict[str, Peer]:
        """group -> the peer bound to it (see :mod:`.relay`)."""
        return self.relays.bindings

    # -- connection lifecycle -----------------------------------------------------------
    @property
    def peers(self) -> dict[int, Peer]:
        return self.router.by_id

    def connect(
        self,
        name: str,
        *,
        pid: int,
        uid: int,
        gid: int,
        now: float,
        principals: list[str] | None = None,
        where: str = "",
    ) -> Peer:
        """Admit a client whose HELLO was accepted; assigns its lname (never reused).

        ``principals`` are the identities the access policy matches (``unix:USER``,
        ``uid:N``, ``gid:N``, ``group:NAME``); a TCP client is admitted with ``where``
        (``tcp:NAME@host:port``) and its authenticated ``["tcp:NAME"]``.
        """
        peer = Peer(self._next_id, name, pid=pid, uid=uid, gid=gid, now=now)
        self._next_id += 1
        if where:
            peer.remote = True
            peer.where = where
        peer.acl = self._access_for(peer, principals or [f"uid:{uid}"])
        self.users.attach(peer, self.users.key_for(uid, peer.remote, principals))
        self.router.add_peer(peer)
        self.publish_membership(
            "connected", {"lname": peer.lname, "name": name, "pid": pid, "uid": uid}
        )
        return peer

    def _access_for(self, peer: Peer, principals: list[str]) -> Access | None:
        if self.policy is None:
            self.policy = Policy(AccessSettings())
        return self.policy.for_peer(principals, remote=peer.remote)

    def set_policy(
        self,
        settings: AccessSettings,
        principals: dict[Peer, list[str]],
        commands: Mapping[str, CommandAccess] | None = None,
    ) -> None:
        """Enforce ``settings`` from now on, for connected peers too (their cached
        decisions are dropped). A connected peer that holds a membership or a binding the
        new policy no longer grants is dropped with ``forbidden`` (the message names what
        was revoked), so a revoked subscription neither keeps receiving nor disappears
        behind the client's back. The caller applies ``effects`` afterwards.

        ``commands`` (group -> the verbs the plugin answering there declared, see
        :class:`~msgq_trio.core.access.Policy`) replaces the table in force; None keeps
        it."""
        if commands is None:
            commands = self.policy.commands if self.policy is not None else {}
        self.policy = Policy(settings, commands)
        for peer, names in principals.items():
            if not peer.alive:
                continue
            acl = peer.acl = self.policy.for_peer(names, remote=peer.remote)
            if acl is None:
                continue
            revoked = [f"subscribe to {g!r}" for g in peer.groups if not acl.allowed(SUBSCRIBE, g)]
            revoked += [
                f"bind {g!r}" for g in self.relays.held_by(peer) if not acl.allowed(BIND, g)
            ]
            if revoked:
                self.stats["forbidden"] += 1
                self.kick(
                    peer,
                    ErrorCode.FORBIDDEN,
                    f"the reloaded access policy no longer allows {acl.identity} to "
                    + ", ".join(revoked),
                )

    def refuse(self, peer: Peer, verb: str, name: str) -> str:
        """Count and log a denial with the peer's identity; returns the message for the
        wire."""
        self.stats["forbidden"] += 1
        msg = f"{verb} {name!r} is not allowed for {peer.acl.identity if peer.acl else '?'}"
        log.warning("forbidden: %s: %s", peer.describe(), msg)
        return msg

    def heartbeat(self, peer: Peer) -> None:
        """Queue a heartbeat REQUEST (``msgq.heartbeat``) to ``peer``: any answer (even
        unknown-command from an old client) proves it is alive. Skipped when its queue is
        over its hard bound (that case is the slow-consumer rule's)."""
        self._heartbeat_id += 1
        pieces = encode_frame(
            FrameType.REQUEST,
            target=peer.lname,
            request_id=self._heartbeat_id,
            header=encode_cbor({"cmd": "msgq.heartbeat"}),
            source=BROKER_STAMP,
        )
        self.delivery.enqueue(peer, pieces)

    def welcome(self, peer: Peer) -> dict[str, object]:
        """Header of the WELCOME frame for ``peer``."""
        lim = self.limits
        return {
            "version": PROTOCOL_VERSION,
            "lname": peer.lname,
            "broker": self.version,
            "limits": {
                "max_frame_size": lim.max_frame_size,
                "max_pending_requests": lim.max_pending_requests,
                "request_timeout": lim.request_timeout,
                "max_fds_per_message": lim.max_fds_per_message,
                # How long a paused sender may see no progress before the receiver that
                # holds it up is dropped: a closing client waits that long for GOODBYE.
                "slow_consumer_timeout": lim.slow_consumer_timeout,
            },
        }

    def disconnect(self, peer: Peer, reason: str, *, keep_queue: bool = False) -> None:
        """Forget ``peer``: unsubscribe it, fail calls pending on it, drop its queue.

        Idempotent. Every caller waiting on ``peer`` gets recipient-gone now; calls
        ``peer`` made are forgotten (late answers to them are discarded). With
        ``keep_queue`` (an orderly GOODBYE) what is already queued for it is still flushed.
        """
        if not peer.alive:
            return
        peer.alive = False
        if self.on_disconnect is not None:
            self.on_disconnect(peer, reason)
        left = self.router.remove_peer(peer)
        self.relays.peer_gone(peer)
        failures = self.rpc.peer_gone(peer)
        self.users.detach(peer)
        if not keep_queue:
            for fd in peer.drop_queue():
                self.close_fd(fd)
        self.effects.forget(peer, queue_dropped=not keep_queue)
        for f in failures:
            self._fail_call(f)
        for g in left:
            self.publish_membership(
                "unsubscribed",
                {"lname": peer.lname, "name": peer.name, "group": g, "reason": "disconnect"},
            )
        self.publish_membership(
            "disconnected", {"lname": peer.lname, "name": peer.name, "reason": reason}
        )

    def kick(self, peer: Peer, code: ErrorCode, message: str, reason: str = "") -> None:
        """Drop ``peer`` for a reason the broker decided (slow consumer, limit, protocol):
        forgotten now, its connection closed by the I/O layer (``effects.kicks``).
        ``reason`` is the membership ``disconnected`` reason (default: the code)."""
        if not peer.alive:
            return
        log.warning("dropping client %s: %s (%s)", peer.describe(), message, code)
        self.stats["dropped_peers"] += 1
        self.effects.kicks.append((peer, code, message))
        self.disconnect(peer, reason or str(code))

    # -- per-user quotas ---------------------------------------------------------------
    def quota_refused(
        self, peer: Peer, quota: str, used: int, limit: int, owner: str, *, strike: bool = True
    ) -> str:
        """Count and log a refusal for a quota (``owner``'s, the user whose quota it is)
        of an operation of ``peer``; returns the message for the wire. With ``strike``
        (``peer`` is at fault), the ``quotas.refusals_before_drop``-th such refusal of one
        connection drops it (``limit-exceeded``, membership reason ``quota:<quota>``):
        it keeps pushing."""
        msg = quota_message(quota, owner, used, limit)
        self.stats["quota_refusals"] += 1
        acct = self.users.accounts.get(owner)
        if acct is not None:
            acct.refused[quota] += 1
        log.warning("quota: refused %s: %s", peer.describe(), msg)
        if not strike:
            return msg
        peer.quota_refusals += 1
        if peer.quota_refusals >= self.users.settings.refusals_before_drop:
            self.quota_drop(peer, quota, f"{msg}; refused {peer.quota_refusals} times")
        return msg

    def quota_drop(self, peer: Peer, quota: str, message: str) -> None:
        """Drop ``peer`` for quota ``quota`` (``limit-exceeded``; its membership
        ``disconnected`` reason is ``quota:<quota>``)."""
        if not peer.alive:
            return
        self.stats["quota_drops"] += 1
        self.kick(peer, ErrorCode.LIMIT_EXCEEDED, message, f"quota:{quota}")

    def discard_frames(self, frames: list[Frame | Run]) -> None:
        """Forget frames that will never be handed in again (their sender left while they
        were held): closes the descriptors they carry."""
        self._dispatcher.close_frames(frames)

    # -- deadlines --------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        return self.rpc.next_deadline()

    def expire(self, now: float) -> None:
        """Answer ``timeout`` for every call whose deadline passed."""
        for f in self.rpc.expire(now):
            self._fail_call(f)

    def _fail_call(self, f: Failure) -> None:
        if f.reason == "timeout":
            self.stats["timeouts"] += 1
            log.error(
                "request %d %r from %s to %s was not answered within its deadline: "
                "the recipient black-holed it",
                f.request_id,
                f.command,
                f.caller.describe(),
                f.callee.describe(),
            )
            code, msg = ErrorCode.TIMEOUT, f"{f.callee.lname} did not answer {f.command!r} in time"
        else:
            code, msg = (
                ErrorCode.RECIPIENT_GONE,
                (f"{f.callee.lname} ({f.callee.name}) disconnected before answering {f.command!r}"),
            )
        self.delivery.reply_error(f.caller, f.request_id, code, msg, source=f.callee.stamp)
        if self.traces.spans:  # a traced call's span ends with it (core/traces.py)
            self.traces.failed(f.caller, f.request_id, str(code), f.callee)

    # -- notifications ------------------------------------------------------------------
    def publish_membership(self, event: str, params: dict[str, object]) -> None:
        """Notify the members of ``msgq.membership`` of a membership change."""
        router = self.router
        members: Collection[Peer] | None = router.groups.get(MEMBERSHIP_GROUP)
        if router.wildcards.count:  # ``msgq.*``, ``msgq.>`` subscribers too
            members = list(
                router.with_wildcards(MEMBERSHIP_GROUP, router.groups.get(MEMBERSHIP_GROUP))
            )
        if not members:
            return
        pieces = encode_frame(
            FrameType.NOTIFY,
            target=MEMBERSHIP_GROUP,
            header=encode_cbor({"event": event}),
            body=encode_cbor(params),
            source=BROKER_STAMP,
        )
        for r in list(members):
            self.delivery.send_or_kick(r, pieces, "a membership notification")
        if self.taps.frame is not None:
            self.taps.show_broker_frame(pieces, len(members))

    def check_empty(self) -> None:
        """Assert that no state is left once every peer is gone (leak check for tests)."""
        assert not self.router.by_id, f"peers left: {list(self.router.by_id.values())[:5]}"
        assert not self.router.groups, f"groups left: {list(self.router.groups)[:5]}"
        self.router.wildcards.check_empty()
        assert not self.bindings, f"bindings left: {list(self.bindings)[:5]}"
        self.rpc.check_empty()


__all__ = ["ANYCAST", "BROKER_LNAME", "Broker", "CommandError"]
