"""The dispatcher: every frame a client sends, through one set of checks, to its outcome.

One entry point, :meth:`Dispatcher.handle_many` (a batch of frames from one peer, the
reader's hot path); ``handle`` is a batch of one. A frame's target is resolved once, into
a ``Route`` (``core/router.py``) that every later step (access, bindings, relayed stamps,
recipients, RPC) takes as it is.

The rules for a one-way frame (MESSAGE, NOTIFY), in order; a :class:`Run` (MESSAGEs from
one sender to one target) passes them once for all of its frames:

1. a target the sender may not send to: the sender is dropped with a final ERROR
   forbidden (a one-way frame cannot be answered), the rest of its batch discarded;
2. a target under ``msgq.`` (published by the broker only), or a NOTIFY to anything but a
   group: protocol error (the I/O layer drops the sender);
3. a bound group (``Relays.binder``) takes it instead of the members; descriptors to it
   are refused as in rule 1 (the binder stores what it takes);
4. otherwise its recipients (a group's members but the sender, or the one peer the
   route names) get it, or nobody if one of them lacks room: the frame is held.

A Run goes as one buffer to a plain group's members; where one of the rules 3-4 asks for
a decision per message (a bound group, an anycast, a receiver short of room) it is split
in place into its frames, which follow the same rules one by one.

Pure: no trio, no I/O. Outputs are queued frames plus :class:`~.effects.Effects`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ..protocol.codes import ErrorCode, Flag, FrameType
from ..protocol.errors import RemoteProtocolError
from ..protocol.framing import Frame, Run, encode_cbor, encode_frame, stamped
from ..protocol.names import valid_target_name
from .access import CALL, SEND, Access
from .cmdstats import DIRECT_GROUP
from .delivery import BROKER_STAMP, user_full
from .host import BrokerHost
from .peers import Peer
from .router import BROKER, DIRECT, GROUP, PATTERN, RESERVED, Route

log = logging.getLogger("msgq_trio.broker")

_MESSAGE = FrameType.MESSAGE
_REQUEST = FrameType.REQUEST
_REPLY = FrameType.REPLY
_ERROR = FrameType.ERROR
_NOTIFY = FrameType.NOTIFY
#: A plain int: ``frame.flags & Flag.ALL`` would go through enum.Flag.__and__, which is
#: far slower than an int's and runs per routed frame.
_FLAG_ALL = int(Flag.ALL)
_FLAG_TRACED = int(Flag.TRACED)


class Dispatcher:
    """Routes the frames of clients for one broker (see the module's rules)."""

    def __init__(self, broker: BrokerHost) -> None:
        self._broker = broker
        self.router = broker.router
        self.relays = broker.relays
        self.delivery = broker.delivery
        self.rpc = broker.rpc
        self.taps = broker.taps
        self.stats = broker.stats
        self._command_stat = broker.rpc.stats.entry
        self._command_pairs = broker.rpc.stats.pairs
        self.traces = broker.traces
        self._close_fd = broker.close_fd
        # What every batch uses, bound once (these objects live as long as the broker):
        # the hot path pays one attribute lookup each, per batch.
        self._groups = self.router.groups
        self._parse = self.router.parse_target
        self._bindings = self.relays.bindings
        self._deliver = self.delivery.deliver
        self._deliver_run = self.delivery.deliver_run
        self._wildcards = self.router.wildcards
        self._with_wildcards = self.router.with_wildcards

    def handle(self, peer: Peer, frame: Frame, now: float) -> bool:
        """:meth:`handle_many` for one frame: False if it was held."""
        return self.handle_many(peer, [frame], now) == 1

    def handle_many(self, peer: Peer, frames: list[Frame | Run], now: float) -> int:
        """Process a batch of frames from ``peer`` (already checked by the connection
        state table); returns how many were consumed.

        That is ``len(frames)``, or the index of a frame that was *held*, not processed:
        a one-way frame one of whose receivers cannot take it without going over
        ``out_hard_limit``/``max_fds_queued``. Nothing of it was delivered and
        ``effects.hold`` names those receivers; it and the frames after it are the
        caller's to hand in again once they have drained (their descriptors stay the
        caller's). This is how a burst from many senders is absorbed without dropping a
        receiver that is reading. If the peer is dropped while handling, the rest is
        consumed unhandled (descriptors closed) and ``len(frames)`` is returned.

        A :class:`Run` split into its frames (see the module) is replaced by them *in
        ``frames``*; the returned index refers to the list as modified. The descriptors a
        consumed frame carried are closed (receivers got duplicates).

        Raises:
            RemoteProtocolError: a frame is well-formed but semantically invalid (e.g. a
                REQUEST without request id); the I/O layer drops the client. The
                descriptors of that frame and the ones after it are closed.
        """
        groups = self._groups
        parse = self._parse
        bindings = self._bindings
        tap = self.taps.frame
        acl = peer.acl
        # Wildcard subscriptions exist: a group's recipients are its members and the
        # matching subscribers (Router.with_wildcards). Zero (the usual case) keeps a
        # plain group at one dict lookup; re-read after each command (a subscribe).
        wild = self._wildcards.count
        nbytes = nmsgs = 0
        done = -1  # all of them: len(frames) once done, as splitting runs may grow it
        fds: tuple[int, ...] = ()  # the current frame's descriptors, until closed
        i = 0
        try:
            # enumerate() indexes the list as it goes, so a run split in place below is
            # followed by its own frames.
            for i, item in enumerate(frames):
                route = parse(item.target)
                kind, base, _ = route
                ftype = item.type
                if ftype != _MESSAGE and ftype != _NOTIFY:
                    frame: Frame = item  # type: ignore[assignment]  # runs are MESSAGEs
                    fds = frame.fds
                    # Counted before it is handled: a command (stats) and a disconnect
                    # (lifetime counters) see every frame up to this one.
                    peer.msgs_in += nmsgs + 1
                    peer.bytes_in += nbytes + frame.wire_size
                    nmsgs = nbytes = 0
                    if frame.spliced is not None and tap is not None:
                        frame.spliced.materialize()  # a capture records the body
                    outcome = self._two_way(peer, frame, route, now)
                    # A command may have turned capture on or off (capture-start is seen).
                    tap = self.taps.frame
                    wild = self._wildcards.count
                    if fds:
                        self._close_fds(fds)
                        fds = ()
                    if tap is not None and outcome:
                        tap(peer, frame, outcome[0], outcome[1])
                    if frame.flags & _FLAG_TRACED and outcome:
                        self.traces.frame(peer, frame, outcome[0], now)  # (core/traces.py)
                    if not peer.alive:
                        self._close_frames_fds(frames[i + 1 :])
                        break
                    continue
                # -- rules 1 and 2: who may send one-way frames where --
                if acl is not None and kind != RESERVED and not acl.allowed(SEND, base):
                    frame = self._split(frames, i, item)
                    peer.msgs_in += nmsgs + 1  # counted before the disconnect sees them
                    peer.bytes_in += nbytes + frame.wire_size
                    nmsgs = nbytes = 0
                    self._refuse_oneway(peer, frame, self._broker.refuse(peer, "send to", base))
                    self._close_fds(frame.fds)
                    self._close_frames_fds(frames[i + 1 :])
                    break
                if kind != GROUP:
                    if kind == PATTERN:
                        raise RemoteProtocolError(
                            str(valid_target_name(item.target)), ErrorCode.BAD_REQUEST
                        )
                    if kind == RESERVED:
                        raise RemoteProtocolError(
                            f"{item.target!r} is published by the broker only",
                            ErrorCode.FORBIDDEN,
                        )
                    if ftype == _NOTIFY:
                        raise RemoteProtocolError(
                            f"notification to {item.target!r}: notifications go to groups only",
                            ErrorCode.FORBIDDEN,
                        )
                if type(item) is Run:
                    if kind == GROUP and not (bindings and base in bindings):
                        members: Iterable[Peer] | None = groups.get(base)
                        if wild:
                            members = self._with_wildcards(base, groups.get(base))
                        n = self._deliver_run(peer, item, members) if members else 0
                        if n >= 0:
                            if not members:
                                self.stats["no_recipient"] += item.count
                            nbytes += len(item.raw)
                            nmsgs += item.count
                            if tap is not None:
                                # Capture sees each frame of the run; the delivery stays
                                # one buffer per member (capture on keeps the fast path).
                                self.taps.show_run(peer, item, n)
                            continue
                    frame = self._split(frames, i, item)
                else:
                    frame = item  # type: ignore[assignment]
                # -- rules 3 and 4: who gets it --
                fds = frame.fds
                binder = self.relays.binder(peer, frame, route) if bindings else None
                if binder is not None:
                    if fds:
                        peer.msgs_in += nmsgs + 1  # counted before the disconnect sees them
                        peer.bytes_in += nbytes + frame.wire_size
                        nmsgs = nbytes = 0
                        self._refuse_oneway(
                            peer, frame, self.relays.no_fds_to(binder, item.target, route)
                        )
                        self._close_fds(fds)
                        fds = ()
                        self._close_frames_fds(frames[i + 1 :])
                        break
                    recipients: Iterable[Peer] | None = (binder,)
                    skip = None
                elif kind == GROUP:
                    recipients = groups.get(base)
                    if wild:
                        recipients = self._with_wildcards(base, groups.get(base))
                    skip = peer
                else:
                    recipients = self.router.recipients(route, None)
                    skip = None
                source = peer.stamp
                if bindings and frame.source != source:
                    source = self.relays.source(peer, frame, route)
                spliced = frame.spliced
                if spliced is not None and tap is not None:
                    spliced.materialize()  # a capture records the body
                if recipients:
                    n = self._deliver(peer, frame, recipients, skip, source)
                    if n < 0:
                        fds = ()  # held: the caller keeps the frame and its descriptors
                        done = i
                        break
                else:
                    n = 0
                    self.stats["no_recipient"] += 1
                if fds:
                    self._close_fds(fds)  # receivers got duplicates
                    fds = ()
                nmsgs += 1
                # (Frame.wire_size, spelt out: a property call costs more per message.)
                nbytes += (
                    len(frame.raw) + len(frame.large_body) if spliced is None else frame.wire_size
                )
                if tap is not None:
                    tap(peer, frame, "delivered" if n else "no-recipient", n)
                if frame.flags & _FLAG_TRACED:
                    self.traces.frame(peer, frame, "delivered" if n else "no-recipient", now)
        except BaseException:
            if fds:
                self._close_fds(fds)
            self._close_frames_fds(frames[i + 1 :])
            raise
        finally:
            peer.msgs_in += nmsgs
            peer.bytes_in += nbytes
        return len(frames) if done < 0 else done

    @staticmethod
    def _split(frames: list[Frame | Run], i: int, item: Frame | Run) -> Frame:
        """``item`` as a frame: a Run is replaced in ``frames`` by its frames (the first
        returned), to be handled one by one."""
        if type(item) is not Run:
            return item  # type: ignore[return-value]
        split = item.frames()
        frames[i : i + 1] = split
        return split[0]

    def _refuse_oneway(self, peer: Peer, frame: Frame, why: str) -> None:
        """A one-way frame cannot be answered: a refused one drops its sender with a final
        ERROR forbidden (docs/SECURITY.md)."""
        self._broker.kick(peer, ErrorCode.FORBIDDEN, why)
        tap = self.taps.frame
        if tap is not None:
            tap(peer, frame, "refused", 0)

    def _close_fds(self, fds: tuple[int, ...]) -> None:
        for fd in fds:
            self._close_fd(fd)

    def close_frames(self, frames: list[Frame | Run]) -> None:
        """Forget frames that will not be handled: close the descriptors they carry and
        release the spliced rest of any."""
        self._close_frames_fds(frames)

    def _close_frames_fds(self, frames: list[Frame | Run]) -> None:
        for f in frames:
            for fd in f.fds:
                self._close_fd(fd)
            if f.spliced is not None:
                f.spliced.close()

    # -- two-way frames ---------------------------------------------------------------
    def _two_way(
        self, peer: Peer, frame: Frame, route: Route, now: float
    ) -> tuple[str, int] | None:
        """A REQUEST, REPLY or ERROR; returns (outcome, recipients) for the capture tap, or
        None for a frame the I/O layer handles (GOODBYE: it closes after flushing)."""
        ftype = frame.type
        if ftype == _REQUEST:
            return self._request(peer, frame, route, now)
        if ftype == _REPLY or ftype == _ERROR:
            if frame.request_id:
                outcome = self._answer(peer, frame, route, now)
                return outcome, int(outcome == "forwarded")
            log.warning(
                "client %s reported a connection error: %r", peer.describe(), _safe_header(frame)
            )
            return "logged", 0
        return None

    def _request(self, peer: Peer, frame: Frame, route: Route, now: float) -> tuple[str, int]:
        """Route a REQUEST; returns (outcome, recipients) for the capture tap."""
        b = self._broker
        delivery = self.delivery
        reply_error = delivery.reply_error
        limits = delivery.limits
        rid = frame.request_id
        if not rid:
            raise RemoteProtocolError("REQUEST without a request id")
        if self.rpc.is_pending(peer, rid):
            reply_error(peer, rid, ErrorCode.BAD_REQUEST, f"request id {rid} is already pending")
            return "refused", 0
        if len(peer.pending_out) >= limits.max_pending_requests:
            reply_error(
                peer,
                rid,
                ErrorCode.LIMIT_EXCEEDED,
                f"more than max_pending_requests={limits.max_pending_requests} requests pending",
            )
            return "refused", 0
        acct = peer.account
        if len(peer.pending_out) >= acct.pending_share:
            # Over its even part of its user's quota: the user's sum decides (core/users.py).
            used, most = acct.pending_requests(), acct.limits["pending_requests"]
            if used >= most:
                why = b.quota_refused(peer, "pending_requests", used, most, acct.key)
                reply_error(peer, rid, ErrorCode.LIMIT_EXCEEDED, why)
                return "refused", 0
        header = frame.header()
        kind = route[0]
        command = header.get("cmd")
        if not isinstance(command, str):
            raise RemoteProtocolError("REQUEST header without a string 'cmd'")
        if kind == BROKER:
            b.own_commands.run(peer, frame, command)
            return "broker", 1
        if kind == PATTERN:
            reply_error(peer, rid, ErrorCode.BAD_REQUEST, str(valid_target_name(frame.target)))
            return "refused", 0
        # Per-command statistics (core/cmdstats.py): the request is counted here, its
        # outcome below or, once delivered, by the pending call (core/rpc.py).
        group = route[1] if kind != DIRECT else DIRECT_GROUP
        stat = self._command_pairs.get((group, command))
        if stat is None:
            stat = self._command_stat(group, command)  # a new pair, or "other"
        else:
            stat.requests += 1  # CommandStats.entry for a tracked pair, without its call
        acl = peer.acl
        if acl is not None and kind != RESERVED:
            why = self._check_call(peer, acl, frame, route, command)
            if why:
                stat.refused += 1
                reply_error(peer, rid, ErrorCode.FORBIDDEN, why)
                return "refused", 0
        if kind == RESERVED:
            stat.refused += 1
            reply_error(
                peer, rid, ErrorCode.FORBIDDEN, f"{frame.target!r} is published by the broker only"
            )
            return "refused", 0
        relays = self.relays
        binder = relays.binder(peer, frame, route) if relays.bindings else None
        if binder is not None:
            if frame.fds:
                # Refused here, before the binder could store the request without them;
                # handle_many closes the descriptors the broker received.
                stat.refused += 1
                reply_error(
                    peer, rid, ErrorCode.BAD_REQUEST, relays.no_fds_to(binder, frame.target, route)
                )
                return "refused", 0
            recipients = [binder]
        else:
            recipients = list(self.router.recipients(route, peer if kind == GROUP else None))
        if not recipients:
            self.stats["no_recipient"] += 1
            stat.no_recipient += 1
            reply_error(
                peer,
                rid,
                ErrorCode.NO_RECIPIENT,
                f"no recipient for {frame.target!r}",
                target=frame.target,
            )
            return "no-recipient", 0
        multi = frame.flags & _FLAG_ALL
        if not multi and len(recipients) > 1:
            stat.refused += 1
            reply_error(
                peer,
                rid,
                ErrorCode.MULTIPLE_RECIPIENTS,
                f"{frame.target!r} has {len(recipients)} members; address one instance "
                f"({frame.target}[N] or {frame.target}[?]) or call every member",
            )
            return "refused", 0
        timeout = limits.request_timeout
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
                source=BROKER_STAMP,
            )
            delivery.send_from_broker(peer, routed, "a routing answer")
        source = peer.stamp
        if relays.bindings and frame.source != source:
            source = relays.source(peer, frame, route)
        pieces = stamped(frame, source)
        size = sum(len(p) for p in pieces)
        nfds = len(frame.fds)
        delivered: list[Peer] = []
        for r in recipients:
            if r.sealed:
                stat.refused += 1
                reply_error(
                    peer, rid, ErrorCode.RECIPIENT_GONE, f"{r.lname} is leaving", source=r.stamp
                )
            elif frame.fds and r.remote:
                stat.refused += 1
                reply_error(
                    peer,
                    rid,
                    ErrorCode.BAD_REQUEST,
                    f"{r.lname} is connected over TCP: file descriptors cannot reach it",
                    source=r.stamp,
                )
            elif (
                r.outq_bytes + size > r.account.memory_share
                or (nfds and r.outq_fds + nfds > r.account.fds_share)
            ) and (quota := user_full(r, size, nfds)):
                # The receiver's user is over its quota: the caller is refused (a request
                # is never held); only a caller of that same user is counted towards
                # being dropped, another user's is not at fault.
                owner = r.account
                used = owner.memory() if quota == "memory" else owner.fds()
                why = b.quota_refused(
                    peer, quota, used, owner.limits[quota], owner.key, strike=owner is acct
                )
                reply_error(peer, rid, ErrorCode.LIMIT_EXCEEDED, why, source=r.stamp)
            elif delivery.enqueue(r, pieces, frame.fds):
                delivered.append(r)
            else:
                stat.refused += 1
                reply_error(
                    peer,
                    rid,
                    ErrorCode.RECEIVER_FULL,
                    f"{r.lname} has {r.outq_bytes} bytes queued (out_hard_limit "
                    f"{limits.out_hard_limit})",
                    source=r.stamp,
                )
        if delivered:
            if frame.flags & _FLAG_TRACED:
                self.traces.delivered_to = delivered  # for its hop (handle_many records it)
            self.rpc.add(peer, rid, delivered, now + timeout, frame.target, command, stat, now)
            return "delivered", len(delivered)
        return "refused", 0

    def _check_call(self, peer: Peer, acl: Access, frame: Frame, route: Route, command: str) -> str:
        """Why ``peer`` may not make this request ("" if it may). A command a plugin
        declared a verb for (``Policy.commands``, e.g. the queue plugin's
        ``consume``/``produce``) also needs that verb on the object its params name (the
        one place the broker decodes a request body, and only for a restricted peer's
        request to such a plugin's group)."""
        b = self._broker
        base = route[1]
        if not acl.allowed(CALL, base):
            return b.refuse(peer, "call to", base)
        policy = b.policy
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
                    return b.refuse(
                        peer, f"{verb} ({declared.param} command {command!r}) on", str(name)
                    )
        return ""

    def _answer(self, peer: Peer, frame: Frame, route: Route, now: float = 0.0) -> str:
        kind, _base, caller_id = route
        if kind == BROKER:
            return "discarded"  # the answer to a heartbeat: its arrival was the point
        caller = (
            self.rpc.answer(
                peer,
                caller_id,
                frame.request_id,
                now,
                _error_code(frame) if frame.type == _ERROR else None,
            )
            if kind == DIRECT
            else None
        )
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
            self.delivery.reply_error(
                caller,
                frame.request_id,
                ErrorCode.BAD_REQUEST,
                f"the answer from {peer.lname} carried file descriptors, which cannot cross TCP",
                source=peer.stamp,
            )
            return "refused"
        self.delivery.send_or_kick(
            caller, stamped(frame, peer.stamp), "an answer it asked for", frame.fds
        )
        if self.traces.calls:  # some traced request waits for its answer
            self.traces.answer(caller, peer, frame, now)
        return "forwarded"


#: The longest error code the statistics keep as it is (a callee chooses its codes).
_MAX_CODE_LEN = 64


def _error_code(frame: Frame) -> str:
    """An ERROR answer's code for the statistics: ``"invalid"`` if its header has none
    (the caller is told by its client library; the broker forwards the frame as it is)."""
    try:
        code = frame.header().get("code")
    except RemoteProtocolError:
        return "invalid"
    return code[:_MAX_CODE_LEN] if isinstance(code, str) and code else "invalid"


def _safe_header(frame: Frame) -> object:
    try:
        return frame.header()
    except RemoteProtocolError:
        return "<malformed header>"
