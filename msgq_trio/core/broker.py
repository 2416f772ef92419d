"""Broker logic: route frames between peers, track RPCs, answer the broker's own commands.

Pure and deterministic: no trio, no sockets. The I/O layer calls ``handle(peer, frame, now)``
for every frame a client sends; the core appends outgoing buffers to the receivers'
``Peer.outq`` and records in ``dirty`` whose writer to wake, in ``blocked`` which receivers
went over their soft limit (the sender must pause reading), and in ``kicked`` which peers it
decided to drop (the I/O layer closes their connections). Time comes in as ``now``.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..config import AccessSettings, CommandAccess, Limits
from ..protocol.codes import PROTOCOL_VERSION, ErrorCode, Flag, FrameType
from ..protocol.errors import RemoteProtocolError
from ..protocol.framing import (
    FdBuffer,
    Frame,
    FrameParser,
    Run,
    encode_cbor,
    encode_frame,
    stamped,
)
from ..protocol.names import MEMBERSHIP_GROUP, valid_group_name
from .access import BIND, CALL, SEND, SUBSCRIBE, Access, Policy
from .peers import Buffer, Peer
from .router import (
    ANYCAST,
    BROKER,
    DIRECT,
    GROUP,
    RESERVED,
    Router,
)
from .rpc import Failure, PendingReplies

log = logging.getLogger("msgq_trio.broker")

BROKER_LNAME = "l.0"
_BROKER_STAMP = BROKER_LNAME.encode() + b"\0msgq"

_MESSAGE = FrameType.MESSAGE
_REQUEST = FrameType.REQUEST
_REPLY = FrameType.REPLY
_ERROR = FrameType.ERROR
_NOTIFY = FrameType.NOTIFY
_GOODBYE = FrameType.GOODBYE
#: A plain int: ``frame.flags & Flag.ALL`` would go through enum.Flag.__and__ (~2 us).
_FLAG_ALL = int(Flag.ALL)


class CommandError(Exception):
    """Raised by a broker command handler: becomes an ERROR answer with ``code``."""

    def __init__(self, code: ErrorCode, message: str, data: object = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data


def _one_local(recipients: Iterable[Peer], skip: Peer | None) -> bool:
    """At most one receiver in ``recipients`` (but ``skip`` and leaving ones), and not
    over TCP: the one that may take a spliced frame's pipes."""
    one = False
    for r in recipients:
        if r is skip or r.sealed:
            continue
        if one or r.remote:
            return False
        one = True
    return True


def _size(pieces: list[Buffer]) -> int:
    n = 0
    for p in pieces:
        n += len(p)
    return n


