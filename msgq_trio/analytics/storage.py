"""Where an analysis reads and writes: URIs handed to Spark unchanged, local paths made
absolute ``file://`` URIs, and small files (the HTML report, summary.json) written
through Spark's own Hadoop file system layer, so ``hdfs://`` and ``s3a://`` outputs work
like local ones.

No ``pathlib`` touches a URI: only a string without a scheme is a local path.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: ``scheme:`` at the start of a URI (RFC 3986); one letter would be a Windows drive.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")


def is_uri(location: str) -> bool:
    """True for ``scheme:...`` (``hdfs://nn/x``, ``file:///x``, ``s3a://b/k``)."""
    return _SCHEME.match(location) is not None


def is_local(location: str) -> bool:
    """A plain path or a ``file:`` URI: something this process can list itself."""
    return not is_uri(location) or location.startswith("file:")


def local_path(location: str) -> str:
    """The file system path of a local ``location`` (``file:///x`` -> ``/x``)."""
    if location.startswith("file://"):
        return location[len("file://") :] or "/"
    if location.startswith("file:"):
        return location[len("file:") :]
    return location


def to_uri(location: str) -> str:
    """``location`` as Spark gets it: a URI unchanged, a local path as an absolute
    ``file://`` URI (executors of a cluster do not share the driver's working
    directory)."""
    if is_uri(location):
        return location
    return Path(location).absolute().as_uri()


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a URI or a path (no normalisation: ``hdfs://nn`` stays)."""
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def expand_inputs(
    locations: Iterable[str | os.PathLike[str]], pattern: str = "*.jsonl"
) -> list[str]:
    """The inputs named by ``locations`` as URIs for Spark.

    A local directory stands for its ``pattern`` files, a local glob for its matches
    (sorted); a local location that names nothing raises FileNotFoundError (the caller's
    mistake, said before Spark starts). Other URIs (``hdfs://``, ``s3a://``...) are
    passed on unchanged: Spark lists them (a directory's ``pattern`` files, see
    :func:`msgq_trio.analytics.capture.read_capture`).
    """
    out: list[str] = []
    for loc in map(str, locations):
        if not is_local(loc):
            out.append(loc)
            continue
        p = local_path(loc)
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(glob.escape(p), pattern)))
        elif any(c in p for c in "*?["):
            found = sorted(glob.glob(p))
        else:
            found = [p] if os.path.exists(p) else []
        if not found:
            raise FileNotFoundError(f"no {pattern} files at {loc}")
        out.extend(Path(f).resolve().as_uri() for f in found)
    return out


def write_bytes(spark: SparkSession, uri: str, data: bytes) -> None:
    """Write ``data`` to ``uri``, replacing it.

    A local location is written to a temporary name and renamed over the old file, so a
    reader (a browser refreshing the live dashboard) never sees half a file. Any other
    goes through the Hadoop FileSystem of Spark's configuration: the same layer,
    credentials and ``--conf spark.hadoop.*`` settings as the tables (raises the JVM's
    error when it refuses).
    """
    if is_local(uri):
        path = local_path(uri)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    hpath = jvm.org.apache.hadoop.fs.Path(uri)
    fs = hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    stream = fs.create(hpath, True)
    try:
        stream.write(bytearray(data))
    finally:
        stream.close()


def write_text(spark: SparkSession, uri: str, text: str) -> None:
    """:func:`write_bytes` of ``text`` in UTF-8."""
    write_bytes(spark, uri, text.encode())


def prepare_output(spark: SparkSession, out: str) -> None:
    """Create ``out`` through Spark's file system layer before any work, so a location
    Spark cannot write fails at once, not after the analysis."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    path = jvm.org.apache.hadoop.fs.Path(out)
    path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).mkdirs(path)
