"""The session's side of the connection's life: what a loss, a failed attempt and a
reconnect mean for the protocol state, and the restore policy (what a new connection
gets back). Mixed into :class:`~msgq_trio.client.session.Session`, whose state it reads;
the schedule itself (states, backoff, deadlines) is :class:`~msgq_trio.client.lifecycle.
Lifecycle`'s, the dialing and sleeping the drivers'.
"""

from __future__ import annotations

import logging

from ..errors import ConnectionLost, MsgqError
from .lifecycle import Lifecycle, State

__all__ = ["RestorePolicy"]

log = logging.getLogger("msgq_trio.client")


class RestorePolicy:
    """Loss, reconnect and restore of one client connection (mixed into the session)."""

    life: Lifecycle
    groups: dict[str, None]
    lost: ConnectionLost | None
    closing: bool
    fd_passing: bool
    lname: str

    def fail(self, exc: ConnectionLost) -> ConnectionLost:
        raise NotImplementedError  # the session's: it fails the pending calls

    def subscribed(self, group: str) -> None:
        """The broker confirmed a ``subscribe`` to ``group``: a reconnect joins it
        again."""
        self.groups[group] = None

    def unsubscribed(self, group: str) -> None:
        """The broker confirmed an ``unsubscribe``: a reconnect does not join it."""
        self.groups.pop(group, None)

    # -- the connection's life (client/lifecycle.py) and what a reconnect restores --------
    def welcomed(self, remote: bool) -> State:
        """WELCOME was taken on a connection (:meth:`receive_welcome`): it is up, sends
        and calls go out again. Over TCP (``remote``) no descriptors can pass (no
        SCM_RIGHTS): sending any is refused up front, by every driver alike. Returns
        the new state: READY, or RESTORING after a reconnect (the driver then runs the
        restore: :meth:`restore_groups`, :meth:`restore_refused`, :meth:`restored`)."""
        self.lost = None
        if remote:
            self.fd_passing = False
        return self.life.welcomed()

    def connection_lost(self, exc: ConnectionLost, now: float) -> bool:
        """The connection ended with ``exc`` (the first reason stays): every pending call
        fails with it, and the lifecycle decides what follows. ``lost`` is then what
        sends and calls raise: the loss itself when the end is final, else the
        reconnecting error. Returns True if the end is final (reconnect off, the bus
        closed, or the policy gave up)."""
        lost = self.fail(exc)
        self.lost = self.life.lost(lost, now, closing=self.closing)
        return self.life.final

    def attempt_failed(self, exc: BaseException, now: float) -> bool:
        """A reconnect attempt failed with ``exc`` (dial, handshake, restore, or its
        deadline). Returns True once the policy gave up: ``lost`` is then the final
        ConnectionLost (code ``reconnect-gave-up``)."""
        log.debug("reconnect attempt to %s failed: %s", self.life.target, exc)
        gave_up = self.life.attempt_failed(exc, now)
        if gave_up is None:
            return False
        self.lost = gave_up
        return True

    def restore_groups(self) -> list[str]:
        """The groups a reconnect joins again, in the order they were joined: what this
        client joined by its own ``subscribe`` and did not leave.

        The restore policy (the rest needs no step here): command handlers, inline
        handlers, the default handler and notification callbacks are client-side and
        stay as they are (the broker routes by lname or group and knows none of them);
        a group the broker now refuses is dropped and logged (:meth:`restore_refused`);
        queue consumers consume again from the bus's ``on_reconnected`` callbacks, run
        once the groups are joined (client/queue.py); pipe ends are not restored: a
        handle's requests in flight fail with ConnectionLost and the pipe plugin
        forgets a connection's handles, so a pipe is opened again by its owner; calls
        pending at the loss failed with the loss (request ids go on increasing, so a
        late answer never meets a new call); a request received on the old connection
        is not answered on the new one (:attr:`generation`)."""
        return list(self.groups)

    def restore_refused(self, group: str, exc: MsgqError) -> None:
        """The broker refused to let this client join ``group`` again after a reconnect:
        logged as an ERROR, and the group is no longer joined."""
        log.error("after reconnecting, cannot join %r again: %s", group, exc)
        self.unsubscribed(group)

    def restored(self) -> None:
        """The reconnect's restore is complete: READY (the reconnect is counted and
        logged)."""
        self.life.restored(self.lname)
