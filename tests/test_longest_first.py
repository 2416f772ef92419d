"""The file order of ``-n N --dist loadfile`` (tests/longest_first.py): the longest
recorded file is handed out first, files without a record by their test count, and the
analytics files sharing a SparkSession go to one worker as one unit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("xdist")

from longest_first import COSTS_FILE, LongestFirstScheduling, load_costs, unit_of


class FakeNode:
    """What the scheduler uses of a worker: it records the tests it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway = type("Gateway", (), {"id": name})()
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent += indexes

    def shutdown(self) -> None:
        self.shutting_down = True


class TwoWorkers:
    """The options the scheduler reads: ``-n 2`` (two local workers), file order kept."""

    class option:
        loadscopereorder = True

    def getvalue(self, name: str) -> Any:
        return {"tx": ["2*popen"], "dist": "loadfile"}[name]


def hand_out(collection: list[str], costs: dict[str, float]) -> list[str]:
    """The units in the order two workers are given them, until the queue is empty."""
    sched = LongestFirstScheduling(TwoWorkers())
    sched.costs = costs
    nodes = [FakeNode("gw0"), FakeNode("gw1")]
    for n in nodes:
        sched.add_node(n)
        sched.add_node_collection(n, collection)
    order: list[str] = []
    real_assign = LongestFirstScheduling._assign_work_unit

    def assign(self: LongestFirstScheduling, node: Any) -> None:
        before = set(self.workqueue)
        real_assign(self, node)
        order.extend(before - set(self.workqueue))

    sched._assign_work_unit = assign.__get__(sched)  # type: ignore[method-assign]
    sched.schedule()
    while sched.workqueue:
        sched._assign_work_unit(nodes[len(order) % 2])
    return order


def test_longest_recorded_first_then_by_count() -> None:
    collection = [
        *(f"tests/core/test_many.py::test_{i}" for i in range(50)),
        "tests/e2e/test_one_slow.py::test_it",
        *(f"tests/e2e/test_new.py::test_{i}" for i in range(3)),
        *(f"tests/ops/test_mid.py::test_{i}" for i in range(10)),
    ]
    costs = {"tests/core/test_many.py": 5.0, "tests/e2e/test_one_slow.py": 60.0}
    order = hand_out(collection, costs)
    # 60 s recorded, then 10 unrecorded tests (10 s), then 5 s recorded, then 3 unrecorded
    assert order == [
        "tests/e2e/test_one_slow.py",
        "tests/ops/test_mid.py",
        "tests/core/test_many.py",
        "tests/e2e/test_new.py",
    ]


def test_spark_files_are_one_unit_but_not_the_live_one() -> None:
    assert unit_of("tests/analytics/test_cluster.py::test_x") == "tests/analytics"
    assert unit_of("tests/analytics/test_restart.py::T::test_y[1]") == "tests/analytics"
    assert unit_of("tests/analytics/test_live.py::test_z") == "tests/analytics/test_live.py"
    assert unit_of("tests/core/test_router.py::test_a") == "tests/core/test_router.py"


def test_recorded_costs_are_readable(tmp_path: Path) -> None:
    """The shipped record parses to seconds; a broken one only loses the order."""
    assert load_costs(COSTS_FILE), f"{COSTS_FILE} is missing or empty"
    assert all(v >= 0 for v in load_costs(COSTS_FILE).values())
    bad = tmp_path / "costs.json"
    bad.write_text("{not json")
    assert load_costs(bad) == {}
    bad.write_text(json.dumps({"a.py": "x", "b.py": 2}))
    assert load_costs(bad) == {"b.py": 2.0}
