"""Delivery: the queue per receiver, its bounds, and the backpressure decisions.

Queues a frame on each receiver's ``Peer.outq`` and decides, per receiver, what its bounds
ask for (recorded in :class:`~.effects.Effects`): over ``out_soft_limit`` the sender is
paused; a one-way frame a receiver cannot take within ``out_hard_limit`` /
``max_fds_queued`` is held (the sender waits), and a frame a receiver is owed (an answer,
a notification) that it cannot take drops that receiver (slow consumer). Also the frames
the broker itself sends (error answers), since they obey the same rules.

Pure: no trio, no sockets; descriptors are duplicated and closed through injected calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..config import Limits, QuotaSettings
from ..protocol.codes import ErrorCode, FrameType
from ..protocol.framing import FdBuffer, Frame, Run, encode_cbor, encode_frame, stamped
from .effects import Effects, Hold
from .peers import Buffer, Peer
from .tap import Taps
from .users import Users

BROKER_LNAME = "l.0"
#: The source section of every frame the broker originates.
BROKER_STAMP = BROKER_LNAME.encode() + b"\0msgq"

_ERROR = FrameType.ERROR


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


def user_full(r: Peer, size: int, nfds: int) -> str:
    """The quota of ``r``'s user that ``size`` more bytes and ``nfds`` more descriptors
    queued for ``r`` would exceed ("" if none)."""
    acct = r.account
    if acct.memory_full(size):
        return "memory"
    if nfds and acct.fds_full(nfds):
        return "fds"
    return ""


def user_held(r: Peer, size: int, nfds: int) -> bool:
    """:func:`user_full` for a frame about to be held: counted in the account's ``held``."""
    quota = user_full(r, size, nfds)
    if quota:
        r.account.held[quota] += 1
    return bool(quota)


def _size(pieces: list[Buffer]) -> int:
    n = 0
    for p in pieces:
        n += len(p)
    return n


