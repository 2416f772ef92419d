"""Chained queues under faults: producer -> queue on broker A -> link -> queue on broker B
-> consumer, with faults on the link's path; checks that every message the producer got
ack 1 for reaches the consumer, and measures duplicates and where messages were written.

Library code, shared by tests/plugins/test_link.py and any other harness: the driver
knows the brokers only through a :class:`ChainTopology` (addresses and fault actions),
so the same traffic and the same faults run against two brokers on Unix sockets in one
machine or in two network namespaces over TCP.

The traffic: one producer (stable name, so A deduplicates its resends) puts ``n``
integers in batches of ``batch`` with ``window`` batches in flight; a batch whose ack 1
did not come (connection lost) is resent with the same seqs after reconnecting. One push
consumer at B records every body and acks it. Faults strike at points of the stream (a
count of acked batches), each only after at least one batch was acked since the
previous one recovered, so every fault hits a running stream.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import trio

from ..client.bus import connect
from ..errors import ConnectError, ConnectionLost, MsgqError, RpcError

__all__ = [
    "DEFAULT_FAULTS",
    "ChainFault",
    "ChainReport",
    "ChainTopology",
    "run_chain",
    "signal_broker",
]

log = logging.getLogger("msgq_trio.scenario.chain")


class ChainTopology(Protocol):
    """What the driver needs from a two-broker setup (A runs the queue and link plugins,
    B the queue plugin; the link forwards ``from_queue`` on A to ``to_queue`` on B)."""

    def address(self, broker: str) -> str:
        """The address clients connect to for broker ``"a"`` or ``"b"``."""
        ...

    async def signal(self, target: str, sig: int) -> None:
        """Send ``sig`` to ``"a"``, ``"b"`` (the broker process) or ``"link"`` (the link
        plugin's process on A). SIGKILL of a broker: returns once it is dead."""
        ...

    async def restart(self, broker: str) -> None:
        """Start broker ``"a"`` or ``"b"`` again on its store after a SIGKILL; returns
        once it listens (its plugins ready)."""
        ...

    async def cut(self, down: bool) -> None:
        """Take the network between A and B down (``True``) or up again: only topologies
        whose brokers talk over a network (``cut-net`` faults) need it."""
        ...


class _Process(Protocol):
    """A started process: ``subprocess.Popen`` or a wrapper with the same three names."""

    pid: int

    def send_signal(self, sig: int) -> None: ...

    def wait(self) -> int | None: ...


async def signal_broker(proc: _Process, sig: int) -> None:
    """A topology's ``signal`` for a broker process it started: SIGKILL returns once the
    process is dead (reaped, so a restart finds its store unlocked); any other signal
    is only sent."""
    if sig == signal.SIGKILL:
        proc.send_signal(sig)
        await trio.to_thread.run_sync(proc.wait)
    else:
        os.kill(proc.pid, sig)


@attrs.frozen
class ChainFault:
    """One fault: ``action`` at ``at`` (fraction of the batches acked).

    Actions: ``kill-a`` / ``kill-b`` (SIGKILL the broker, wait ``duration``, restart it
    on its store), ``kill-link`` (SIGKILL the link plugin; A's supervisor restarts it),
    ``stop-link`` / ``stop-b`` (SIGSTOP for ``duration``, then SIGCONT), ``cut-net``
    (the network between the brokers down for ``duration``: no FIN, no RST; only a
    heartbeat notices).
    """

    at: float
    action: str
    duration: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.action not in ("kill-a", "kill-b", "kill-link", "stop-link", "stop-b", "cut-net"):
            raise ValueError(f"unknown fault action {self.action!r}")
        if not 0 < self.at < 1:
            raise ValueError(f"fault point {self.at}: must be in (0, 1)")


#: The acceptance test's faults: the link cut five ways, A killed once.
DEFAULT_FAULTS = (
    ChainFault(0.15, "kill-b", 0.3),
    ChainFault(0.30, "kill-link"),
    ChainFault(0.42, "stop-link", 1.0),
    ChainFault(0.55, "kill-a", 0.2),
    ChainFault(0.70, "kill-b", 0.5),
    ChainFault(0.85, "stop-b", 1.0),
)


@attrs.define
class ChainReport:
    """What a run measured (``verdict()`` is its one-line summary)."""

    n: int = 0
    acked: int = 0  # messages the producer got ack 1 for
    received: int = 0  # distinct messages the consumer got
    #: deliveries beyond the first of a message within one consumer connection: B
    #: accepted the message twice (the dedup failed); expected 0
    duplicates: int = 0
    #: deliveries beyond the first in a later consumer connection: the consumer's ack
    #: was lost with the connection (B killed or stopped), so B redelivered what the
    #: consumer had already seen: at-least-once delivery to the consumer, at most its
    #: window per lost connection, not a failure of the chain's dedup
    redelivered_after_loss: int = 0
    consumer_sessions: int = 0
    missing: list[int] = attrs.field(factory=list)  # acked but never received
    faults: list[str] = attrs.field(factory=list)
    #: A's from-queue counters, summed over its runs (sampled before each kill of A,
    #: so a lower bound): put, stored (written at A), writes_skipped
    a_put: int = 0
    a_stored: int = 0
    a_skipped: int = 0
    #: the same before the first fault: the healthy link
    healthy_put: int = 0
    healthy_stored: int = 0
    link: dict[str, Any] = attrs.field(factory=dict)
    elapsed: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.missing and self.acked == self.n

    def share(self, stored: int, put: int) -> float:
        return stored / put if put else 0.0

    def verdict(self) -> str:
        return (
            f"chain {'PASS' if self.ok else 'FAIL'}: {self.acked}/{self.n} acked, "
            f"{self.received} received, {len(self.missing)} missing, "
            f"{self.duplicates} duplicates (+{self.redelivered_after_loss} redelivered "
            f"after {self.consumer_sessions - 1} consumer reconnects); written at A "
            f"{self.share(self.a_stored, self.a_put):.1%} overall (>= {self.a_stored} "
            f"of {self.a_put} puts), {self.share(self.healthy_stored, self.healthy_put):.1%}"
            f" while healthy ({self.healthy_stored} of {self.healthy_put}); link retries "
            f"{self.link.get('retries', '?')}, failures {self.link.get('failures', '?')};"
            f" faults: {', '.join(self.faults)}; {self.elapsed:.1f} s"
        )


async def _a_stats(topo: ChainTopology, queue: str) -> dict[str, Any] | None:
    try:
        with trio.fail_after(5):
            async with connect(topo.address("a"), "chain-probe") as bus:
                return dict(await bus.queue(queue).stats())
    except (MsgqError, trio.TooSlowError, OSError):
        return None


async def _link_status(topo: ChainTopology) -> dict[str, Any]:
    try:
        with trio.fail_after(5):
            async with connect(topo.address("a"), "chain-probe") as bus:
                rows = await bus.call("msgq-link", "status")
                return dict(rows[0]) if rows else {}
    except (MsgqError, trio.TooSlowError, OSError):
        return {}


async def run_chain(
    topo: ChainTopology,
    *,
    n: int = 12_000,
    batch: int = 100,
    window: int = 4,
    faults: Sequence[ChainFault] = DEFAULT_FAULTS,
    from_queue: str = "chain",
    to_queue: str = "chain",
    consumer_window: int = 64,
    rate: float = 1000.0,
    settle_timeout: float = 90.0,
    timeout: float = 300.0,
) -> ChainReport:
    """Run the traffic with ``faults`` against ``topo``; returns the report (the caller
    asserts on it; ``report.ok`` is the main verdict).

    ``rate`` (messages/s) paces the producer so that the faults strike a running
    stream (an unpaced producer finishes 12,000 messages before a broker restarts).

    Resource handling: every connection the driver opened is closed on return; the
    brokers are the topology's (left running).

    Raises:
        trio.TooSlowError: the whole run exceeded ``timeout``.
    """
    rep = ChainReport(n=n)
    batches = n // batch
    rep.n = batches * batch
    pending = list(range(batches))
    acked_batches: list[int] = []
    seen: Counter[int] = Counter()
    first_session: dict[int, int] = {}
    a_runs: list[dict[str, Any]] = []
    producer_done = trio.Event()
    began = trio.current_time()
    next_at = [began]  # when the producer may send its next batch
    # Fault points in batches acked. The producer does not run more than a window past
    # the next fault's point before that fault struck: a broker restart that is slow
    # under load must not let the stream end before every fault hit it.
    points = sorted(int(f.at * batches) for f in faults)

    async def producer() -> None:
        while pending:
            try:
                async with connect(topo.address("a"), "chain-producer") as bus:
                    q = bus.queue(from_queue, producer="chain-producer")
                    await q.prepare()
                    waits: collections.deque[Any] = collections.deque()

                    async def finish(waits: collections.deque[Any] = waits) -> None:
                        b, wait = waits.popleft()
                        await wait()  # ack 1: durable at A, or consumed downstream
                        acked_batches.append(b)
                        pending.remove(b)

                    for b in list(pending):
                        if len(waits) == window:
                            await finish()
                        while (
                            len(rep.faults) < len(points)
                            and len(acked_batches) + len(waits)
                            >= points[len(rep.faults)] + window + 2
                        ):
                            if waits:
                                await finish()
                            else:
                                await trio.sleep(0.01)
                        await trio.sleep_until(next_at[0])
                        next_at[0] = max(next_at[0] + batch / rate, trio.current_time())
                        first = b * batch + 1
                        waits.append(
                            (
                                b,
                                q.start_put_many(
                                    list(range(first, first + batch)), first_seq=first
                                ),
                            )
                        )
                    while waits:
                        await finish()
            except (ConnectError, ConnectionLost, RpcError, OSError) as exc:
                log.info("chain producer: %s: %s (reconnecting)", type(exc).__name__, exc)
                await trio.sleep(0.05)
        producer_done.set()

    async def consumer() -> None:
        while True:
            try:
                async with (
                    connect(topo.address("b"), "chain-consumer") as bus,
                    bus.queue(to_queue).consume(consumer_window) as msgs,
                ):
                    rep.consumer_sessions += 1
                    session = rep.consumer_sessions
                    async for m in msgs:
                        body = int(m.body)
                        if body not in seen:
                            first_session[body] = session
                        elif first_session[body] == session:
                            rep.duplicates += 1
                        else:
                            rep.redelivered_after_loss += 1
                        seen[body] += 1
                        await m.ack()
            except (ConnectError, ConnectionLost, RpcError, OSError) as exc:
                log.info("chain consumer: %s: %s (reconnecting)", type(exc).__name__, exc)
                await trio.sleep(0.05)

    async def strike(f: ChainFault) -> None:
        if f.action in ("kill-a", "kill-b"):
            broker = f.action[-1]
            if broker == "a":
                st = await _a_stats(topo, from_queue)
                if st is not None:
                    a_runs.append(st)
            await topo.signal(broker, signal.SIGKILL)
            await trio.sleep(f.duration)
            await topo.restart(broker)
        elif f.action == "kill-link":
            await topo.signal("link", signal.SIGKILL)
        elif f.action == "cut-net":
            await topo.cut(True)
            await trio.sleep(f.duration)
            await topo.cut(False)
        else:
            target = "link" if f.action == "stop-link" else "b"
            await topo.signal(target, signal.SIGSTOP)
            await trio.sleep(f.duration)
            await topo.signal(target, signal.SIGCONT)
        rep.faults.append(f"{f.action}@{len(acked_batches)}/{batches}")

    async def faults_task() -> None:
        since = 0
        for i, f in enumerate(sorted(faults, key=lambda f: f.at)):
            point = int(f.at * batches)
            while True:
                if len(acked_batches) >= max(point, since + 1):
                    break
                if producer_done.is_set():
                    return  # the stream ended first: reported, the caller may assert
                await trio.sleep(0.005)
            if i == 0:
                st = await _a_stats(topo, from_queue)
                if st is not None:
                    rep.healthy_put, rep.healthy_stored = st["put"], st["stored"]
            await strike(f)
            since = len(acked_batches)

    with trio.fail_after(timeout):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            nursery.start_soon(producer)
            await faults_task()
            await producer_done.wait()
            acked = {s for b in acked_batches for s in range(b * batch + 1, (b + 1) * batch + 1)}
            with trio.move_on_after(settle_timeout):
                while True:
                    if acked <= seen.keys():
                        break
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    st = await _a_stats(topo, from_queue)
    if st is not None:
        a_runs.append(st)
    rep.a_put = sum(s["put"] for s in a_runs)
    rep.a_stored = sum(s["stored"] for s in a_runs)
    rep.a_skipped = sum(s["writes_skipped"] for s in a_runs)
    rep.acked = len(acked)
    rep.received = len(seen)
    rep.missing = sorted(acked - seen.keys())
    rep.link = await _link_status(topo)
    rep.elapsed = trio.current_time() - began
    return rep
