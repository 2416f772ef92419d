"""Longest file first: the order in which ``-n N --dist loadfile`` hands out test files.

pytest-xdist's ``loadfile`` hands out whole files, largest test count first. A file's
count says little about its time here: one test that starts a JVM or kills a broker ten
times outlasts a file of a hundred parser checks, and such a file handed out last keeps
one worker busy while the others sit idle, setting the wall time of the whole run. This
scheduler hands out the file with the largest recorded time first (longest processing
time first, the classic greedy bound for parallel machines), so the long files run
beside the many short ones rather than after them.

Recorded times live in ``tests/file_costs.json`` ({file: seconds}, best from a quiet run;
``python3 tests/stress/file_costs.py junit.xml`` writes it from a ``--junitxml`` report).
The checked-in figures were recorded on a loaded machine, so their sum is far above a
quiet run's; only their ratios are used. Only the order depends on them: a missing,
stale or wrong entry costs time, never a test.
A file with no entry is costed by its test count.

The analytics files that share a SparkSession (tests/analytics/conftest.py: one JVM per
worker, half a minute to start on a busy machine) are one unit, so one worker starts it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadFileScheduling

COSTS_FILE = Path(__file__).with_name("file_costs.json")
#: Seconds per test for a file without a recorded time (the suite's median test is far
#: shorter; a new file is rather handed out early than late).
UNKNOWN_PER_TEST_S = 1.0
#: Files run together on one worker: (directory prefix, files in it that stay apart).
SHARED_SETUP_GROUPS = (("tests/analytics/", ("tests/analytics/test_live.py",)),)


def load_costs(path: Path = COSTS_FILE) -> dict[str, float]:
    """{file or unit: seconds}; empty when the file is missing or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, int | float)}


def unit_of(nodeid: str) -> str:
    """The work unit of a test id: its file, or the shared-setup group it belongs to."""
    path = nodeid.split("::", 1)[0]
    for prefix, apart in SHARED_SETUP_GROUPS:
        if path.startswith(prefix) and path not in apart:
            return prefix.rstrip("/")
    return path


class LongestFirstScheduling(LoadFileScheduling):  # type: ignore[misc]
    """``loadfile`` with work units (files, shared-setup groups) handed out longest
    recorded time first."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.costs = load_costs()

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _cost(self, unit: str) -> float:
        recorded = self.costs.get(unit)
        if recorded is not None:
            return recorded
        return UNKNOWN_PER_TEST_S * len(self.workqueue[unit])

    def _assign_work_unit(self, node: Any) -> None:
        longest = max(self.workqueue, key=self._cost)
        self.workqueue.move_to_end(longest, last=False)
        super()._assign_work_unit(node)
