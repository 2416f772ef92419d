"""The SparkSession of an analysis: local mode by default, any master URL on request.

pyspark is imported lazily, so ``msgq_trio.analytics`` can be imported (and its command
line parsed) without it; :func:`spark_session` raises :class:`SparkUnavailable` naming
the extra and Java when either is missing.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from . import SparkUnavailable

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

INSTALL_HINT = (
    "msgq-trio analyze needs the 'spark' extra and a Java runtime (11+): "
    "pip install 'msgq-trio[spark]' (from a checkout: pip install -e '.[spark]') and, on "
    "Debian, apt-get install openjdk-17-jre-headless"
)

#: log4j 2 configuration of the driver JVM: errors only, so the terminal shows our
#: progress and summary, not Spark's start-up warnings (hostname, native-hadoop...).
_LOG4J = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


def check_requirements() -> None:
    """Raise :class:`SparkUnavailable` unless pyspark, pyarrow and ``java`` are there."""
    missing = []
    for mod in ("pyspark", "pyarrow"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise SparkUnavailable(f"{', '.join(missing)} not installed. {INSTALL_HINT}")
    java_home = os.environ.get("JAVA_HOME")
    if not (java_home and Path(java_home, "bin", "java").exists()) and not shutil.which("java"):
        raise SparkUnavailable(f"no 'java' on PATH and no JAVA_HOME. {INSTALL_HINT}")


def spark_session(master: str | None = None, app_name: str = "msgq-trio analyze",
                  shuffle_partitions: int | None = None) -> SparkSession:
    """A SparkSession for ``master`` (default: ``$MSGQ_TRIO_SPARK_MASTER`` or
    ``local[*]``); under spark-submit the master it was given is kept.

    Sets PYSPARK_PYTHON to this interpreter when unset (executors must run the same
    Python as the driver), quiets the JVM's logging to errors and turns off Spark's own
    console progress bar (the command line prints its own). Local mode binds the driver
    to 127.0.0.1: it needs no network. Reuses a session already running in this process.
    """
    check_requirements()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    master = master or os.environ.get("MSGQ_TRIO_SPARK_MASTER") or None
    # spark-submit starts the JVM first and hands pyspark its gateway: its --master wins
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    builder = SparkSession.builder.appName(app_name)
    if not under_submit:
        master = master or "local[*]"
    if master:
        builder = builder.master(master)
    log4j = Path(tempfile.gettempdir(), "msgq-trio-spark-log4j2.properties")
    if not log4j.exists() or log4j.read_text() != _LOG4J:
        log4j.write_text(_LOG4J)
    builder = (
        builder.config("spark.ui.showConsoleProgress", "false")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={log4j}")
        # the report's tables are small aggregates: few shuffle partitions are faster
        # locally; a cluster run can override it with --conf / spark-defaults.
        .config("spark.sql.shuffle.partitions",
                str(shuffle_partitions or (8 if (master or "").startswith("local") else 200)))
        .config("spark.sql.session.timeZone", "UTC")
    )
    if master and master.startswith("local"):
        builder = builder.config("spark.driver.host", "127.0.0.1").config(
            "spark.driver.bindAddress", "127.0.0.1")
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # the JVM did not start: usually Java itself
        raise SparkUnavailable(f"Spark did not start ({exc}). {INSTALL_HINT}") from exc
    spark.sparkContext.setLogLevel("ERROR")
    return spark

