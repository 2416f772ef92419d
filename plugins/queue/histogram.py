"""Fixed-bucket histograms the queue engine keeps for its metrics endpoint (metrics.py).

Apart from metrics.py, which reads the engine, so that the engine (tasks.py) can keep one
without importing the module that renders it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["COMMIT_BUCKETS", "Histogram"]

#: Upper bounds (seconds) of the commit latency buckets: an fsync on an SSD takes
#: 0.5-5 ms, on a disk 10-50 ms; a full commit of 10,000 messages tens of ms. Beyond a
#: second the store is in trouble; the exact figure matters less.
COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Observations in fixed buckets (Prometheus ``le`` semantics: bucket ``i`` counts
    values ``<= bounds[i]``; the last, implicit one is ``+Inf``)."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: Sequence[float] = COMMIT_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, not cumulative
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1