class Delivery:
    """Queues frames for receivers within their bounds; records what that asks of the
    I/O layer in ``effects``.

    Args:
        limits: the bounds in force (replaced on a reload: assign ``limits``).
        effects: where wake-ups, pauses and holds are recorded.
        stats: the broker's counters (``no_recipient`` is counted here).
        taps: the capture hooks (broker-originated frames are shown to them).
        kick: drops a receiver (``Broker.kick``): called for a slow consumer.
        dup_fd: duplicates a descriptor for one receiver.
        users: the per-user accounts (None: quotas off).
    """

    def __init__(
        self,
        limits: Limits,
        effects: Effects,
        stats: dict[str, int],
        taps: Taps,
        kick: Callable[[Peer, ErrorCode, str], None],
        dup_fd: Callable[[int], int],
        users: Users | None = None,
    ) -> None:
        self.limits = limits
        #: The per-user accounts (core/users.py): their floors bound the first pass.
        self.users = users if users is not None else Users(QuotaSettings(enabled=False), 1)
        self.users.on_floors = self.recap
        self.recap()
        self.effects = effects
        self.stats = stats
        self.taps = taps
        self._kick = kick
        self._dup_fd = dup_fd

    def deliver(
        self,
        peer: Peer,
        frame: Frame,
        recipients: Iterable[Peer],
        skip: Peer | None,
        source: bytes,
        hold: bool = True,
    ) -> int:
        """Queue ``frame`` (stamped with ``source``) for each recipient but ``skip`` (the
        sender, for a broadcast to a group); returns how many got it.

        A recipient that cannot take the frame without going over ``out_hard_limit`` or
        ``max_fds_queued``: with ``hold`` nobody gets it, ``effects.hold`` names those
        recipients and -1 is returned (the sender waits; see ``Broker.handle``). Without
        ``hold`` such a recipient is dropped (slow-consumer) rather than losing the
        message silently. ``recipients`` must be iterable twice (the router returns
        sequences).
        """
        pieces: list[Buffer] | None = None
        size = n = 0
        over: list[Peer] | None = None
        limits = self.limits
        hard = limits.out_hard_limit
        soft = limits.out_soft_limit
        effects = self.effects
        wake = effects.wake
        nfds = len(frame.fds)
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
            # The per-user quotas (core/users.py) lower the bar of this pass to the
            # smallest even part of a user's quota any connection has: a receiver below
            # it is within its own bounds and its user's (no more per receiver than
            # before); one above it is looked at closely (``_over``).
            room = self.room_cap - size
            max_fds = self.fds_cap - nfds
            for r in recipients:
                if (
                    (r.outq_bytes > room or (nfds and r.outq_fds > max_fds))
                    and not (r is skip or r.sealed)
                    and self._over(r, size, nfds)
                ):
                    over = over or []
                    over.append(r)
            if over:
                effects.hold = Hold(over, size, nfds)
                return -1
        for r in recipients:
            if r is skip or r.sealed:
                continue
            if pieces is None:
                pieces = stamped(frame, source)
                size = _size(pieces)
            if r.outq_bytes + size > hard or (nfds and r.outq_fds + nfds > limits.max_fds_queued):
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
            wake.add(r)
            if r.outq_bytes > soft:
                effects.pause.add(r)
        if not n:
            self.stats["no_recipient"] += 1
        elif spliced is not None:
            spliced.taken = True  # its receiver's queue owns it now
        if over:
            for r in over:
                self._kick(
                    r,
                    ErrorCode.SLOW_CONSUMER,
                    f"outgoing queue over out_hard_limit ({hard} bytes) or "
                    f"max_fds_queued ({limits.max_fds_queued}) "
                    f"with a message from {peer.describe()}",
                )
        return n

    def deliver_run(self, peer: Peer, run: Run, members: Iterable[Peer]) -> int:
        """Queue ``run`` for every member of its group but ``peer``; returns how many got
        it, or -1 (nothing queued, no hold recorded) if one of them cannot take all of it
        within ``out_hard_limit``: the caller then handles the frames one by one, which
        holds the sender at the exact frame."""
        raw = run.raw
        size = len(raw)
        limits = self.limits
        room = self.room_cap - size
        for r in members:
            if r.outq_bytes > room and not (r is peer or r.sealed) and self._over(r, size, 0):
                return -1
        soft = limits.out_soft_limit
        effects = self.effects
        wake = effects.wake
        count = run.count
        n = 0
        for r in members:
            if r is peer or r.sealed:
                continue
            r.outq.append(raw)
            r.outq_bytes += size
            r.msgs_out += count
            n += 1
            wake.add(r)
            if r.outq_bytes > soft:
                effects.pause.add(r)
        if not n:
            self.stats["no_recipient"] += count
        return n

    def recap(self) -> None:
        """Recompute the bars of the first pass (``room_cap``, ``fds_cap``): the hard
        bounds, or the users' floors when lower. Called when either changes."""
        users = self.users
        self.room_cap = min(self.limits.out_hard_limit, users.memory_floor)
        self.fds_cap = min(self.limits.max_fds_queued, users.fds_floor)

    def _over(self, r: Peer, size: int, nfds: int) -> bool:
        """True if ``r`` cannot take ``size`` more bytes and ``nfds`` more descriptors:
        over its own ``out_hard_limit`` / ``max_fds_queued``, or its user's quota (summed
        only when ``r`` holds more than its even part of it; a hold is counted)."""
        limits = self.limits
        if r.outq_bytes + size > limits.out_hard_limit or (
            nfds and r.outq_fds + nfds > limits.max_fds_queued
        ):
            return True
        acct = r.account
        if r.outq_bytes + size > acct.memory_share or (nfds and r.outq_fds + nfds > acct.fds_share):
            return user_held(r, size, nfds)
        return False

    def _with_fds(self, first: Buffer, fds: tuple[int, ...]) -> FdBuffer:
        """The frame's first piece carrying this recipient's own duplicates of ``fds``."""
        return FdBuffer(bytes(first), tuple(self._dup_fd(fd) for fd in fds))

    def enqueue(self, r: Peer, pieces: list[Buffer], fds: tuple[int, ...] = ()) -> bool:
        """Queue a frame (with duplicates of ``fds``) for ``r``; False if it would go over
        ``out_hard_limit`` or ``max_fds_queued``, or ``r`` is leaving."""
        if not r.alive or r.sealed:
            return False
        size = _size(pieces)
        limits = self.limits
        if r.outq_bytes + size > limits.out_hard_limit:
            return False
        if fds:
            if r.outq_fds + len(fds) > limits.max_fds_queued:
                return False
            r.outq.append(self._with_fds(pieces[0], fds))
            r.outq.extend(pieces[1:])
            r.outq_fds += len(fds)
        else:
            r.outq.extend(pieces)
        r.outq_bytes += size
        r.msgs_out += 1
        self.effects.wake.add(r)
        if r.outq_bytes > limits.out_soft_limit:
            self.effects.pause.add(r)
        return True

    def send_or_kick(
        self, r: Peer, pieces: list[Buffer], what: str, fds: tuple[int, ...] = ()
    ) -> None:
        """Queue a frame ``r`` is owed (an answer it asked for, a notification it subscribed
        to); if its queue is over its bounds it is dropped, never left waiting."""
        if r.alive and not r.sealed and not self.enqueue(r, pieces, fds):
            limits = self.limits
            self._kick(
                r,
                ErrorCode.SLOW_CONSUMER,
                f"cannot take {what}: outgoing queue over out_hard_limit "
                f"({limits.out_hard_limit} bytes) or max_fds_queued "
                f"({limits.max_fds_queued})",
            )

    def send_from_broker(self, r: Peer, pieces: list[Buffer], what: str) -> None:
        """:meth:`send_or_kick` for a frame the broker originated, shown to the capture."""
        self.send_or_kick(r, pieces, what)
        if self.taps.frame is not None:
            self.taps.show_broker_frame(pieces)

    def reply_error(
        self,
        to: Peer,
        request_id: int,
        code: ErrorCode,
        message: str,
        *,
        source: bytes = BROKER_STAMP,
        data: object = None,
        target: str = "",
    ) -> None:
        """Answer ``to``'s request ``request_id`` with an ERROR the broker writes (in the
        name of ``source``: the callee it speaks for, or the broker)."""
        header: dict[str, object] = {"code": str(code), "message": message, "broker": True}
        pieces = encode_frame(
            _ERROR,
            target=target or to.lname,
            request_id=request_id,
            header=encode_cbor(header),
            body=encode_cbor(data) if data is not None else b"",
            source=source,
        )
        self.send_from_broker(to, pieces, f"a {code} answer")
