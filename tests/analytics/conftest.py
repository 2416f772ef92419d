"""Fixtures of the analytics tests: one SparkSession for the whole session (its JVM
takes several seconds to start), ``local[*]``: the master a user gets by default, whose
figures the local-cluster test compares against."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A local[*] SparkSession (msgq_trio.analytics.session), stopped at the end."""
    from msgq_trio.analytics.session import spark_session

    s = spark_session("local[*]", app_name="msgq-trio tests", shuffle_partitions=4)
    yield s
    s.stop()
