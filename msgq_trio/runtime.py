"""Process-wide tuning of msgq_trio's own daemons: the broker (``msgq-trio serve``) and
the plugin processes it supervises. Never applied by the client library: an
application's process is its own to tune.

The one setting is the threshold of the youngest generation of CPython's cyclic garbage
collector (``gc_threshold`` in the broker's configuration; docs/CONFIG.md). A daemon
holds thousands of young objects at once in a burst (a queue's pending messages, a
batch of frames), and with CPython's default of 700 each collection of the youngest
generation walks them and promotes them, which in turn brings on full collections of
the whole heap. Nothing here disables the collector: cycles are still found, after more
allocations.
"""

from __future__ import annotations

import gc
import os

#: How the broker hands its ``gc_threshold`` to the plugin processes it starts.
GC_THRESHOLD_ENV = "MSGQ_TRIO_GC_THRESHOLD"

#: The default ``gc_threshold``: a daemon holds thousands of young objects at once in a
#: burst (a queue's pending messages); with CPython's 700 each young collection walks and
#: promotes them, which brings on full collections of the whole heap, while at 10,000 a
#: burst dies before it is walked (BENCHMARKS.md, "The collector").
DEFAULT_GC_THRESHOLD = 10_000


def tune_collector(threshold: int) -> None:
    """Set the youngest generation's collection threshold to ``threshold`` allocations;
    0 leaves the interpreter's own. The older generations' thresholds are kept.

    Raises:
        ValueError: ``threshold`` is negative.
    """
    if threshold < 0:
        raise ValueError(f"gc_threshold must be >= 0, got {threshold}")
    if threshold:
        _young, older, oldest = gc.get_threshold()
        gc.set_threshold(threshold, older, oldest)


def threshold_from_env() -> int:
    """The threshold the broker passed in :data:`GC_THRESHOLD_ENV`, else the default.

    Raises:
        ValueError: the variable is set but not a non-negative integer (the broker
            always sets a valid one; someone else set it wrong).
    """
    raw = os.environ.get(GC_THRESHOLD_ENV)
    if raw is None:
        return DEFAULT_GC_THRESHOLD
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{GC_THRESHOLD_ENV}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{GC_THRESHOLD_ENV}={raw!r} is negative")
    return value
