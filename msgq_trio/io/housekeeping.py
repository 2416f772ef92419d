"""The broker's housekeeping tasks beside the connections: the RPC deadline timer, TCP
heartbeats and memory give-back (malloc_trim), and the process figures of ``stats``.

Each task takes what it needs as arguments (the heartbeat task a :class:`HeartbeatHost`),
never the Server: the server imports this module, not the other way round.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from typing import Protocol

import trio

from ..config import TcpSettings
from ..core.broker import Broker
from ..protocol.codes import ErrorCode
from .connection import PeerConnection
from .wakeup import Wakeup

log = logging.getLogger("msgq_trio.io")

#: Memory give-back (see trim_task): look every TRIM_INTERVAL seconds, trim when the
#: resident size grew by TRIM_GROWTH bytes since the last trim.
TRIM_INTERVAL = 2.0
TRIM_GROWTH = 8 * 1024 * 1024


class HeartbeatHost(Protocol):
    """What :func:`heartbeat_task` needs from the daemon that runs it."""

    @property
    def core(self) -> Broker: ...

    @property
    def tcp(self) -> TcpSettings: ...

    def connections(self) -> Iterable[PeerConnection]:
        """The admitted connections, as a snapshot (safe to iterate across awaits)."""
        ...

    def after_core(self) -> None:
        """Apply what the core decided (``Broker.effects``)."""
        ...


class DeadlineTimer:
    """Sleeps until the core's earliest RPC deadline and lets the core answer ``timeout``.

    :meth:`arm` is called after every core change (``Server.after_core``) with the core's
    next deadline; it wakes the task only for a deadline earlier than the one it sleeps
    for.
    """

    __slots__ = ("_wake", "target")

    def __init__(self) -> None:
        self._wake = Wakeup()
        #: The deadline the task sleeps until (inf: none).
        self.target = math.inf

    def arm(self, deadline: float | None) -> None:
        """Make the task wake by ``deadline`` (None: no deadline, nothing to do)."""
        if deadline is not None and deadline < self.target:
            self.target = deadline
            self._wake.set()

    async def run(self, core: Broker, after_core: Callable[[], None]) -> None:
        """Expire ``core``'s requests at their deadlines, then ``after_core()``; forever."""
        while True:
            d = core.next_deadline()
            self.target = d if d is not None else math.inf
            with trio.move_on_at(self.target):
                await self._wake.wait()
            # target stays at the deadline we slept for while we expire, so the
            # after_core below re-arms only for an earlier deadline, never in a loop.
            core.expire(trio.current_time())
            after_core()


async def heartbeat_task(server: HeartbeatHost) -> None:
    """Every heartbeat interval: ping each TCP client we heard nothing from during the
    last interval; drop one silent for ``heartbeat_misses`` intervals (it crashed, its
    host died, or the network path did: a Unix socket would have told us at once).

    Not counted as silence: intervals in which our reader was paused by backpressure
    (we were not listening; the client is pinged anyway, so that a dead one answers
    with a reset the paused reader notices), or in which a backlog queued for it kept
    draining (its stack is taking data; the slow-consumer rule judges that case).
    """
    while True:
        interval = server.tcp.heartbeat_interval
        await trio.sleep(interval)
        for pc in server.connections():
            peer = pc.peer
            if not peer.remote or not peer.alive or pc.conn.sent_goodbye:
                continue
            rx = pc.conn.received_bytes
            draining = peer.outq_bytes > 0 and pc.writes != pc.hb_progress
            pc.hb_progress = pc.writes
            if pc.paused:
                # Its silence is ours, but it is pinged all the same: over TCP a
                # dead client's FIN waits behind the data we are not reading (a
                # zero window), while its kernel answers our ping with a reset,
                # which PeerConnection._await_progress's hang-up poll sees.
                pc.hb_rx = rx
                pc.hb_missed = 0
                server.core.heartbeat(peer)
                continue
            if rx != pc.hb_rx or draining:
                pc.hb_rx = rx
                pc.hb_missed = 0
                continue
            pc.hb_missed += 1
            if pc.hb_missed >= server.tcp.heartbeat_misses:
                server.core.kick(
                    peer,
                    ErrorCode.HEARTBEAT_TIMEOUT,
                    f"nothing received for {pc.hb_missed} heartbeat intervals of "
                    f"{interval} s (tcp.heartbeat_misses)",
                )
            else:
                server.core.heartbeat(peer)
        server.after_core()


async def trim_task() -> None:
    """Hand freed heap memory back to the system after bursts of large frames.

    Why: glibc raises its mmap threshold to the largest buffer freed so far, after
    which multi-megabyte frames live on the heap, and freed heap pages stay resident:
    a broker that relayed a burst of 8 MiB frames stayed that much larger for good
    (scenario sigkill-mid-frame). Mapping every large buffer apart instead would make
    each large frame fault in fresh pages, a cost paid per frame. So: every
    TRIM_INTERVAL, if the resident size grew by TRIM_GROWTH since the last trim,
    ``malloc_trim(0)``: it walks the heap and blocks the loop while it does, so it runs
    at most once per interval and only after such growth. Under another C library this
    task ends at once.
    """
    trim = _malloc_trim()
    if trim is None:
        return
    floor = rss_bytes()
    while True:
        await trio.sleep(TRIM_INTERVAL)
        rss = rss_bytes()
        if rss - floor >= TRIM_GROWTH:
            trim(0)
            floor = rss_bytes()
            log.debug("malloc_trim: resident %d -> %d bytes", rss, floor)
        elif rss < floor:
            floor = rss


#: glibc's mallopt parameters (malloc.h) and the values :func:`tune_malloc` sets.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: The largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2): buffers up to
#: 32 MiB (a 4 MiB frame, a 16 MiB configuration push) come from the heap.
MMAP_THRESHOLD = 32 * 1024 * 1024
#: Free memory at the top of the heap kept instead of returned at once: a burst of large
#: frames reuses its pages; :func:`trim_task` still hands them back after the burst.
TRIM_THRESHOLD = 64 * 1024 * 1024


def tune_malloc() -> bool:
    """Make large frame buffers reuse heap pages from the first frame on (glibc only;
    False elsewhere or if glibc refused).

    Why: glibc maps every buffer above its mmap threshold (128 KiB at start) apart, so
    each one faults in fresh zeroed pages, and raises that threshold only as it sees such
    buffers freed: a fresh broker copying 4 MiB frames (splice off, or a frame for
    several receivers) faulted in about 1,000 pages for each of its first four frames,
    with these thresholds for its first two only, then none either way
    (tests/e2e/test_large_cold.py). Fixing both thresholds at start skips that warm-up;
    it also ends glibc's dynamic
    adjustment, so the trim threshold is set too, and :func:`trim_task` returns the
    memory after a burst as before.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    ok: bool = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    trim_ok: bool = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return ok and trim_ok


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None under another C library."""
    import ctypes

    try:
        fn: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return fn


def count_tasks() -> int:
    """Number of live trio tasks in this run (leak checks: back to baseline after faults)."""
    todo = [trio.lowlevel.current_root_task()]
    n = 0
    while todo:
        task = todo.pop()
        if task is None:
            continue
        n += 1
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return n


def count_fds() -> int:
    """Open descriptors of this process (-1: cannot tell)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return -1


def rss_bytes() -> int:
    """Resident memory of this process in bytes (-1: cannot tell)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return -1
