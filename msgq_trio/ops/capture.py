"""Traffic capture: the broker's tap -> bounded buffers -> rotated JSON Lines files and
live ``dump`` clients (record format: docs/CAPTURE.md).

Routing never waits for capture:

* the tap (``Broker.tap``) runs inside routing, so it only filters (kind, sender, target:
  set lookups) and appends a small tuple (header bytes, and body bytes only when a sink
  wants bodies) to each matching sink's bounded buffer. When a buffer is full the record
  is counted as dropped; the count is written into the file as a ``capture-dropped``
  record and reported in ``stats`` and the metrics.
* a trio task per sink drains its buffer: for files, decoding, JSON encoding and the
  write happen in a worker thread; for dump clients, the records go out as MESSAGE frames
  from ``l.0`` to the client's lname (skipped while that client's queue is over its soft
  limit, so a slow terminal only loses capture records).
* with no sink the broker's tap is None: capture off costs one attribute test per frame.
"""

from __future__ import annotations

import base64
import datetime
import functools
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from decimal import Decimal
from pathlib import Path
from typing import Any, NamedTuple

import attrs
import cbor2
import trio

from ..config import CAPTURE_BODY_MODES, CAPTURE_KINDS, CaptureSettings
from ..core.broker import Broker
from ..core.peers import Peer
from ..protocol.codes import Flag, FrameType
from ..protocol.framing import PREFIX, PREFIX_SIZE, Frame, Run, encode_cbor, encode_frame
from ..protocol.names import MEMBERSHIP_GROUP, is_pattern, pattern_matches, valid_pattern
from .logsetup import TRAFFIC

log = logging.getLogger("msgq_trio.capture")
traffic_log = logging.getLogger("msgq_trio.traffic")

_KIND_OF: dict[int, str] = {
    FrameType.REQUEST: "command",
    FrameType.REPLY: "answer",
    FrameType.ERROR: "error",
    FrameType.NOTIFY: "notification",
    FrameType.MESSAGE: "message",
}
_NOTIFY = FrameType.NOTIFY
_MESSAGE = int(FrameType.MESSAGE)
_BROKER_SOURCE = b"l.0\0msgq"
#: Fixed per-record cost counted against ``buffer_bytes`` besides header and body bytes.
_RECORD_OVERHEAD = 200
#: A dump client gets at most this many records per MESSAGE frame.
DUMP_BATCH = 500
#: Dump buffers are small: a terminal cannot show more, and the dump client is told.
DUMP_BUFFER_RECORDS = 10_000
DUMP_BUFFER_BYTES = 8 * 1024 * 1024
DUMP_INTERVAL = 0.1
#: Records turned into a dump frame per interval: bounds the event loop's time spent on a
#: dump, however busy the bus (a thousand records are a small share of an interval);
#: beyond that the dump buffer overflows, counted.
DUMP_PER_INTERVAL = 1000


#: Targets whose pattern answer a TrafficFilter keeps before clearing (as the router's
#: parse cache: bounded, a miss costs one match per pattern).
_FILTER_CACHE_MAX = 4096


class TrafficFilter:
    """Which frames a sink wants: a frame matches if, for each non-empty list, it matches
    one entry (kind name; sender lname or client name; target or the group of ``G[N]``).

    A ``targets`` entry may be a subscription pattern (``Zone.*``, ``Xfr.>``: the same
    syntax and rules as ``subscribe``, docs/PROTOCOL.md), matched against the target's
    group; its answers are cached per target (bounded)."""

    __slots__ = ("_patterns", "_seen", "kinds", "senders", "targets")

    def __init__(
        self, kinds: Iterable[str] = (), senders: Iterable[str] = (), targets: Iterable[str] = ()
    ) -> None:
        self.kinds = frozenset(kinds)
        bad = self.kinds - set(CAPTURE_KINDS)
        if bad:
            raise ValueError(
                f"unknown kind {sorted(bad)[0]!r}; kinds are {', '.join(CAPTURE_KINDS)}"
            )
        self.senders = frozenset(senders)
        self.targets = frozenset(targets)
        self._patterns = tuple(t for t in self.targets if is_pattern(t))
        for t in self._patterns:
            why = valid_pattern(t)
            if why:
                raise ValueError(f"target pattern {t!r}: {why}")
        self._seen: dict[str, bool] = {}

    def match(self, kind: str, lname: str, name: str, target: str) -> bool:
        if self.kinds and kind not in self.kinds:
            return False
        if self.senders and lname not in self.senders and name not in self.senders:
            return False
        if not self.targets or target in self.targets:
            return True
        base = target.partition("[")[0]
        if base in self.targets:
            return True
        if not self._patterns:
            return False
        hit = self._seen.get(base)
        if hit is None:
            hit = any(pattern_matches(p, base) for p in self._patterns)
            if len(self._seen) >= _FILTER_CACHE_MAX:
                self._seen.clear()
            self._seen[base] = hit
        return hit

    def describe(self) -> dict[str, list[str]]:
        return {
            "kinds": sorted(self.kinds),
            "senders": sorted(self.senders),
            "targets": sorted(self.targets),
        }


