"""The queue plugin's Prometheus endpoint (opt-in ``metrics = "HOST:PORT"``).

The plugin process serves it itself, like the link plugin: the broker's endpoint
(``serve --metrics``) runs in the broker process, which cannot see a plugin's queues.
Every figure comes from what the engine already counts (``Engine.stats``,
``Engine.counters``); this module adds only two things the engine does not keep:

* :class:`Histogram`: the latency of each store commit (the engine observes it in
  ``flush_loop``; it exists whether the endpoint is on or not, one bisect per commit);
* :class:`AgeTracker`: the approximate age of each queue's oldest message. A message
  carries no arrival time (``Msg`` has none, the store keeps none), so the tracker
  samples each queue's next store seq once per :data:`SAMPLE_PERIOD`: the oldest live
  stored message's seq then says, to within one period, since when it has been stored.
  Messages stored before this plugin process started count from its start.

Everything here runs on the trio thread except the sampler's one job per period on the
store thread (``QueueStore.stats`` of every queue and, for a queue paging its backlog,
a one-message ``read_range``: short calls, no transaction left open).
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import trio
from msgq_trio.storage.api import QueueStore, StorageError

from msgq_trio.exposition import Exposition

from .histogram import COMMIT_BUCKETS, Histogram

if TYPE_CHECKING:
    from .model import Queue
    from .tasks import Engine

__all__ = ["COMMIT_BUCKETS", "SAMPLE_PERIOD", "AgeTracker", "Histogram", "render_metrics"]

log = logging.getLogger("msgq_trio.plugins.queue")

#: How often the oldest-message tracker reads the queues' next seqs (its resolution).
SAMPLE_PERIOD = 1.0
#: Samples kept per queue between scrapes; past it the older half is thinned (an age
#: then errs on the old side, never the young one).
MAX_SAMPLES = 2048


def _probe(
    store: QueueStore, names: list[str], paged: dict[str, int]
) -> dict[str, tuple[int, int]]:
    """On the store thread: per queue its next seq and, for the queues in ``paged``
    (name -> ``disk_next``), the lowest seq stored at or above that (the next seq if
    none): one metadata read each, one single-message read per paged queue."""
    out: dict[str, tuple[int, int]] = {}
    for name in names:
        try:
            n = store.stats(name).next_seq
            first = n
            if name in paged:
                page = store.read_range(name, paged[name], 1)
                first = page[0].seq if page else n
        except StorageError:
            continue  # a store failure is logged by the commits; age stays as it was
        out[name] = (n, first)
    return out


class AgeTracker:
    """Approximate age of the oldest message of each queue (see the module docstring).

    Per queue it keeps samples ``(n, t)``: every message with seq >= ``n`` was stored
    after trio time ``t``. The oldest live stored message is the one with the lowest seq
    (seqs grow with each store; page-ins and redeliveries keep seqs): the lowest seq in
    memory or, for a paging queue, where its disk-only messages begin (seen by the last
    sample). Its age is ``now - t`` of the last sample with ``n <= seq``: between the
    time since it was stored and that plus one period (while the sampler keeps its
    pace); the wait before its commit (ack grace, a commit: milliseconds) is not
    counted. Messages stored before the plugin started count from its start; a queue
    whose messages all wait for their commit counts as 0.

    Args:
        engine: the engine whose queues are tracked.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.started = trio.current_time()
        #: name -> sample seqs (increasing) and their times
        self._seqs: dict[str, list[int]] = {}
        self._times: dict[str, list[float]] = {}
        #: name -> the next seq when the plugin started (lower seqs: recovered messages)
        self._recovered: dict[str, int] = {}
        #: name -> lowest stored seq at or above ``disk_next`` at the last sample (paged
        #: queues): where the messages only on disk begin
        self._first_on_disk: dict[str, int] = {}
        self._last_sample: float | None = None

    async def sample(self) -> None:
        """Read every queue's next seq once (the first call marks what was recovered)."""
        queues = self.engine.queues
        names = list(queues)
        paged = {name: q.disk_next for name, q in queues.items() if q.spilled}
        # The time before the read: a seq at or above the one read was stored after it.
        before = trio.current_time()
        probed = await self.engine.thread.run(_probe, self.engine.store, names, paged)
        first = self._last_sample is None
        self._first_on_disk = {name: f for name, (_n, f) in probed.items() if name in paged}
        for name, (n, _f) in probed.items():
            seqs, times = self._seqs.get(name), self._times.get(name)
            if seqs is None or times is None:
                seqs = self._seqs[name] = []
                times = self._times[name] = []
                if first:
                    self._recovered[name] = n
                elif self._last_sample is not None:
                    # Declared since the previous sample: all its messages are younger.
                    seqs.append(1)
                    times.append(self._last_sample)
            if seqs and seqs[-1] == n:
                times[-1] = before  # nothing stored since: the bound moves forward
            else:
                seqs.append(n)
                times.append(before)
                if len(seqs) > MAX_SAMPLES:
                    half = len(seqs) // 2
                    seqs[:half] = seqs[:half:2]
                    times[:half] = times[:half:2]
        self._last_sample = before

    async def run(self) -> None:
        """Sample forever, once per :data:`SAMPLE_PERIOD`."""
        while True:
            await trio.sleep(SAMPLE_PERIOD)
            await self.sample()

    def oldest_age(self, q: Queue, now: float) -> float:
        """Seconds since the oldest live stored message of ``q`` was stored (0 for an
        empty queue or one whose messages all wait for their commit). Drops the samples
        no later call needs (the lowest live seq never decreases)."""
        if q.live <= 0:
            return 0.0
        lowest = min(q.mem) if q.mem else None
        if q.spilled:
            # Messages only on disk have seqs >= disk_next (paging reads in seq order);
            # the last sample saw where they begin (a page-in since then only raised it).
            disk = max(q.disk_next, self._first_on_disk.get(q.name, q.disk_next))
            lowest = disk if lowest is None else min(lowest, disk)
        if lowest is None:
            return 0.0
        if lowest < self._recovered.get(q.name, 0):
            return max(0.0, now - self.started)
        seqs, times = self._seqs.get(q.name), self._times.get(q.name)
        if not seqs or not times:
            # Declared since the last sample: everything in it is younger than that.
            since = self.started if self._last_sample is None else self._last_sample
            return max(0.0, now - since)
        i = bisect.bisect_right(seqs, lowest) - 1
        if i < 0:
            return max(0.0, now - self.started)
        del seqs[:i], times[:i]
        return max(0.0, now - times[0])


