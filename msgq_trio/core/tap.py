"""The capture tap: the hook operations code sets to see every frame the broker routes.

``Taps.frame`` is called as ``tap(sender, frame, outcome, recipients)`` for every frame a
client sends and every frame the broker originates (sender None). Outcomes: delivered,
no-recipient, refused, forwarded, discarded, logged, broker. None = capture off, which
costs one attribute test per frame (per batch on the hot path).

``Taps.run`` is the optional companion for a :class:`~msgq_trio.protocol.framing.Run`:
``tap_run(sender, run, outcome, recipients)`` must show the tap's sinks what ``tap``
would see for each of its frames, without a Frame per message. None: ``tap`` per frame.
"""

from __future__ import annotations

from collections.abc import Callable

from ..protocol.framing import Frame, FrameParser, Run
from .peers import Buffer, Peer

TapFn = Callable[[Peer | None, Frame, str, int], None]
TapRunFn = Callable[[Peer, Run, str, int], None]


class Taps:
    """The capture hooks in force (shared by the parts of the core that route frames)."""

    __slots__ = ("frame", "run")

    def __init__(self) -> None:
        self.frame: TapFn | None = None
        self.run: TapRunFn | None = None

    def show_broker_frame(self, pieces: list[Buffer], recipients: int = 1) -> None:
        """Show a frame the broker originated (only called when capture is on): parsed
        back from its pieces, since the broker builds frames as bytes."""
        tap = self.frame
        if tap is None:
            return
        parser = FrameParser()
        parser.feed(b"".join(pieces))
        frame = parser.next_frame()
        if frame is not None:
            tap(None, frame, "delivered", recipients)

    def show_run(self, peer: Peer, run: Run, n: int) -> None:
        """Show every frame of a delivered ``run`` (only called when capture is on)."""
        tap = self.frame
        if tap is None:
            return
        outcome = "delivered" if n else "no-recipient"
        if self.run is not None:
            self.run(peer, run, outcome, n)
            return
        for frame in run.frames():
            tap(peer, frame, outcome, n)