class Origin(NamedTuple):
    """Which broker process wrote a record: every record carries it, because lnames and
    request ids restart with each broker lifetime (``l.3``, request 1 again after a
    restart), so only (instance, lname, request id) names one request in a capture
    directory that spans restarts (docs/CAPTURE.md)."""

    #: Random per broker process (64 bits, hex): never reused, unlike pids.
    instance: str
    #: Unix time the broker's capture service started (at broker start-up).
    started: float

    @classmethod
    def new(cls) -> Origin:
        return cls(secrets.token_hex(8), round(time.time(), 6))

    def fields(self) -> str:
        """The record's two JSON members, ``"broker_instance":..,"broker_started":..``."""
        return f'"broker_instance":{json.dumps(self.instance)},"broker_started":{self.started!r}'


#: Records made without a broker (tools, tests): both fields null.
NO_ORIGIN_FIELDS = '"broker_instance":null,"broker_started":null'


class Captured(NamedTuple):
    """What the tap keeps of one frame (decoded later, outside routing)."""

    ts: float
    kind: str
    sender: str
    sender_name: str
    #: The stamped source of a broker-originated frame (an answer on a callee's behalf).
    source: bytes
    target: str
    ftype: int
    flags: int
    request_id: int
    size: int
    outcome: str
    recipients: int
    header: bytes
    body: bytes | None
    n_blobs: int
    n_fds: int


class RecordBuffer:
    """Bounded FIFO between the tap and a sink's task; overflow is counted, not blocked."""

    __slots__ = (
        "dropped",
        "dropped_total",
        "items",
        "max_bytes",
        "max_records",
        "nbytes",
        "seq",
        "wake",
    )

    def __init__(self, max_records: int, max_bytes: int) -> None:
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.items: list[tuple[int, Captured]] = []
        self.nbytes = 0
        self.dropped = 0  # not yet reported to the sink's output
        self.dropped_total = 0
        self.seq = 0
        self.wake: trio.Event | None = None

    @staticmethod
    def cost(item: Captured) -> int:
        n = _RECORD_OVERHEAD + len(item.header) + len(item.target)
        return n + len(item.body) if item.body is not None else n

    def offer(self, item: Captured) -> None:
        cost = self.cost(item)
        self.seq += 1
        if len(self.items) >= self.max_records or self.nbytes + cost > self.max_bytes:
            self.dropped += 1
            self.dropped_total += 1
            return
        self.items.append((self.seq, item))
        self.nbytes += cost
        if self.wake is not None and (
            len(self.items) * 2 >= self.max_records or self.nbytes * 2 >= self.max_bytes
        ):
            self.wake.set()

    def take(self, limit: int | None = None) -> tuple[list[tuple[int, Captured]], int]:
        """Remove and return buffered items (at most ``limit``, oldest first) and the number
        dropped since the last take."""
        dropped = self.dropped
        self.dropped = 0
        if limit is None or len(self.items) <= limit:
            items = self.items
            self.items, self.nbytes = [], 0
            return items, dropped
        items, self.items = self.items[:limit], self.items[limit:]
        self.nbytes -= sum(self.cost(c) for _, c in items)
        return items, dropped


