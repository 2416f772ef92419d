"""Analytics on Spark: traffic captures and scenario results into reports.

``msgq-trio analyze capture PATH... --out DIR`` and ``msgq-trio analyze scenarios PATH...
--out DIR`` (docs/ANALYTICS.md). Everything here needs the optional extra
``msgq-trio[spark]`` (pyspark, pyarrow) and a Java runtime; nothing else in msgq_trio
imports this package, so the bus itself never needs them. Importing this package does not
import pyspark: :func:`msgq_trio.analytics.session.spark_session` does, and raises
:class:`SparkUnavailable` with what to install when it is missing.
"""

from __future__ import annotations


class SparkUnavailable(RuntimeError):
    """pyspark (the ``spark`` extra) or Java is missing; the message says what to install."""
