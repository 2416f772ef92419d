"""Fixtures of the analytics tests: one SparkSession for the whole session (its JVM
takes several seconds to start), ``local[*]``: the master a user gets by default, whose
figures the local-cluster test compares against.

Every JVM these tests start (the session's driver here, and the drivers of the
``spark-submit`` and ``analyze live`` children, which inherit the environment) runs
with the client JIT only and the serial collector (``TEST_JVM_OPTIONS``): each
analysis here is a few seconds of small jobs, over before the optimising compiler's
work pays back, and on a machine with two cores its compiler and collector threads
took CPU from the test's own work (the JVM's CPU time per analysis about halves). The
options change how fast the JVM runs, not what Spark computes; the local-cluster test's
executors get them through ``spark.executor.extraJavaOptions``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from analytics_helpers import TEST_JVM_OPTIONS

# spark-submit (which pyspark also runs to start a local driver) adds $SPARK_SUBMIT_OPTS
# to the driver JVM's command line, beside spark.driver.extraJavaOptions (which the
# package sets for its log4j configuration, so the options cannot go there). A value
# the user set is kept.
os.environ.setdefault("SPARK_SUBMIT_OPTS", TEST_JVM_OPTIONS)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A local[*] SparkSession (msgq_trio.analytics.session), stopped at the end."""
    from msgq_trio.analytics.session import spark_session

    s = spark_session("local[*]", app_name="msgq-trio tests", shuffle_partitions=4)
    yield s
    s.stop()