# -- records ------------------------------------------------------------------------------
def jsonable(value: Any, depth: int = 0) -> Any:
    """A decoded CBOR value as JSON: bytes -> {"$bytes": base64}, tags -> {"$tag", "value"},
    non-finite floats -> strings, other types -> their string form."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if depth > 64:
        return "<nested too deeply>"
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {
            (k if isinstance(k, str) else json.dumps(jsonable(k, depth + 1))): jsonable(
                v, depth + 1
            )
            for k, v in value.items()
        }
    if isinstance(value, cbor2.CBORTag):
        return {"$tag": value.tag, "value": jsonable(value.value, depth + 1)}
    if isinstance(value, (datetime.datetime, datetime.date)):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    return str(value)


def _decode(data: bytes) -> Any:
    try:
        return cbor2.loads(data)
    except Exception:  # cbor2 raises several unrelated types on bad input
        return None


def make_record(
    seq: int, c: Captured, body_mode: str, origin: Origin | None = None
) -> dict[str, Any]:
    """The JSON record of one captured frame (docs/CAPTURE.md), written by the broker
    ``origin`` (None: both origin fields null)."""
    kind = c.kind
    header = _decode(c.header) if c.header else {}
    if not isinstance(header, dict):
        header = {}
    rid = c.request_id or None
    on_behalf = None
    if c.source and not c.source.startswith(b"l.0\0"):
        on_behalf = c.source.partition(b"\0")[0].decode(errors="replace")

    def text(key: str) -> str | None:
        v = header.get(key)
        return None if v is None else str(v)

    is_answer = kind == "answer" or kind == "error"
    rec: dict[str, Any] = {
        "ts": round(c.ts, 6),
        "seq": seq,
        "kind": kind,
        "sender": c.sender,
        "sender_name": c.sender_name,
        "on_behalf_of": on_behalf,
        "target": c.target,
        "request_id": rid if (kind == "command" or is_answer) else None,
        "reply_to": rid if is_answer else None,
        "all": bool(c.flags & Flag.ALL) if kind == "command" else False,
        "size": c.size,
        "attachments": c.n_blobs,
        "fds": c.n_fds,
        "outcome": c.outcome,
        "recipients": c.recipients,
        "command": text("cmd") if kind == "command" else None,
        "event": text("event") if kind == "notification" or kind == "membership" else None,
        "code": text("code") if kind == "error" else None,
        "error_message": text("message") if kind == "error" else None,
        "body": None,
        "body_encoding": None,
        "broker_instance": origin.instance if origin else None,
        "broker_started": origin.started if origin else None,
    }
    if body_mode != "none" and c.body is not None:
        if body_mode == "base64":
            rec["body"] = base64.b64encode(c.body).decode()
        else:
            rec["body"] = jsonable(_decode(c.body)) if c.body else None
        rec["body_encoding"] = body_mode
    return rec


def dropped_record(
    seq: int, dropped: int, dropped_total: int, origin: Origin | None = None
) -> dict[str, Any]:
    """Written in place of records the buffer had no room for (never silent)."""
    return {
        "ts": round(time.time(), 6),
        "seq": seq,
        "kind": "capture-dropped",
        "dropped": dropped,
        "dropped_total": dropped_total,
        "broker_instance": origin.instance if origin else None,
        "broker_started": origin.started if origin else None,
    }


def encode_line(rec: dict[str, Any], max_bytes: int) -> bytes:
    """One JSON line no longer than ``max_bytes``: a record too large loses its body (and
    then its long strings), marked ``"truncated": true``."""
    line = (json.dumps(rec, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
    if len(line) <= max_bytes:
        return line
    rec = dict(rec, body=None, truncated=True)
    line = (json.dumps(rec, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
    if len(line) <= max_bytes:
        return line
    for k in ("target", "command", "event", "code", "error_message", "sender_name"):
        if isinstance(rec.get(k), str):
            rec[k] = rec[k][:256]
    return (json.dumps(rec, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


#: JSON fragments of the fields that repeat from record to record (kind, sender, names,
#: target), so a plain message costs one dict lookup and one f-string instead of a
#: 22-key dict through json.dumps (the capture shares the broker's CPU and GIL, and a
#: capture that is on must not halve the broker's throughput). Bounded:
#: cleared when full.
_FRAGMENTS: dict[tuple[str, str, str, str | None, str, str], tuple[str, str]] = {}
_FRAGMENTS_MAX = 65_536


def _fragment(c: Captured, on_behalf: str | None) -> tuple[str, str]:
    key = (c.kind, c.sender, c.sender_name, on_behalf, c.target, c.outcome)
    frag = _FRAGMENTS.get(key)
    if frag is None:
        if len(_FRAGMENTS) >= _FRAGMENTS_MAX:
            _FRAGMENTS.clear()
        d = functools.partial(json.dumps, ensure_ascii=False)
        frag = (
            f'"kind":{d(c.kind)},"sender":{d(c.sender)},"sender_name":{d(c.sender_name)},'
            f'"on_behalf_of":{d(on_behalf)},"target":{d(c.target)}',
            d(c.outcome),
        )
        _FRAGMENTS[key] = frag
    return frag


def _fast_parts(c: Captured, origin_fields: str) -> tuple[str, str]:
    """The fast record's text around its ``size`` value: the line is
    ``{"ts":TS,"seq":SEQ,`` + mid + ``SIZE`` + post. Only for records without a header
    to decode or a body to write. ``origin_fields``: :meth:`Origin.fields` (or
    :data:`NO_ORIGIN_FIELDS`)."""
    kind = c.kind
    on_behalf = None
    if c.source and not c.source.startswith(b"l.0\0"):
        on_behalf = c.source.partition(b"\0")[0].decode(errors="replace")
    head, outcome = _fragment(c, on_behalf)
    rid = c.request_id or None
    is_answer = kind == "answer" or kind == "error"
    request_id = "null" if rid is None or not (kind == "command" or is_answer) else str(rid)
    reply_to = str(rid) if (is_answer and rid is not None) else "null"
    all_ = "true" if kind == "command" and c.flags & Flag.ALL else "false"
    return (
        f'{head},"request_id":{request_id},"reply_to":{reply_to},"all":{all_},"size":',
        f',"attachments":{c.n_blobs},"fds":{c.n_fds},"outcome":{outcome},'
        f'"recipients":{c.recipients},"command":null,"event":null,"code":null,'
        f'"error_message":null,"body":null,"body_encoding":null,{origin_fields}}}\n',
    )


def record_line(
    seq: int, c: Captured, body_mode: str, max_bytes: int, origin: Origin | None = None
) -> bytes:
    """``encode_line(make_record(seq, c, body_mode, origin), max_bytes)``, byte for byte,
    with a fast path for the common record: no header to decode and no body to write."""
    if c.header or (body_mode != "none" and c.body is not None):
        return encode_line(make_record(seq, c, body_mode, origin), max_bytes)
    mid, post = _fast_parts(c, origin.fields() if origin else NO_ORIGIN_FIELDS)
    line = f'{{"ts":{round(c.ts, 6)!r},"seq":{seq},{mid}{c.size}{post}'.encode()
    if len(line) > max_bytes:
        return encode_line(make_record(seq, c, body_mode, origin), max_bytes)
    return line


def record_lines(
    items: list[tuple[int, Captured]], body_mode: str, max_bytes: int, origin: Origin | None = None
) -> list[bytes]:
    """``[record_line(seq, c, body_mode, max_bytes, origin) for seq, c in items]``, byte
    for byte.

    Why: a burst of one-way messages from one sender to one group is a run of records
    that differ only in ``seq``, ``ts`` and ``size``; their constant text is built once
    per run instead of once per record (the capture shares the broker's CPU and GIL, and
    a capture that is on must not halve the broker's throughput).
    """
    out: list[bytes] = []
    append = out.append
    origin_fields = origin.fields() if origin else NO_ORIGIN_FIELDS
    last: Captured | None = None
    mid = post = ts_text = ""
    last_ts = -1.0
    for seq, c in items:
        if c.header or (body_mode != "none" and c.body is not None):
            append(encode_line(make_record(seq, c, body_mode, origin), max_bytes))
            continue
        # Same record apart from ts and size (and seq): reuse the parts.
        if last is None or c[1:9] != last[1:9] or c[10:] != last[10:]:
            mid, post = _fast_parts(c, origin_fields)
            last = c
        if c.ts != last_ts:
            last_ts = c.ts
            ts_text = repr(round(c.ts, 6))
        line = f'{{"ts":{ts_text},"seq":{seq},{mid}{c.size}{post}'.encode()
        if len(line) > max_bytes:
            line = encode_line(make_record(seq, c, body_mode, origin), max_bytes)
        append(line)
    return out


# -- files --------------------------------------------------------------------------------
class RotatingWriter:
    """``<prefix>-NNNNNN.jsonl`` files in ``directory``: a new file when the next line would
    take the current one past ``max_bytes``; at most ``max_files`` kept (oldest deleted).

    Synchronous: used from a worker thread; a lock serialises writers. Files are created
    exclusively (O_EXCL) with mode 0600 (captures hold other clients' traffic).
    """

    def __init__(self, directory: Path, prefix: str, max_bytes: int, max_files: int) -> None:
        self.directory = Path(directory)
        self.prefix = prefix
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.lock = threading.Lock()
        self._name = re.compile(rf"^{re.escape(prefix)}-(\d{{6,}})\.jsonl$")
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.seq = max(self._existing(), default=0)
        self.fd = -1
        self.path = self.directory
        self.size = 0
        self.rotations = 0
        self._open_next()
        self._prune()

    def _existing(self) -> list[int]:
        out = []
        for name in os.listdir(self.directory):
            m = self._name.match(name)
            if m is not None:
                out.append(int(m.group(1)))
        return sorted(out)

    def _open_next(self) -> None:
        while True:
            self.seq += 1
            path = self.directory / f"{self.prefix}-{self.seq:06d}.jsonl"
            try:
                fd = os.open(
                    path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600
                )
            except FileExistsError:
                continue
            self.fd, self.path, self.size = fd, path, 0
            return

    def _prune(self) -> None:
        seqs = self._existing()
        for s in seqs[: max(0, len(seqs) - self.max_files)]:
            if s != self.seq:
                try:
                    os.unlink(self.directory / f"{self.prefix}-{s:06d}.jsonl")
                except FileNotFoundError:
                    pass

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def write(self, lines: list[bytes]) -> int:
        """Append lines, rotating as needed; returns the bytes written."""
        total = 0
        with self.lock:
            chunk: list[bytes] = []
            for line in lines:
                if self.size and self.size + len(line) > self.max_bytes:
                    self._write_all(b"".join(chunk))
                    chunk = []
                    os.close(self.fd)
                    self.fd = -1
                    self._open_next()
                    self.rotations += 1
                    self._prune()
                chunk.append(line)
                self.size += len(line)
                total += len(line)
            if chunk:
                self._write_all(b"".join(chunk))
        return total

    def files(self) -> list[str]:
        return [str(self.directory / f"{self.prefix}-{s:06d}.jsonl") for s in self._existing()]

    def close(self) -> None:
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1


# -- sinks --------------------------------------------------------------------------------
@attrs.define(eq=False)
class Sink:
    """Something the tap feeds: a filter, a body mode and a bounded buffer."""

    filter: TrafficFilter
    body: str
    buffer: RecordBuffer


@attrs.define(eq=False)
class FileCapture(Sink):
    settings: CaptureSettings = attrs.field(kw_only=True)
    writer: RotatingWriter = attrs.field(kw_only=True)
    state: str = "running"  # running, stopping, stopped, failed
    error: str | None = None
    records_written: int = 0
    bytes_written: int = 0
    started_at: float = attrs.field(factory=time.time)
    done: trio.Event = attrs.field(factory=trio.Event)
    stop_requested: trio.Event = attrs.field(factory=trio.Event)

    def status(self) -> dict[str, Any]:
        s = self.settings
        return {
            "state": self.state,
            "dir": str(self.writer.directory),
            "prefix": s.prefix,
            "file": str(self.writer.path),
            "files": self.writer.files(),
            "max_bytes": s.max_bytes,
            "max_files": s.max_files,
            "filter": self.filter.describe(),
            "body": self.body,
            "records_written": self.records_written,
            "records_dropped": self.buffer.dropped_total,
            "bytes_written": self.bytes_written,
            "buffered": len(self.buffer.items),
            "rotations": self.writer.rotations,
            "started_at": self.started_at,
            "error": self.error,
        }


@attrs.define(eq=False)
class DumpSink(Sink):
    peer: Peer = attrs.field(kw_only=True)
    sent: int = 0


class TrafficLog:
    """Per-frame log lines at level TRAFFIC (below DEBUG), written synchronously."""

    filter = TrafficFilter()
    body = "none"

    def __init__(self) -> None:
        self.seq = 0

    def offer(self, c: Captured) -> None:
        self.seq += 1
        rec = make_record(self.seq, c, "none")
        detail = " ".join(
            f"{k}={rec[k]}"
            for k in ("request_id", "reply_to", "command", "event", "code")
            if rec[k] is not None
        )
        traffic_log.log(
            TRAFFIC,
            "%s %s (%s) -> %s size=%d %s/%d%s",
            c.kind,
            c.sender,
            c.sender_name,
            c.target,
            c.size,
            c.outcome,
            c.recipients,
            " " + detail if detail else "",
            extra={"lname": c.sender, "client": c.sender_name},
        )


# -- the hub ------------------------------------------------------------------------------
class TapHub:
    """Owns the broker's tap: fans frames out to the file capture, dump clients and the
    TRAFFIC log, and sets ``core.tap`` back to None when none of them is active.

    Args:
        core: the broker core whose ``tap`` this manages.
        after_core: ``Server.after_core``, run after queueing frames (wakes writers).
        soft_limit: returns the current ``out_soft_limit`` (dump clients above it wait).
    """

    def __init__(
        self, core: Broker, after_core: Callable[[], None], soft_limit: Callable[[], int]
    ) -> None:
        self.core = core
        #: This broker process's identity in every record it writes (restart-safe keys).
        self.origin = Origin.new()
        self._after_core = after_core
        self._soft_limit = soft_limit
        self.file: FileCapture | None = None
        self._stopping: list[FileCapture] = []
        self._last: FileCapture | None = None  # the capture that ended last (its status)
        self.dumps: dict[Peer, DumpSink] = {}
        self.traffic: TrafficLog | None = None
        #: (filter.match, offer) of every active sink, rebuilt by _refresh.
        self._sinks: list[
            tuple[Callable[[str, str, str, str], bool], Callable[[Captured], None]]
        ] = []
        self._want_body = False
        self._nursery: trio.Nursery | None = None
        #: Totals over every capture and dump since the broker started (metrics).
        self.written_total = 0
        self.dropped_before = 0  # drops of sinks that are gone

    @property
    def dropped_total(self) -> int:
        n = self.dropped_before
        for s in self._all_buffered_sinks():
            n += s.buffer.dropped_total
        return n

    def _all_buffered_sinks(self) -> list[Sink]:
        out: list[Sink] = [*self.dumps.values(), *self._stopping]
        if self.file is not None:
            out.append(self.file)
        return out

    # -- the tap itself (runs inside routing) ---------------------------------------------
    def _refresh(self) -> None:
        """Recompute the active sinks; the broker's tap is None when there are none."""
        sinks: list[Sink | TrafficLog] = []
        if self.file is not None and self.file.state == "running":
            sinks.append(self.file)
        sinks.extend(self.dumps.values())
        if self.traffic is not None:
            sinks.append(self.traffic)
        self._sinks = [
            (s.filter.match, s.offer if isinstance(s, TrafficLog) else s.buffer.offer)
            for s in sinks
        ]
        self._want_body = any(s.body != "none" for s in sinks)
        self.core.tap = self._tap if sinks else None
        self.core.tap_run = self._tap_run if sinks else None

    def _tap(self, sender: Peer | None, frame: Frame, outcome: str, recipients: int) -> None:
        ftype = frame.type
        kind = _KIND_OF.get(ftype)
        if kind is None:
            return
        target = frame.target
        if ftype == _NOTIFY and target == MEMBERSHIP_GROUP:
            kind = "membership"
        if sender is None:
            lname, name, source = "l.0", "msgq", bytes(frame.source)
        else:
            lname, name, source = sender.lname, sender.name, b""
        item: Captured | None = None
        for match, offer in self._sinks:
            if not match(kind, lname, name, target):
                continue
            if item is None:
                raw, tail, hlen = frame.raw, frame.tail, frame.header_len
                body = None
                if self._want_body:
                    body = bytes(raw[tail + hlen : tail + hlen + frame.body_len])
                    if frame.spliced is not None:  # (materialized by the core for the tap)
                        body += frame.spliced.data or b""
                item = Captured(
                    time.time(),
                    kind,
                    lname,
                    name,
                    source,
                    target,
                    ftype,
                    frame.flags,
                    # int(): the core passes a bool for an answer it forwarded, and the
                    # fast encoder would write it as Python's True (not JSON)
                    frame.request_id,
                    frame.wire_size,
                    outcome,
                    int(recipients),
                    bytes(raw[tail : tail + hlen]) if hlen else b"",
                    body,
                    frame.n_blobs,
                    frame.n_fds,
                )
            offer(item)

    def _tap_run(self, sender: Peer, run: Run, outcome: str, recipients: int) -> None:
        """``_tap`` for each frame of a run of one-way MESSAGEs from ``sender`` to one
        target, without a Frame per message: the filters are asked once per run, and each
        record is one tuple built from the run's shared fields plus the frame's size and
        flags (and its header when it has one). All records of a run share one timestamp:
        its frames came in one receive."""
        if self._want_body:
            for frame in run.frames():
                self._tap(sender, frame, outcome, recipients)
            return
        target, lname, name = run.target, sender.lname, sender.name
        offers = [offer for match, offer in self._sinks if match("message", lname, name, target)]
        if not offers:
            return
        raw = run.raw
        end = len(raw)
        pos = 0
        unpack = PREFIX.unpack_from
        new = tuple.__new__
        ts = time.time()
        recipients = int(recipients)
        while pos < end:
            (length, _t, flags, tlen, slen, _nb, _nf, _r, _rid, hlen, _bl) = unpack(raw, pos)
            size = 4 + length
            if hlen:
                start = pos + PREFIX_SIZE + tlen + slen
                header = raw[start : start + hlen]
            else:
                header = b""
            item = new(
                Captured,
                (
                    ts,
                    "message",
                    lname,
                    name,
                    b"",
                    target,
                    _MESSAGE,
                    flags,
                    0,
                    size,
                    outcome,
                    recipients,
                    header,
                    None,
                    0,
                    0,
                ),
            )
            for offer in offers:
                offer(item)
            pos += size

    # -- file capture ---------------------------------------------------------------------
    def start_capture(self, settings: CaptureSettings) -> dict[str, Any]:
        """Start capturing to files, or update the running capture in place when it writes
        to the same directory and prefix (filters, body, bounds). Raises OSError when the
        directory cannot be used, ValueError for a bad filter; nothing changes then."""
        if self._nursery is None:
            raise RuntimeError("the capture service is not running")
        flt = TrafficFilter(settings.kinds, settings.senders, settings.targets)
        if settings.body not in CAPTURE_BODY_MODES:
            raise ValueError(f"body must be one of {', '.join(CAPTURE_BODY_MODES)}")
        cur = self.file
        if (
            cur is not None
            and cur.state == "running"
            and cur.writer.directory == Path(settings.dir)
            and cur.settings.prefix == settings.prefix
        ):
            cur.filter, cur.body, cur.settings = flt, settings.body, settings
            cur.writer.max_bytes, cur.writer.max_files = settings.max_bytes, settings.max_files
            cur.buffer.max_records = settings.buffer_records
            cur.buffer.max_bytes = settings.buffer_bytes
            self._refresh()
            log.info("capture to %s updated: %s", settings.dir, flt.describe())
            return cur.status()
        # Opening is a few metadata operations, done here so the operator hears of a bad
        # directory at once (not on the routing path: this is a control command).
        writer = RotatingWriter(
            Path(settings.dir), settings.prefix, settings.max_bytes, settings.max_files
        )
        self.stop_capture()
        buf = RecordBuffer(settings.buffer_records, settings.buffer_bytes)
        fc = FileCapture(flt, settings.body, buf, settings=settings, writer=writer)
        buf.wake = trio.Event()
        self.file = fc
        self._refresh()
        self._nursery.start_soon(self._run_capture, fc)
        log.info(
            "capture started: %s (max %d bytes x %d files, body %s, filter %s)",
            writer.path,
            settings.max_bytes,
            settings.max_files,
            settings.body,
            flt.describe(),
        )
        return fc.status()

    def stop_capture(self) -> dict[str, Any] | None:
        """Stop the file capture: the tap stops feeding it at once, its task writes what is
        buffered and closes the file (``state`` goes stopping -> stopped)."""
        fc = self.file
        if fc is None:
            return None
        self.file = None
        if fc.state == "running":
            fc.state = "stopping"
            self._stopping.append(fc)
            fc.stop_requested.set()
            if fc.buffer.wake is not None:
                fc.buffer.wake.set()
        self._refresh()
        log.info("capture to %s stopping", fc.writer.directory)
        return fc.status()

    def capture_status(self) -> dict[str, Any]:
        """The file capture's status, with the broker identity its records carry."""
        if self.file is not None:
            status = self.file.status()
        elif self._stopping:
            status = self._stopping[-1].status()
        elif self._last is not None:
            status = self._last.status()
        else:
            status = {"state": "off"}
        status["broker_instance"] = self.origin.instance
        status["broker_started"] = self.origin.started
        return status

    async def _run_capture(self, fc: FileCapture) -> None:
        buf = fc.buffer
        try:
            while not fc.stop_requested.is_set():
                buf.wake = trio.Event()
                with trio.move_on_after(fc.settings.flush_interval):
                    await buf.wake.wait()
                await self._flush_file(fc)
        except OSError as exc:
            fc.state, fc.error = "failed", f"{exc.strerror or exc} ({fc.writer.path})"
            log.error("capture to %s failed and stopped: %s", fc.writer.directory, fc.error)
            if self.file is fc:
                self.file = None
                self._refresh()
        finally:
            with trio.CancelScope(shield=True) as cs:
                cs.deadline = trio.current_time() + 5.0
                if fc.state in ("running", "stopping"):
                    try:
                        await self._flush_file(fc)
                    except OSError as exc:
                        fc.error = str(exc)
                        log.error("capture to %s: final write failed: %s", fc.writer.directory, exc)
                    if fc.state == "running" or fc.state == "stopping":
                        fc.state = "stopped"
                await trio.to_thread.run_sync(fc.writer.close)
            # No await from here on: the sink leaves the active lists and its drops move
            # to the hub's total in one step (counted once).
            if fc in self._stopping:
                self._stopping.remove(fc)
            if self.file is fc:
                self.file = None
                self._refresh()
            self.dropped_before += fc.buffer.dropped_total
            self._last = fc
            fc.done.set()
            log.info(
                "capture to %s %s: %d records written, %d dropped",
                fc.writer.directory,
                fc.state,
                fc.records_written,
                fc.buffer.dropped_total,
            )

    async def _flush_file(self, fc: FileCapture) -> None:
        items, dropped = fc.buffer.take()
        if not items and not dropped:
            return
        body, max_bytes = fc.body, fc.writer.max_bytes
        # The marker takes the latest sequence number handed out (dropped records used
        # theirs), so seq stays increasing and the gaps show where records were lost.
        seq_after = fc.buffer.seq
        total = fc.buffer.dropped_total

        origin = self.origin

        def work() -> tuple[int, int]:
            lines = record_lines(items, body, max_bytes, origin)
            if dropped:
                lines.append(
                    encode_line(dropped_record(seq_after, dropped, total, origin), max_bytes)
                )
            return len(items), fc.writer.write(lines)

        n, nbytes = await trio.to_thread.run_sync(work)
        fc.records_written += n
        fc.bytes_written += nbytes
        self.written_total += n
        if dropped:
            log.warning(
                "capture buffer overflow: %d records dropped (%d in total); raise "
                "capture.buffer_records / buffer_bytes or narrow the filter",
                dropped,
                total,
            )

    # -- dump clients ---------------------------------------------------------------------
    def add_dump(self, peer: Peer, flt: TrafficFilter, body: str) -> None:
        if self._nursery is None:
            raise RuntimeError("the capture service is not running")
        if body not in CAPTURE_BODY_MODES:
            raise ValueError(f"body must be one of {', '.join(CAPTURE_BODY_MODES)}")
        self.remove_dump(peer)
        buf = RecordBuffer(DUMP_BUFFER_RECORDS, DUMP_BUFFER_BYTES)
        sink = DumpSink(flt, body, buf, peer=peer)
        self.dumps[peer] = sink
        self._refresh()
        self._nursery.start_soon(self._run_dump, sink)

    def remove_dump(self, peer: Peer) -> bool:
        sink = self.dumps.pop(peer, None)
        if sink is None:
            return False
        self.dropped_before += sink.buffer.dropped_total
        self._refresh()
        return True

    async def _run_dump(self, sink: DumpSink) -> None:
        peer = sink.peer
        while self.dumps.get(peer) is sink and peer.alive:
            await trio.sleep(DUMP_INTERVAL)
            if peer.outq_bytes > self._soft_limit():
                continue  # a slow terminal: the buffer fills and overflows, routing goes on
            self._send_dump(sink)
        if self.dumps.get(peer) is sink:
            self.remove_dump(peer)

    def _send_dump(self, sink: DumpSink) -> None:
        items, dropped = sink.buffer.take(DUMP_PER_INTERVAL)
        if not items and not dropped:
            return
        peer = sink.peer
        records = [make_record(seq, c, sink.body, self.origin) for seq, c in items]
        for i in range(0, max(len(records), 1), DUMP_BATCH):
            chunk = records[i : i + DUMP_BATCH]
            pieces = encode_frame(
                FrameType.MESSAGE,
                target=peer.lname,
                header=encode_cbor({"capture": True}),
                body=encode_cbor({"records": chunk, "dropped": dropped}),
                source=_BROKER_SOURCE,
            )
            dropped = 0
            if self.core.enqueue(peer, pieces):
                sink.sent += len(chunk)
                self.written_total += len(chunk)
            else:
                sink.buffer.dropped_total += len(chunk)
        self._after_core()

    def peer_gone(self, peer: Peer) -> None:
        if peer in self.dumps:
            self.remove_dump(peer)

    # -- TRAFFIC log ----------------------------------------------------------------------
    def set_traffic_logging(self, on: bool) -> None:
        if on and self.traffic is None:
            self.traffic = TrafficLog()
        elif not on:
            self.traffic = None
        self._refresh()

    # -- task -----------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the sinks' tasks; on cancellation (broker shutdown) every capture writes
        what it buffered before its file is closed."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self.dumps.clear()
            self.traffic = None
            self._refresh()

    def stats(self) -> dict[str, Any]:
        return {
            "state": self.capture_status().get("state", "off"),
            "records_written_total": self.written_total,
            "records_dropped_total": self.dropped_total,
            "dump_clients": len(self.dumps),
            "tap": self.core.tap is not None,
        }