def render_metrics(engine: Engine, ages: AgeTracker, now: float | None = None) -> str:
    """The engine's queues as Prometheus text (format 0.0.4): one sample per queue per
    family (label ``queue``), then the plugin-wide store figures. Counters count since
    the plugin process started. The result carries its families, so the endpoint
    (``msgq_trio.exposition.MetricsServer``) also answers in OpenMetrics and adds the
    plugin process's ``process_*`` families."""
    now = trio.current_time() if now is None else now
    queues = sorted(engine.queues.values(), key=lambda q: q.name)
    stats = [(q, engine.stats(q)) for q in queues]
    ex = Exposition()

    def per_queue(name: str, mtype: str, help_text: str, key: str) -> None:
        ex.family(name, mtype, help_text, [({"queue": q.name}, s[key]) for q, s in stats])

    per_queue("msgq_queue_depth", "gauge", "messages held (ready, in flight, waiting)", "depth")
    per_queue("msgq_queue_bytes", "gauge", "bytes of the messages held", "bytes")
    per_queue("msgq_queue_ready", "gauge", "messages waiting for a delivery", "ready")
    per_queue("msgq_queue_in_flight", "gauge", "messages delivered and not yet acked", "in_flight")
    per_queue(
        "msgq_queue_consumers", "gauge", "push consumers and bound-group members", "consumers"
    )
    per_queue(
        "msgq_queue_resident",
        "gauge",
        "messages held in the plugin's memory (the rest is only on disk)",
        "resident",
    )
    ex.family(
        "msgq_queue_oldest_age_seconds",
        "gauge",
        "approximate seconds since the oldest message was stored (messages stored "
        "before the plugin started: since its start)",
        [({"queue": q.name}, ages.oldest_age(q, now)) for q in queues],
    )
    per_queue(
        "msgq_queue_redelivered", "counter", "deliveries that were redeliveries", "redelivered"
    )
    per_queue(
        "msgq_queue_dead_lettered",
        "counter",
        "messages moved to the dead-letter queue",
        "dead_lettered",
    )
    per_queue(
        "msgq_queue_writes_skipped",
        "counter",
        "messages acked before they were written (never stored)",
        "writes_skipped",
    )
    per_queue("msgq_queue_paged_in", "counter", "messages read back from the store", "paged_in")
    c = engine.counters
    ex.family(
        "msgq_queue_fsyncs", "counter", "store commits that wrote (an fsync each)", c["fsyncs"]
    )
    ex.family("msgq_queue_commits", "counter", "store commits (group commits) run", c["commits"])
    h = engine.commit_seconds
    ex.histogram(
        "msgq_queue_commit_seconds",
        "seconds per store commit, from its submission to the store thread",
        h.bounds,
        h.counts,
        h.total,
    )
    return ex.text()
