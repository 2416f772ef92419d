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
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
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


def spark_session(
    master: str | None = None,
    app_name: str = "msgq-trio analyze",
    shuffle_partitions: int | None = None,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A SparkSession for ``master`` (default: ``$MSGQ_TRIO_SPARK_MASTER`` or
    ``local[*]``); under spark-submit the master it was given is kept. ``conf``: Spark
    settings (``--conf KEY=VALUE``), applied last so they override ours.

    Sets PYSPARK_PYTHON to this interpreter when unset (executors must run the same
    Python as the driver), quiets the JVM's logging to errors and turns off Spark's own
    console progress bar (the command line prints its own). Local mode (``local[N]``,
    ``local-cluster[...]``) binds the driver to 127.0.0.1: it needs no network. Reuses a
    session already running in this process (``conf`` is then not applied).
    """
    check_requirements()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if SparkContext._active_spark_context is not None:  # running, made in another thread
        return SparkSession.builder.getOrCreate()
    master = master or os.environ.get("MSGQ_TRIO_SPARK_MASTER") or None
    # spark-submit starts the JVM first and hands pyspark its gateway: its --master and
    # --conf settings (and spark-defaults.conf) win over our defaults below
    given: dict[str, str] = {}
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        from pyspark import SparkConf

        SparkContext._ensure_initialized()  # joins spark-submit's JVM: its settings
        given = dict(SparkConf().getAll())
    else:
        master = master or "local[*]"
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    effective = master or given.get("spark.master", "")
    log4j = Path(tempfile.gettempdir(), "msgq-trio-spark-log4j2.properties")
    if not log4j.exists() or log4j.read_text() != _LOG4J:
        log4j.write_text(_LOG4J)
    ours = {
        "spark.ui.showConsoleProgress": "false",
        "spark.ui.enabled": "false",
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile={log4j}",
        # the report's tables are aggregates: few shuffle partitions are faster on one
        # machine (local[N], local-cluster[...]); a cluster keeps Spark's default
        "spark.sql.shuffle.partitions": str(
            shuffle_partitions or (8 if effective.startswith("local") else 200)
        ),
        "spark.sql.session.timeZone": "UTC",
    }
    if effective.startswith("local"):
        ours["spark.driver.host"] = "127.0.0.1"
        ours["spark.driver.bindAddress"] = "127.0.0.1"
    for key, value in ours.items():
        if key not in given:
            builder = builder.config(key, value)
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # the JVM did not start: usually Java itself
        raise SparkUnavailable(f"Spark did not start ({exc}). {INSTALL_HINT}") from exc
    spark.sparkContext.setLogLevel("ERROR")
    return spark


@contextmanager
def analysis_session(
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
    app_name: str = "msgq-trio analyze",
) -> Iterator[SparkSession]:
    """:func:`spark_session` for one command, stopped when the block ends however it ends
    (an unstopped session leaves a cluster's executors to be relaunched and logs errors
    at exit). A session that was already running in this process is reused and left
    running: its owner stops it."""
    check_requirements()
    from pyspark import SparkContext

    # the context, not SparkSession.getActiveSession(): that one is per thread
    existing = SparkContext._active_spark_context
    spark = spark_session(master, app_name=app_name, conf=conf)
    try:
        yield spark
    finally:
        if existing is None:
            spark.stop()


def spark_error(exc: BaseException) -> str | None:
    """The first line of a JVM-side error (py4j or Spark's own), or None when ``exc``
    is not one (a bug of ours: let it propagate)."""
    names = {c.__name__ for c in type(exc).__mro__}
    if not names & {"Py4JJavaError", "PySparkException", "CapturedException"}:
        return None
    text = str(exc).strip()
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith(("An error occurred while calling", "at ")):
            return line
    return text
