"""The core's outputs as a value: what the I/O layer must do after the core ran.

Every entry point of the core (a batch of frames, a deadline, a command, a policy change,
a disconnect) queues frames on the receivers' ``Peer.outq`` and records here what that
asks of the I/O layer. The I/O layer applies it and resets it; the core never reaches
into sockets or tasks, and the I/O layer never reads the core's private state.

One :class:`Effects` lives as long as its broker and is reset in place after each use:
the hot path (a batch of small messages) must not allocate per message, nor per batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..protocol.codes import ErrorCode
    from .peers import Peer


class Hold:
    """A one-way frame the core did not take: ``receivers`` cannot queue ``size`` more
    bytes (``fds`` more descriptors) within their hard bounds. The sender waits until they
    drained (dropping one that makes no progress) and hands the frame in again."""

    __slots__ = ("fds", "receivers", "size")

    def __init__(self, receivers: list[Peer], size: int, fds: int) -> None:
        self.receivers = receivers
        self.size = size
        self.fds = fds

    def __repr__(self) -> str:
        return f"<Hold {self.size} bytes, {self.fds} fds for {self.receivers}>"


class Effects:
    """What the core decided, for the I/O layer to apply.

    * ``wake``: peers whose ``outq`` got frames (the writes): write or wake their writer.
    * ``kicks``: peers the core dropped, with the final error to send (close them).
    * ``pause``: receivers over ``out_soft_limit``: the sender that fed them stops
      reading until they drained below it.
    * ``hold``: set when a one-way frame was held, not delivered (see :class:`Hold`).

    ``wake`` and ``kicks`` are applied by whoever ran the core (``Server.after_core``);
    ``pause`` and ``hold`` by the reader whose frames caused them.
    """

    __slots__ = ("hold", "kicks", "pause", "wake")

    def __init__(self) -> None:
        self.wake: set[Peer] = set()
        self.kicks: list[tuple[Peer, ErrorCode, str]] = []
        self.pause: set[Peer] = set()
        self.hold: Hold | None = None

    def take_kicks(self) -> list[tuple[Peer, ErrorCode, str]]:
        """The kicks recorded so far, and none from now on."""
        kicks = self.kicks
        if kicks:
            self.kicks = []
        return kicks

    def take_hold(self) -> Hold | None:
        """The hold recorded by the last batch, and none from now on."""
        hold, self.hold = self.hold, None
        return hold

    def take_pause(self) -> list[Peer]:
        """The receivers to wait for, and none from now on."""
        pause = list(self.pause)
        self.pause.clear()
        return pause

    def forget(self, peer: Peer, *, queue_dropped: bool) -> None:
        """``peer`` is gone: nobody waits for it; with ``queue_dropped`` nothing is left to
        write to it either."""
        self.pause.discard(peer)
        if queue_dropped:
            self.wake.discard(peer)

    def __repr__(self) -> str:
        return (
            f"<Effects wake={len(self.wake)} kicks={len(self.kicks)} "
            f"pause={len(self.pause)} hold={self.hold!r}>"
        )
