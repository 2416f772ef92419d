"""Analytics on Spark: traffic captures and scenario results into reports.

``msgq-trio analyze capture LOCATION... --out OUT``, ``msgq-trio analyze scenarios
LOCATION... --out OUT`` and ``msgq-trio analyze live DIR --out OUT``
(docs/ANALYTICS.md). Everything here needs the optional extra ``msgq-trio[spark]``
(pyspark, pyarrow, matplotlib) and a Java runtime; nothing else in msgq_trio imports this
package, so the bus itself never needs them. Importing this package does not import
pyspark: :func:`msgq_trio.analytics.session.spark_session` does, and raises
:class:`SparkUnavailable` with what to install when it is missing.
"""

from __future__ import annotations


class SparkUnavailable(RuntimeError):
    """pyspark (the ``spark`` extra) or Java is missing; the message says what to install."""
