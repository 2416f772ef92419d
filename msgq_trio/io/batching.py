"""Writes to peers batched per pass of trio's scheduler (``Server.after_core``).

Readers woken by one poll of the sockets all run in one pass of trio's scheduler. When
many of them forward frames to one peer (a hundred callers of one service), writing at
each reader's turn costs one ``write`` each, and each can wake the receiving process: a
wake-up costs more than handling a small frame. Here the first write of a pass goes at
once (a lone call waits for nothing), and what the pass's later readers queue is written
at the end of the pass, one write per peer, just before the loop waits for I/O again
(trio's ``before_io_wait`` instrument hook: no task switch, no extra pass). The receiver
then reads the batch in one wake-up too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import trio

from ..core.peers import Peer
from .connection import PeerConnection

log = logging.getLogger("msgq_trio.broker")


def _nothing() -> None:
    pass


class WriteBatcher(trio.abc.Instrument):
    """Writes the queues of the peers the core queued frames for: the first time in a
    pass at once, later ones at the end of the pass.

    :meth:`start` in the loop that runs the connections (``Server.run``), :meth:`stop`
    once they have ended.
    """

    def __init__(self, conns: Mapping[Peer, PeerConnection]) -> None:
        self._conns = conns
        #: Peers queued to since the pass's first write, in the order first queued to.
        self._pending: dict[Peer, None] = {}
        #: Whether this pass wrote already (reset before each wait for I/O).
        self._wrote = False
        self._token: trio.lowlevel.TrioToken | None = None

    def start(self) -> None:
        """Take part in the current trio loop's passes (call from inside it)."""
        self._token = trio.lowlevel.current_trio_token()
        trio.lowlevel.add_instrument(self)

    def stop(self) -> None:
        """Leave the loop's passes (if :meth:`start` joined them), writing anything still
        pending."""
        if self._token is None:
            return
        trio.lowlevel.remove_instrument(self)
        self.before_io_wait(0.0)
        self._token = None

    def queued(self, peers: Iterable[Peer]) -> None:
        """The core queued frames for ``peers`` (called in a task of the loop)."""
        if self._wrote:
            pending = self._pending
            for p in peers:
                pending[p] = None
        else:
            self._wrote = True
            self._send(peers)

    def before_io_wait(self, timeout: float) -> None:
        """Trio's hook, once per pass of its scheduler: write what the pass queued.

        Runs outside any task, after trio chose how long to sleep: a task this wakes (a
        writer for what the kernel did not take, a sender paused by backpressure) would
        wait for that sleep, so the loop is woken then (``run_sync_soon``). Never raises:
        trio would disable the instrument, and nothing queued after would be written.
        """
        self._wrote = False
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        try:
            woke = self._send(pending)
        except Exception:  # a bug: leave the writing to the peers' writer tasks
            log.exception("batched write failed; the peers' writers take over")
            woke = True
            for p in pending:
                pc = self._conns.get(p)
                if pc is not None:
                    pc.wake.set()
        if woke and timeout and self._token is not None:
            self._token.run_sync_soon(_nothing)

    def _send(self, peers: Iterable[Peer]) -> bool:
        """Write each peer's small queue now; wake its writer for what remains. True
        when a task was woken."""
        conns = self._conns
        woke = False
        for p in peers:
            pc = conns.get(p)
            if pc is not None:
                woke = pc.send_now() or woke
                if p.outq:
                    pc.wake.set()
                    woke = True
        return woke
