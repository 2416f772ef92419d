"""A Spark streaming source (Python Data Source API) that tails a capture directory while
the broker writes it: rotating ``<prefix>-NNNNNN.jsonl`` files that grow line by line.

Spark's own file source reads each file once, when it first sees it, so it would miss
what the broker appends to the file it is writing. This source's offset is instead, per
file name, the length of the file's complete lines; a micro-batch reads the byte range
each file grew by. A file the broker rotated away (``max_files``) before it was read is
skipped (its remaining records are lost to the dashboard, as to any reader); names are
never reused (the numbering only increases), so a name identifies its bytes.

Imports pyspark at module level: import it only where Spark is running
(:mod:`msgq_trio.analytics.live` does).
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit

#: Name the source is registered under (``spark.readStream.format(SOURCE_NAME)``).
SOURCE_NAME = "msgq_capture"

#: The record fields the live figures use, in Spark DDL (docs/CAPTURE.md). ``body`` is
#: the record's body as JSON text (a captured membership event's reason).
SCHEMA = (
    "ts double, seq long, kind string, sender string, sender_name string, "
    "on_behalf_of string, target string, request_id long, reply_to long, `all` boolean, "
    "size long, outcome string, recipients long, command string, event string, "
    "code string, body string, dropped long, broker_instance string, "
    "broker_started double"
)
_FIELDS = [f.strip().split(" ")[0].strip("`") for f in SCHEMA.split(",")]
_FLOATS = {"ts", "broker_started"}
_INTS = {"seq", "request_id", "reply_to", "size", "recipients", "dropped"}
#: Bytes read backwards at a time to find a file's last newline.
_TAIL_CHUNK = 64 * 1024


def complete_length(path: str) -> int:
    """The length of ``path`` up to and including its last newline (0 if none, or if the
    file is gone): the part a reader may take, the rest is a line being written."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            pos = end
            while pos > 0:
                start = max(0, pos - _TAIL_CHUNK)
                f.seek(start)
                chunk = f.read(pos - start)
                i = chunk.rfind(b"\n")
                if i >= 0:
                    return start + i + 1
                pos = start
    except FileNotFoundError:
        pass
    return 0


def _value(name: str, v: Any) -> Any:
    if v is None:
        return None
    if name in _FLOATS:
        return float(v) if isinstance(v, int | float) else None
    if name in _INTS:
        return int(v) if isinstance(v, int | float) else None  # a bool is an int too
    if name == "all":
        return bool(v)
    if name == "body":
        return v if isinstance(v, str) else json.dumps(v)
    return v if isinstance(v, str) else str(v)


def parse_lines(data: bytes) -> Iterator[tuple[Any, ...]]:
    """The rows of the JSON lines in ``data`` in :data:`SCHEMA` order; a line that is not
    a JSON object (a damaged file) is skipped."""
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") is not None:
            yield tuple(_value(n, rec.get(n)) for n in _FIELDS)


class FileRange(InputPartition):
    """Bytes ``[start, end)`` of one capture file: one task of a micro-batch."""

    def __init__(self, path: str, start: int, end: int) -> None:
        super().__init__(path)
        self.path, self.start, self.end = path, start, end


class CaptureStreamReader(DataSourceStreamReader):
    """Offsets ``{"files": {name: complete length}}``; see the module docstring."""

    def __init__(self, directory: str, pattern: str, start_at: str) -> None:
        self.directory = directory
        self.pattern = pattern
        self.start_at = start_at

    def initialOffset(self) -> dict[str, Any]:
        # "latest": what is on disk when the query starts is not read
        return self._scan() if self.start_at == "latest" else {"files": {}}

    def latestOffset(self, start: dict[Any, Any], limit: ReadLimit) -> dict[Any, Any]:
        """Everything written so far (no read limit: a batch takes all complete lines)."""
        return self._scan()

    def _scan(self) -> dict[str, Any]:
        files: dict[str, int] = {}
        for name in sorted(os.listdir(self.directory)):
            if fnmatch.fnmatch(name, self.pattern):
                files[name] = complete_length(os.path.join(self.directory, name))
        return {"files": files}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        done = start.get("files", {})
        return [
            FileRange(os.path.join(self.directory, name), done.get(name, 0), length)
            for name, length in sorted(end["files"].items())
            if length > done.get(name, 0)
        ]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, FileRange)
        try:
            f = open(partition.path, "rb")  # noqa: SIM115 (closed below; gone is normal)
        except FileNotFoundError:  # rotated away by max_files before this batch read it
            return
        with f:
            f.seek(partition.start)
            data = f.read(partition.end - partition.start)
        yield from parse_lines(data)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to release: the broker owns the files and their rotation."""


class CaptureSource(DataSource):
    """``spark.readStream.format("msgq_capture").option("path", DIR)``; options
    ``pattern`` (default ``*.jsonl``) and ``start`` (``earliest``: every record already
    in DIR, the default; ``latest``: only what is written after the query starts)."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return SCHEMA

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        path = self.options.get("path")
        if not path:
            raise ValueError(
                "msgq_capture source: option 'path' (the capture directory) is required"
            )
        start = self.options.get("start", "earliest")
        if start not in ("earliest", "latest"):
            raise ValueError(
                f"msgq_capture source: start must be earliest or latest, got {start!r}"
            )
        return CaptureStreamReader(path, self.options.get("pattern", "*.jsonl"), start)