class Broker:
    """The routing core of one broker process.

    Args:
        limits: the bounds to enforce (see :class:`msgq_trio.config.Limits`).
        version: the broker's software version, reported to clients.
        rng: random source for ``Group[?]`` (seed it in tests).
    """

    def __init__(
        self,
        limits: Limits,
        *,
        version: str,
        rng: random.Random | None = None,
        dup_fd: Callable[[int], int] = os.dup,
        close_fd: Callable[[int], None] = os.close,
    ) -> None:
        self.limits = limits
        self.version = version
        # Descriptor operations are injected so the core stays free of I/O in tests.
        self._dup_fd = dup_fd
        self._close_fd = close_fd
        self.router = Router(rng)
        self.rpc = PendingReplies()
        self._next_id = 1  # l.0 is the broker itself; lnames are never reused
        self.dirty: set[Peer] = set()
        self.blocked: set[Peer] = set()
        self.kicked: list[tuple[Peer, ErrorCode, str]] = []
        #: Set when a client's one-way frame is held back (``handle``/``handle_many`` report
        #: it unprocessed): the receivers that must drain first, and the frame's size. The
        #: I/O layer waits for them (dropping one that makes no progress) and retries.
        self.held: list[Peer] = []
        self.held_size = 0
        self.held_fds = 0
        #: Capture hook: ``tap(sender, frame, outcome, recipients)`` for every frame a client
        #: sends and every frame the broker originates (sender None). Outcomes: delivered,
        #: no-recipient, refused, forwarded, discarded, logged, broker. None = capture off,
        #: which costs one attribute test per frame.
        self.tap: Callable[[Peer | None, Frame, str, int], None] | None = None
        #: Optional companion of ``tap`` for a :class:`Run`: ``tap_run(sender, run,
        #: outcome, recipients)`` must show the tap's sinks what ``tap`` would see for each
        #: of its frames, without a Frame per message. None: ``tap`` per frame.
        self.tap_run: Callable[[Peer, Run, str, int], None] | None = None
        #: Called as ``on_disconnect(peer, reason)`` once per peer when it is forgotten
        #: (operations: lifetime counters for metrics, ending a dump). None = nothing.
        self.on_disconnect: Callable[[Peer, str], None] | None = None
        self.commands: dict[str, Callable[[Peer, Any], object]] = {
            "subscribe": self._cmd_subscribe,
            "unsubscribe": self._cmd_unsubscribe,
            "members": self._cmd_members,
            "version": self._cmd_version,
            "ping": lambda _peer, _params: "pong",
            "bind": self._cmd_bind,
            "unbind": self._cmd_unbind,
        }
        #: Transparent insertion (docs/QUEUE.md): group -> the peer bound to it. A MESSAGE
        #: or single-answer REQUEST to the group (or ``G[?]``) from anyone but that peer
        #: goes to that peer alone (``_binder`` says what is not redirected, and why); the
        #: binder itself reaches the real members. Empty in a broker without bindings, and
        #: every routing path tests it for emptiness first, so routing costs one truth test
        #: more when nothing is bound.
        self.bindings: dict[str, Peer] = {}
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
        }
        #: The access policy (core/access.py); None = no rules configured.
        self.policy: Policy | None = None
        self._heartbeat_id = 0

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
        self.router.add_peer(peer)
        self._publish_membership(
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
        behind the client's back. The caller acts on ``kicked`` afterwards.

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
                f"bind {g!r}"
                for g, holder in self.bindings.items()
                if holder is peer and not acl.allowed(BIND, g)
            ]
            if revoked:
                self.stats["forbidden"] += 1
                self.kick(
                    peer,
                    ErrorCode.FORBIDDEN,
                    f"the reloaded access policy no longer allows {acl.identity} to "
                    + ", ".join(revoked),
                )

    def _refuse(self, peer: Peer, verb: str, name: str) -> str:
        """Log a denial with the peer's identity; returns the message for the wire."""
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
            _REQUEST,
            target=peer.lname,
            request_id=self._heartbeat_id,
            header=encode_cbor({"cmd": "msgq.heartbeat"}),
            source=_BROKER_STAMP,
        )
        self._enqueue(peer, pieces)

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
        if self.bindings:
            for g in [g for g, p in self.bindings.items() if p is peer]:
                del self.bindings[g]
                log.info("binding of group %r to %s removed: it disconnected", g, peer.describe())
        failures = self.rpc.peer_gone(peer)
        if not keep_queue:
            for fd in peer.drop_queue():
                self._close_fd(fd)
            self.dirty.discard(peer)
        self.blocked.discard(peer)
        for f in failures:
            self._fail_call(f)
        for g in left:
            self._publish_membership(
                "unsubscribed",
                {"lname": peer.lname, "name": peer.name, "group": g, "reason": "disconnect"},
            )
        self._publish_membership(
            "disconnected", {"lname": peer.lname, "name": peer.name, "reason": reason}
        )

    def kick(self, peer: Peer, code: ErrorCode, message: str) -> None:
        """Drop ``peer`` for a reason the broker decided (slow consumer, limit, protocol)."""
        if not peer.alive:
            return
        log.warning("dropping client %s: %s (%s)", peer.describe(), message, code)
        self.stats["dropped_peers"] += 1
        self.kicked.append((peer, code, message))
        self.disconnect(peer, str(code))

    # -- the hot path -------------------------------------------------------------------
    def handle(self, peer: Peer, frame: Frame, now: float) -> bool:
        """Process one frame from ``peer`` (already checked by the connection state table).

        Returns False if the frame was *held*, not processed: it is a one-way message or
        notification and one of its receivers cannot take it without going over
        ``out_hard_limit``/``max_fds_queued``. Nothing was delivered and ``held`` names the
        receivers; the caller keeps the frame (and its descriptors) and hands it in again
        once they have drained. This is how a burst from many senders is absorbed without
        dropping a receiver that is reading.

        Raises:
            RemoteProtocolError: the frame is well-formed but semantically invalid
                (e.g. a REQUEST without request id); the I/O layer drops the client.
        """
        if not frame.fds:
            return self._handle(peer, frame, now)
        done = True
        try:
            done = self._handle(peer, frame, now)
        finally:
            if done:
                # Recipients got duplicates; the broker's copies go now, whatever happened.
                for fd in frame.fds:
                    self._close_fd(fd)
        return done

    def _handle(self, peer: Peer, frame: Frame, now: float) -> bool:
        ftype = frame.type
        peer.msgs_in += 1
        peer.bytes_in += frame.wire_size
        if frame.spliced is not None and self.tap is not None:
            frame.spliced.materialize()  # a capture records the body: bring it in once
        n = 0
        if ftype == _MESSAGE or ftype == _NOTIFY:
            kind, base, _ = self.router.parse_target(frame.target)
            acl = peer.acl
            if acl is not None and kind != RESERVED and not acl.allowed(SEND, base):
                # A one-way message cannot be answered: the sender is dropped with a final
                # ERROR forbidden, as for a message to a reserved group (docs/SECURITY.md).
                self.kick(peer, ErrorCode.FORBIDDEN, self._refuse(peer, "send to", base))
                if self.tap is not None:
                    self.tap(peer, frame, "refused", 0)
                return True
            if kind == RESERVED:
                raise RemoteProtocolError(
                    f"{frame.target!r} is published by the broker only", ErrorCode.FORBIDDEN
                )
            if ftype == _NOTIFY and kind != GROUP:
                raise RemoteProtocolError(
                    f"notification to {frame.target!r}: notifications go to groups only",
                    ErrorCode.FORBIDDEN,
                )
            if frame.fds and self.bindings:
                binder = self._binder(peer, frame)
                if binder is not None:
                    # A one-way message cannot be answered: refused like a forbidden one
                    # (the sender is dropped with a final ERROR), never stored without its
                    # descriptors behind the sender's back. handle() closes them.
                    self.kick(peer, ErrorCode.FORBIDDEN, self._no_fds_to(binder, frame.target))
                    if self.tap is not None:
                        self.tap(peer, frame, "refused", 0)
                    return True
            n = self._deliver_oneway(peer, frame)
            if n < 0:
                peer.msgs_in -= 1  # counted when it is handed in again
                peer.bytes_in -= frame.wire_size
                return False
            outcome = "delivered" if n else "no-recipient"
        elif ftype == _REQUEST:
            outcome, n = self._request(peer, frame, now)
        elif ftype == _REPLY or ftype == _ERROR:
            if frame.request_id:
                outcome = self._answer(peer, frame)
                n = outcome == "forwarded"
            else:
                outcome = "logged"
                log.warning(
                    "client %s reported a connection error: %r",
                    peer.describe(),
                    _safe_header(frame),
                )
        else:
            return True  # GOODBYE is handled by the I/O layer (it closes after flushing).
        if self.tap is not None:
            self.tap(peer, frame, outcome, n)
        return True

    def handle_many(self, peer: Peer, frames: list[Frame | Run], now: float) -> int:
        """``handle`` for a batch of frames from one peer (the reader's hot path).

        Returns how many frames were consumed: ``len(frames)``, or the index of a frame
        that was held (see ``handle``; it and the frames after it are the caller's to hand
        in again). If the peer is dropped while handling, the rest is consumed unhandled
        (their descriptors closed) and ``len(frames)`` is returned. One-way MESSAGEs to
        plain groups skip the general dispatch.

        A :class:`Run` (frames that already carry ``peer.stamp``) to a plain group is
        queued for each member as one buffer. Any other run (another kind of target, a
        bound group, or a member without room for all of it) is replaced *in
        ``frames``* by its frames, which are then handled one by one as usual; the
        returned index refers to the list as modified.
        """
        groups = self.router.groups
        parse = self.router.parse_target
        deliver = self._deliver
        tap = self.tap
        bindings = self.bindings
        acl = peer.acl
        nbytes = nfast = 0
        done = -1  # all of them: len(frames) once done, as splitting runs may grow it
        # enumerate() indexes the list as it goes, so a run split in place below is
        # followed by its own frames.
        for i, item in enumerate(frames):
            if type(item) is Run:
                target = item.target
                if (
                    parse(target)[0] == GROUP
                    and not (bindings and target in bindings)
                    and (acl is None or acl.allowed(SEND, target))
                ):
                    members = groups.get(target)
                    if not members:
                        self.stats["no_recipient"] += item.count
                        nbytes += len(item.raw)
                        nfast += item.count
                        if tap is not None:
                            self._tap_run(peer, item, 0)
                        continue
                    n = self._deliver_run(peer, item, members)
                    if n >= 0:
                        nbytes += len(item.raw)
                        nfast += item.count
                        if tap is not None:
                            # Capture sees each frame of the run; the delivery stays one
                            # buffer per member (capture on keeps the fast path).
                            self._tap_run(peer, item, n)
                        continue
                split = item.frames()
                frames[i : i + 1] = split
                frame = split[0]
            else:
                frame = item  # type: ignore[assignment]
            if (
                frame.type != _MESSAGE
                or frame.n_fds
                or frame.spliced is not None  # (rare per byte: the general path sizes it)
                or parse(frame.target)[0] != GROUP
                or (bindings and frame.target in bindings)
                or (acl is not None and not acl.allowed(SEND, frame.target))
            ):
                try:
                    handled = self.handle(peer, frame, now)
                except BaseException:
                    self._close_frames_fds(frames[i + 1 :])
                    raise
                if not handled:
                    done = i
                    break
                if not peer.alive:
                    self._close_frames_fds(frames[i + 1 :])
                    break
                continue
            members = groups.get(frame.target)
            if members:
                n = deliver(peer, frame, members, peer)
                if n < 0:
                    done = i
                    break
            else:
                n = 0
                self.stats["no_recipient"] += 1
            nbytes += len(frame.raw)
            nfast += 1
            if tap is not None:
                tap(peer, frame, "delivered" if n else "no-recipient", n)
        peer.msgs_in += nfast
        peer.bytes_in += nbytes
        return len(frames) if done < 0 else done

    def _tap_run(self, peer: Peer, run: Run, n: int) -> None:
        """Show every frame of a delivered ``run`` to the capture tap (capture is on)."""
        assert self.tap is not None
        outcome = "delivered" if n else "no-recipient"
        if self.tap_run is not None:
            self.tap_run(peer, run, outcome, n)
            return
        tap = self.tap
        for frame in run.frames():
            tap(peer, frame, outcome, n)

    def _deliver_run(self, peer: Peer, run: Run, members: Iterable[Peer]) -> int:
        """Queue ``run`` for every member of its group but ``peer``; returns how many got
        it, or -1 (nothing queued) if one of them cannot take all of it within
        ``out_hard_limit``: the caller then handles the frames one by one, which holds
        the sender at the exact frame."""
        raw = run.raw
        size = len(raw)
        room = self.limits.out_hard_limit - size
        for r in members:
            if r.outq_bytes > room and not (r is peer or r.sealed):
                return -1
        soft = self.limits.out_soft_limit
        dirty = self.dirty
        count = run.count
        n = 0
        for r in members:
            if r is peer or r.sealed:
                continue
            r.outq.append(raw)
            r.outq_bytes += size
            r.msgs_out += count
            n += 1
            dirty.add(r)
            if r.outq_bytes > soft:
                self.blocked.add(r)
        if not n:
            self.stats["no_recipient"] += count
        return n

    def discard_frames(self, frames: list[Frame | Run]) -> None:
        """Forget frames that will never be handed in again (their sender left while they
        were held): closes the descriptors they carry."""
        self._close_frames_fds(frames)

    def _close_frames_fds(self, frames: list[Frame | Run]) -> None:
        """Close the descriptors of frames that will not be handled (peer dropped), and
        release the spliced rest of any."""
        for f in frames:
            for fd in f.fds:
                self._close_fd(fd)
            if f.spliced is not None:
                f.spliced.close()

    def _deliver_oneway(self, peer: Peer, frame: Frame) -> int:
        router = self.router
        if self.bindings:
            binder = self._binder(peer, frame)
            if binder is not None:
                return self._deliver(peer, frame, (binder,), None)
        skip = peer if router.parse_target(frame.target)[0] == GROUP else None
        return self._deliver(peer, frame, router.resolve(frame.target, None), skip)

    def _binder(self, peer: Peer, frame: Frame) -> Peer | None:
        """The peer that takes ``frame`` instead of its target's members, or None.

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
        kind, base, _ = self.router.parse_target(frame.target)
        if kind != GROUP and kind != ANYCAST:
            return None
        if frame.type == _NOTIFY or frame.flags & _FLAG_ALL:
            return None
        binder = self.bindings.get(base)
        if binder is None or binder is peer:
            return None
        return binder

    def _relayed(self, peer: Peer, frame: Frame) -> bytes:
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
        kind, base, index = self.router.parse_target(frame.target)
        if kind == DIRECT:
            member = self.router.by_id.get(index)
            if member is not None and any(self.bindings.get(g) is peer for g in member.groups):
                return src
            return peer.stamp
        return src if self.bindings.get(base) is peer else peer.stamp

    def _no_fds_to(self, binder: Peer, target: str) -> str:
        """The refusal of descriptors sent to a bound group (the binder stores what it
        takes, and a descriptor cannot be stored): names the binding and the way round."""
        base = self.router.parse_target(target)[1]
        return (
            f"{target!r} is bound to {binder.describe()}, which stores its traffic: file "
            f"descriptors cannot be stored; send them to one member ({base}[N] or its lname)"
        )

    def _deliver(
        self,
        peer: Peer,
        frame: Frame,
        recipients: Iterable[Peer],
        skip: Peer | None,
        hold: bool = True,
    ) -> int:
        """Queue ``frame`` (re-stamped with ``peer``'s identity) for each recipient but
        ``skip`` (the sender, for a broadcast to a group); returns how many got it.

        A recipient that cannot take the frame without going over ``out_hard_limit`` or
        ``max_fds_queued``: with ``hold`` nobody gets it, ``held`` names those recipients
        and -1 is returned (the sender waits; see ``handle``). Without ``hold`` such a
        recipient is dropped (slow-consumer) rather than losing the message silently.
        ``recipients`` must be iterable twice (the router returns sequences).
        """
        pieces: list[Buffer] | None = None
        size = n = 0
        over: list[Peer] | None = None
        hard = self.limits.out_hard_limit
        soft = self.limits.out_soft_limit
        dirty = self.dirty
        nfds = len(frame.fds)
        source = peer.stamp
        if self.bindings and frame.source != source:
            source = self._relayed(peer, frame)
        spliced = frame.spliced
        if spliced is not None and not _one_local(recipients, skip):
            # Pipes can be written to one socket only: several receivers (or one over
            # TCP) share the bytes instead, read back once.
            spliced.materialize()
        if hold:
            # One cheap pass first, so that a held frame is delivered to nobody rather
            # than to some members twice.
            pieces = stamped(frame, source)
            size = _size(pieces)
            room = hard - size
            max_fds = self.limits.max_fds_queued - nfds
            for r in recipients:
                if (r.outq_bytes > room or (nfds and r.outq_fds > max_fds)) and not (
                    r is skip or r.sealed
                ):
                    over = over or []
                    over.append(r)
            if over:
                self.held, self.held_size, self.held_fds = over, size, nfds
                return -1
        for r in recipients:
            if r is skip or r.sealed:
                continue
            if pieces is None:
                pieces = stamped(frame, source)
                size = _size(pieces)
            if r.outq_bytes + size > hard or (
                nfds and r.outq_fds + nfds > self.limits.max_fds_queued
            ):
                over = over or []
                over.append(r)
                continue
            if nfds:
                if r.remote:
                    continue  # descriptors cannot cross TCP: this receiver is skipped
                r.outq.append(self._with_fds(pieces[0], frame.fds))
                r.outq.extend(pieces[1:])
                r.outq_fds += nfds
            else:
                r.outq.extend(pieces)
            r.outq_bytes += size
            r.msgs_out += 1
            n += 1
            dirty.add(r)
            if r.outq_bytes > soft:
                self.blocked.add(r)
        if not n:
            self.stats["no_recipient"] += 1
        elif spliced is not None:
            spliced.taken = True  # its receiver's queue owns it now
        if over:
            for r in over:
                self.kick(
                    r,
                    ErrorCode.SLOW_CONSUMER,
                    f"outgoing queue over out_hard_limit ({hard} bytes) or "
                    f"max_fds_queued ({self.limits.max_fds_queued}) "
                    f"with a message from {peer.describe()}",
                )
        return n

    def _with_fds(self, first: Buffer, fds: tuple[int, ...]) -> FdBuffer:
        """The frame's first piece carrying this recipient's own duplicates of ``fds``."""
        return FdBuffer(bytes(first), tuple(self._dup_fd(fd) for fd in fds))

    def _enqueue(self, r: Peer, pieces: list[Buffer], fds: tuple[int, ...] = ()) -> bool:
        """Queue a frame (with duplicates of ``fds``) for ``r``; False if it would go over
        ``out_hard_limit`` or ``max_fds_queued``."""
        if not r.alive or r.sealed:
            return False
        size = _size(pieces)
        if r.outq_bytes + size > self.limits.out_hard_limit:
            return False
        if fds:
            if r.outq_fds + len(fds) > self.limits.max_fds_queued:
                return False
            r.outq.append(self._with_fds(pieces[0], fds))
            r.outq.extend(pieces[1:])
            r.outq_fds += len(fds)
        else:
            r.outq.extend(pieces)
        r.outq_bytes += size
        r.msgs_out += 1
        self.dirty.add(r)
        if r.outq_bytes > self.limits.out_soft_limit:
            self.blocked.add(r)
        return True

    def _send_or_kick(
        self, r: Peer, pieces: list[Buffer], what: str, fds: tuple[int, ...] = ()
    ) -> None:
        """Queue a frame ``r`` is owed (an answer it asked for, a notification it subscribed
        to); if its queue is over its bounds it is dropped, never left waiting."""
        if r.alive and not r.sealed and not self._enqueue(r, pieces, fds):
            self.kick(
                r,
                ErrorCode.SLOW_CONSUMER,
                f"cannot take {what}: outgoing queue over out_hard_limit "
                f"({self.limits.out_hard_limit} bytes) or max_fds_queued "
                f"({self.limits.max_fds_queued})",
            )

    def _reply_error(
        self,
        to: Peer,
        request_id: int,
        code: ErrorCode,
        message: str,
        *,
        source: bytes = _BROKER_STAMP,
        data: object = None,
        target: str = "",
    ) -> None:
        header: dict[str, object] = {"code": str(code), "message": message, "broker": True}
        pieces = encode_frame(
            _ERROR,
            target=target or to.lname,
            request_id=request_id,
            header=encode_cbor(header),
            body=encode_cbor(data) if data is not None else b"",
            source=source,
        )
        self._send_or_kick(to, pieces, f"a {code} answer")
        if self.tap is not None:
            self._tap_broker(pieces)

    def _request(self, peer: Peer, frame: Frame, now: float) -> tuple[str, int]:
        """Route a REQUEST; returns (outcome, recipients) for the capture tap."""
        rid = frame.request_id
        if not rid:
            raise RemoteProtocolError("REQUEST without a request id")
        if self.rpc.is_pending(peer, rid):
            self._reply_error(
                peer, rid, ErrorCode.BAD_REQUEST, f"request id {rid} is already pending"
            )
            return "refused", 0
        if len(peer.pending_out) >= self.limits.max_pending_requests:
            self._reply_error(
                peer,
                rid,
                ErrorCode.LIMIT_EXCEEDED,
                f"more than max_pending_requests="
                f"{self.limits.max_pending_requests} requests pending",
            )
            return "refused", 0
        header = frame.header()
        router = self.router
        kind = router.parse_target(frame.target)[0]
        command = header.get("cmd")
        if not isinstance(command, str):
            raise RemoteProtocolError("REQUEST header without a string 'cmd'")
        if kind == BROKER:
            self._broker_command(peer, frame, command)
            return "broker", 1
        acl = peer.acl
        if acl is not None and kind != RESERVED:
            why = self._check_call(peer, acl, frame, command)
            if why:
                self._reply_error(peer, rid, ErrorCode.FORBIDDEN, why)
                return "refused", 0
        if kind == RESERVED:
            self._reply_error(
                peer, rid, ErrorCode.FORBIDDEN, f"{frame.target!r} is published by the broker only"
            )
            return "refused", 0
        binder = self._binder(peer, frame) if self.bindings else None
        if binder is not None:
            if frame.fds:
                # Refused here, before the binder could store the request without them;
                # handle() closes the descriptors the broker received.
                self._reply_error(
                    peer, rid, ErrorCode.BAD_REQUEST, self._no_fds_to(binder, frame.target)
                )
                return "refused", 0
            recipients = [binder]
        else:
            recipients = list(router.resolve(frame.target, peer if kind == GROUP else None))
        if not recipients:
            self.stats["no_recipient"] += 1
            self._reply_error(
                peer,
                rid,
                ErrorCode.NO_RECIPIENT,
                f"no recipient for {frame.target!r}",
                target=frame.target,
            )
            return "no-recipient", 0
        multi = frame.flags & _FLAG_ALL
        if not multi and len(recipients) > 1:
            self._reply_error(
                peer,
                rid,
                ErrorCode.MULTIPLE_RECIPIENTS,
                f"{frame.target!r} has {len(recipients)} members; address one instance "
                f"({frame.target}[N] or {frame.target}[?]) or call every member",
            )
            return "refused", 0
        timeout = self.limits.request_timeout
        t = header.get("timeout")
        if isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < timeout:
            timeout = float(t)
        if multi:
            # Tell the caller who will answer, before any answer can arrive.
            to = [[r.lname, r.name] for r in recipients]
            routed = encode_frame(
                FrameType.ROUTED,
                target=peer.lname,
                request_id=rid,
                header=encode_cbor({"to": to}),
                source=_BROKER_STAMP,
            )
            self._send_or_kick(peer, routed, "a routing answer")
            if self.tap is not None:
                self._tap_broker(routed)
        source = peer.stamp
        if self.bindings and frame.source != source:
            source = self._relayed(peer, frame)
        pieces = stamped(frame, source)
        delivered: list[Peer] = []
        for r in recipients:
            if r.sealed:
                self._reply_error(
                    peer, rid, ErrorCode.RECIPIENT_GONE, f"{r.lname} is leaving", source=r.stamp
                )
            elif frame.fds and r.remote:
                self._reply_error(
                    peer,
                    rid,
                    ErrorCode.BAD_REQUEST,
                    f"{r.lname} is connected over TCP: file descriptors cannot reach it",
                    source=r.stamp,
                )
            elif self._enqueue(r, pieces, frame.fds):
                delivered.append(r)
            else:
                self._reply_error(
                    peer,
                    rid,
                    ErrorCode.RECEIVER_FULL,
                    f"{r.lname} has {r.outq_bytes} bytes queued (out_hard_limit "
                    f"{self.limits.out_hard_limit})",
                    source=r.stamp,
                )
        if delivered:
            self.rpc.add(peer, rid, delivered, now + timeout, frame.target, command)
            return "delivered", len(delivered)
        return "refused", 0

    def _check_call(self, peer: Peer, acl: Access, frame: Frame, command: str) -> str:
        """Why ``peer`` may not make this request ("" if it may). A command a plugin
        declared a verb for (``Policy.commands``, e.g. the queue plugin's
        ``consume``/``produce``) also needs that verb on the object its params name (the
        one place the broker decodes a request body, and only for a restricted peer's
        request to such a plugin's group)."""
        base = self.router.parse_target(frame.target)[1]
        if not acl.allowed(CALL, base):
            return self._refuse(peer, "call to", base)
        policy = self.policy
        declared = policy.commands.get(base) if policy is not None else None
        if declared is not None:
            verb = declared.verbs.get(command)
            if verb is not None:
                try:
                    params = frame.body()
                except RemoteProtocolError:
                    params = None
                name = params.get(declared.param) if isinstance(params, dict) else None
                if not isinstance(name, str) or not acl.allowed(verb, name):
                    return self._refuse(
                        peer, f"{verb} ({declared.param} command {command!r}) on", str(name)
                    )
        return ""

    def _answer(self, peer: Peer, frame: Frame) -> str:
        kind, _base, caller_id = self.router.parse_target(frame.target)
        if kind == BROKER:
            return "discarded"  # the answer to a heartbeat: its arrival was the point
        caller = self.rpc.answer(peer, caller_id, frame.request_id) if kind == DIRECT else None
        if caller is None:
            # The caller left, the call timed out, or this peer was never asked.
            self.stats["late_answers"] += 1
            log.debug(
                "discarding answer from %s to %s id %d: no such pending call",
                peer.describe(),
                frame.target,
                frame.request_id,
            )
            return "discarded"
        if frame.fds and caller.remote:
            self._reply_error(
                caller,
                frame.request_id,
                ErrorCode.BAD_REQUEST,
                f"the answer from {peer.lname} carried file descriptors, which cannot cross TCP",
                source=peer.stamp,
            )
            return "refused"
        self._send_or_kick(caller, stamped(frame, peer.stamp), "an answer it asked for", frame.fds)
        return "forwarded"

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
        self._reply_error(f.caller, f.request_id, code, msg, source=f.callee.stamp)

    # -- deadlines --------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        return self.rpc.next_deadline()

    def expire(self, now: float) -> None:
        """Answer ``timeout`` for every call whose deadline passed."""
        for f in self.rpc.expire(now):
            self._fail_call(f)

    # -- notifications ------------------------------------------------------------------
    def _publish_membership(self, event: str, params: dict[str, object]) -> None:
        members = self.router.groups.get(MEMBERSHIP_GROUP)
        if not members:
            return
        pieces = encode_frame(
            _NOTIFY,
            target=MEMBERSHIP_GROUP,
            header=encode_cbor({"event": event}),
            body=encode_cbor(params),
            source=_BROKER_STAMP,
        )
        for r in list(members):
            self._send_or_kick(r, pieces, "a membership notification")
        if self.tap is not None:
            self._tap_broker(pieces, len(members))

    # -- the broker's own commands ----------------------------------------------------
    def _broker_command(self, peer: Peer, frame: Frame, command: str) -> None:
        rid = frame.request_id
        fn = self.commands.get(command)
        if fn is None:
            self._reply_error(
                peer,
                rid,
                ErrorCode.UNKNOWN_COMMAND,
                f"the broker has no command {command!r}",
                data=sorted(self.commands),
            )
            return
        try:
            result = fn(peer, frame.body())
        except CommandError as exc:
            self._reply_error(peer, rid, exc.code, str(exc), data=exc.data)
            return
        except RemoteProtocolError as exc:
            self._reply_error(peer, rid, ErrorCode.BAD_REQUEST, str(exc))
            return
        pieces = encode_frame(
            _REPLY,
            target=peer.lname,
            request_id=rid,
            body=encode_cbor(result),
            source=_BROKER_STAMP,
        )
        self._send_or_kick(peer, pieces, "an answer it asked for")
        if self.tap is not None:
            self._tap_broker(pieces)

    def _tap_broker(self, pieces: list[Buffer], recipients: int = 1) -> None:
        """Show a frame the broker originated to the capture tap (only when capture is on)."""
        assert self.tap is not None
        parser = FrameParser()
        parser.feed(b"".join(pieces))
        frame = parser.next_frame()
        if frame is not None:
            self.tap(None, frame, "delivered", recipients)

    def _group_param(self, params: object) -> str:
        group = params.get("group") if isinstance(params, dict) else None
        if not isinstance(group, str):
            raise CommandError(ErrorCode.BAD_REQUEST, "params must be {'group': str}")
        return group

    def _cmd_subscribe(self, peer: Peer, params: object) -> bool:
        group = self._group_param(params)
        why = valid_group_name(group)
        if why:
            raise CommandError(ErrorCode.BAD_REQUEST, why)
        if peer.acl is not None and not peer.acl.allowed(SUBSCRIBE, group):
            raise CommandError(ErrorCode.FORBIDDEN, self._refuse(peer, "subscribe to", group))
        if group not in peer.groups and len(peer.groups) >= self.limits.max_subscriptions:
            raise CommandError(
                ErrorCode.LIMIT_EXCEEDED,
                f"max_subscriptions={self.limits.max_subscriptions} reached",
            )
        added = self.router.subscribe(peer, group)
        if added:
            self._publish_membership(
                "subscribed", {"lname": peer.lname, "name": peer.name, "group": group}
            )
        return added

    def _cmd_unsubscribe(self, peer: Peer, params: object) -> bool:
        group = self._group_param(params)
        removed = self.router.unsubscribe(peer, group)
        if removed:
            self._publish_membership(
                "unsubscribed",
                {"lname": peer.lname, "name": peer.name, "group": group, "reason": "request"},
            )
        return removed

    def _cmd_members(self, peer: Peer, params: object) -> list[dict[str, object]]:
        group = self._group_param(params)
        acl = peer.acl
        if acl is not None and not any(acl.allowed(v, group) for v in (SUBSCRIBE, SEND, CALL)):
            raise CommandError(ErrorCode.FORBIDDEN, self._refuse(peer, "list members of", group))
        return [
            {"lname": p.lname, "name": p.name, "pid": p.pid} for p in self.router.members(group)
        ]

    def _cmd_bind(self, peer: Peer, params: object) -> bool:
        """``bind {"group"}``: from now on messages and single-answer requests to the group
        (or ``G[?]``) from anyone but ``peer`` go to ``peer``, the rest as before (see
        ``_binder``; transparent insertion of a queue, docs/QUEUE.md). Returns False if
        ``peer`` already held the binding. The binding ends with ``unbind`` or when
        ``peer`` disconnects.

        Raises (as answers): bad-request for an invalid group name, forbidden when another
        client holds the binding (named in the message)."""
        group = self._group_param(params)
        why = valid_group_name(group)
        if why:
            raise CommandError(ErrorCode.BAD_REQUEST, why)
        if self.router.parse_target(group)[0] != GROUP:
            raise CommandError(ErrorCode.BAD_REQUEST, f"{group!r} cannot be bound")
        if peer.acl is not None and not peer.acl.allowed(BIND, group):
            raise CommandError(ErrorCode.FORBIDDEN, self._refuse(peer, "bind", group))
        holder = self.bindings.get(group)
        if holder is peer:
            return False
        if holder is not None:
            raise CommandError(
                ErrorCode.FORBIDDEN, f"group {group!r} is already bound to {holder.describe()}"
            )
        self.bindings[group] = peer
        log.info("group %r bound to %s", group, peer.describe())
        return True

    def _cmd_unbind(self, peer: Peer, params: object) -> bool:
        """``unbind {"group"}``: end ``peer``'s binding; False if it held none."""
        group = self._group_param(params)
        if self.bindings.get(group) is not peer:
            return False
        del self.bindings[group]
        log.info("binding of group %r to %s removed on request", group, peer.describe())
        return True

    def _cmd_version(self, _peer: Peer, _params: object) -> dict[str, object]:
        return {"broker": self.version, "protocol": PROTOCOL_VERSION}

    def check_empty(self) -> None:
        """Assert that no state is left once every peer is gone (leak check for tests)."""
        assert not self.router.by_id, f"peers left: {list(self.router.by_id.values())[:5]}"
        assert not self.router.groups, f"groups left: {list(self.router.groups)[:5]}"
        assert not self.bindings, f"bindings left: {list(self.bindings)[:5]}"
        self.rpc.check_empty()


def _safe_header(frame: Frame) -> object:
    try:
        return frame.header()
    except RemoteProtocolError:
        return "<malformed header>"


__all__ = ["ANYCAST", "BROKER_LNAME", "Broker", "CommandError"]
