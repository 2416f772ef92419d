"""Logging for the broker: stdlib logging with structured client fields.

* Destinations: stderr (default), a file (``log.file``, reopened when rotated away, like
  ``WatchedFileHandler``), syslog/journald through ``/dev/log`` (``log.syslog``), or
  journald's native protocol with every field as a journal field (``syslog_address =
  "journal"`` or ``"journal:PATH"``). A syslog socket that is missing is reported on
  stderr once and the log falls back to stderr.
* Never blocking: the root logger gets one :class:`BoundedQueueHandler`, which only puts
  the record on a bounded queue; a ``QueueListener`` thread writes to the destinations. A
  slow syslog daemon, a full disk or a stderr pipe nobody reads stalls that thread, not
  the broker's event loop. When the queue is full a record is dropped and counted
  (:func:`dropped_records`), and a WARNING saying how many were lost goes in as soon as
  there is room again. The listener is stopped (and the queue written out) when the
  logging is replaced and at interpreter exit.
* Fields: every record gets ``lname``, ``client``, ``pid``, ``uid`` (and ``group``,
  ``reason``, ``code`` when known). Code in this package passes them with ``extra=``; the
  broker's own lines name clients with ``Peer.describe()`` (``l.3 (name='x' pid=1
  uid=0)``), which :class:`IdentityFilter` lifts into the same fields, so every line about
  a client can be searched by field. ``text`` appends ``[lname=l.3 client='x' ...]``;
  ``json`` writes one object per line.
* Levels: CRITICAL..DEBUG as usual, plus TRAFFIC (5) for one line per routed frame
  (enabled through the capture tap, see :mod:`msgq_trio.ops.capture`).
* Nothing reaches stderr unlogged: uncaught exceptions in any thread and warnings go
  through logging; a handler that fails writes one line to stderr, not a traceback.
"""

from __future__ import annotations

import ast
import atexit
import copy
import errno
import json
import logging
import logging.handlers
import os
import queue
import re
import socket
import struct
import sys
import threading
import time
from types import TracebackType
from typing import Any

import attrs

from ..config import LogSettings
from ..core.peers import Peer

TRAFFIC = 5
logging.addLevelName(TRAFFIC, "TRAFFIC")

#: Structured fields, in the order the text format shows them.
FIELDS = ("lname", "client", "pid", "uid", "gid", "group", "reason", "code")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_DESCRIBE = re.compile(
    r"(l\.\d+) \(name=('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\") pid=(-?\d+) uid=(-?\d+)\)"
)
_BEFORE_HELLO = re.compile(r"pid=(-?\d+) uid=(-?\d+) \(before HELLO\)")

#: Records the log queue holds before it drops (``MSGQ_TRIO_LOG_QUEUE_RECORDS`` overrides).
#: 10,000 lines of ~200 bytes are 2 MB: enough for a burst such as every client of a
#: large bus being dropped at once, small enough that a destination stalled for good
#: does not grow the broker without bound.
QUEUE_RECORDS = 10_000
#: Environment variable that sets the queue's size (a positive integer).
QUEUE_RECORDS_ENV = "MSGQ_TRIO_LOG_QUEUE_RECORDS"
#: journald's native socket (``syslog_address = "journal"``).
JOURNAL_SOCKET = "/run/systemd/journal/socket"

#: The front handler this module installed on the root logger, and its listener
#: (replaced on reconfiguration).
_installed: list[PreparedLogging] = []
_lock = threading.Lock()
_atexit_registered = False


def peer_fields(peer: Peer) -> dict[str, object]:
    """``extra=`` for a log call about ``peer``."""
    return {
        "lname": peer.lname,
        "client": peer.name,
        "pid": peer.pid,
        "uid": peer.uid,
        "gid": peer.gid,
    }


class IdentityFilter(logging.Filter):
    """Fill the structured fields from a Peer or a ``Peer.describe()`` string among the
    record's arguments when the call did not pass them with ``extra=``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "lname", None) is not None or getattr(record, "pid", None) is not None:
            return True
        args = record.args
        if isinstance(args, tuple):
            for arg in args:
                if isinstance(arg, Peer):
                    for k, v in peer_fields(arg).items():
                        setattr(record, k, v)
                    return True
                if (
                    isinstance(arg, str)
                    and (arg.startswith("l.") or "before HELLO" in arg)
                    and self._from_text(record, arg)
                ):
                    return True
        return True

    @staticmethod
    def _from_text(record: logging.LogRecord, text: str) -> bool:
        m = _DESCRIBE.search(text)
        if m is not None:
            try:
                name = ast.literal_eval(m.group(2))
            except (ValueError, SyntaxError):
                name = m.group(2)
            record.lname = m.group(1)
            record.client = name
            record.pid = int(m.group(3))
            record.uid = int(m.group(4))
            return True
        m = _BEFORE_HELLO.search(text)
        if m is not None:
            record.pid = int(m.group(1))
            record.uid = int(m.group(2))
            return True
        return False


def _fields(record: logging.LogRecord) -> dict[str, object]:
    out = {}
    for k in FIELDS:
        v = getattr(record, k, None)
        if v is not None:
            out[k] = v
    return out


class TextFormatter(logging.Formatter):
    """``time LEVEL logger: message [lname=l.3 client='x' pid=1 uid=0]``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = _fields(record)
        if fields:
            line += (
                " ["
                + " ".join(
                    f"{k}={v!r}" if isinstance(v, str) and k == "client" else f"{k}={v}"
                    for k, v in fields.items()
                )
                + "]"
            )
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, time, level, logger, msg, the fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
            + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_fields(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str)


class _QuietErrors:
    """Mixin: a handler that cannot write reports one line on stderr, once, no traceback."""

    _reported = False

    def handleError(self, record: logging.LogRecord) -> None:
        if self._reported:
            return
        self._reported = True
        exc = sys.exc_info()[1]
        try:
            sys.stderr.write(f"msgq-trio: logging failed ({type(self).__name__}): {exc}\n")
        except (OSError, ValueError):
            pass


class StderrHandler(_QuietErrors, logging.StreamHandler):  # type: ignore[type-arg]
    def __init__(self) -> None:
        super().__init__(sys.stderr)


class FileHandler(_QuietErrors, logging.handlers.WatchedFileHandler):
    pass


class SyslogHandler(_QuietErrors, logging.handlers.SysLogHandler):
    pass


class JournalHandler(_QuietErrors, logging.Handler):
    """journald's native protocol: one datagram per record of ``FIELD=value`` lines to
    ``path``, so every structured field is a journal field (``journalctl
    MSGQ_LNAME=l.3``): ``MESSAGE`` (the formatted line), ``PRIORITY``,
    ``SYSLOG_FACILITY``, ``SYSLOG_IDENTIFIER`` (msgq-trio), ``SYSLOG_PID``, ``LOGGER``,
    ``CODE_FILE``/``CODE_LINE``/``CODE_FUNC``, ``THREAD_NAME`` and ``MSGQ_<FIELD>`` for
    each of :data:`FIELDS` the record has. A record too large for one datagram is sent
    again with its MESSAGE cut to :data:`JOURNAL_MESSAGE_MAX` bytes (journald's own
    client would pass a memfd instead; a log line that long is rare here).
    """

    def __init__(self, path: str, facility: int) -> None:
        super().__init__()
        self.path = path
        self.facility = facility
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def fields(self, record: logging.LogRecord, message: str) -> list[tuple[str, str]]:
        out = [
            ("MESSAGE", message),
            ("PRIORITY", str(_journal_priority(record.levelno))),
            ("SYSLOG_FACILITY", str(self.facility)),
            ("SYSLOG_IDENTIFIER", "msgq-trio"),
            ("SYSLOG_PID", str(os.getpid())),
            ("LOGGER", record.name),
            ("CODE_FILE", record.pathname),
            ("CODE_LINE", str(record.lineno)),
            ("CODE_FUNC", record.funcName),
            ("THREAD_NAME", record.threadName or ""),
        ]
        out += [(f"MSGQ_{k.upper()}", str(v)) for k, v in _fields(record).items()]
        return out

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            try:
                self.sock.sendto(journal_datagram(self.fields(record, message)), self.path)
            except OSError as exc:
                if exc.errno != errno.EMSGSIZE:
                    raise
                cut = message.encode()[:JOURNAL_MESSAGE_MAX].decode(errors="ignore")
                self.sock.sendto(journal_datagram(self.fields(record, cut + " [cut]")), self.path)
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self.sock.close()
        super().close()


#: A MESSAGE longer than this is cut when the whole record does not fit one datagram.
JOURNAL_MESSAGE_MAX = 32 * 1024


def _journal_priority(levelno: int) -> int:
    # syslog severities: crit 2, err 3, warning 4, notice 5, info 6, debug 7.
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


def journal_datagram(fields: list[tuple[str, str]]) -> bytes:
    """Encode ``(NAME, value)`` pairs in journald's native format: ``NAME=value\n``, or
    for a value with a newline ``NAME\n``, its length as 64-bit little-endian, the value
    and ``\n``."""
    out = bytearray()
    for name, value in fields:
        data = value.encode("utf-8", errors="replace")
        if b"\n" in data:
            out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name.encode() + b"=" + data + b"\n"
    return bytes(out)


class BoundedQueueHandler(logging.handlers.QueueHandler):
    """Puts records on a bounded queue and never waits: when the queue is full the record
    is dropped and counted; the next record that finds room is preceded by one WARNING
    saying how many were lost.

    The record is made self-contained first (message rendered, ``args`` cleared), since
    the listener thread formats it later while the broker may change the objects the
    arguments refer to; the traceback (``exc_info``) is kept for the destination's
    formatter.
    """

    def __init__(self, q: queue.Queue[logging.LogRecord]) -> None:
        super().__init__(q)
        self.capacity = q.maxsize
        #: Records dropped since this handler was installed.
        self.dropped = 0
        self._unreported = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        record = copy.copy(record)
        record.msg = record.getMessage()
        record.args = None
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        # Called with the handler's lock held (Handler.handle), so the counters and the
        # order notice-then-record need no lock of their own.
        q = self.queue
        if self._unreported:
            try:
                q.put_nowait(self._notice(self._unreported))
            except queue.Full:
                pass
            else:
                self._unreported = 0
        try:
            q.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            self._unreported += 1

    def _notice(self, n: int) -> logging.LogRecord:
        record = logging.LogRecord(
            "msgq_trio.ops",
            logging.WARNING,
            __file__,
            0,
            "%d log records dropped: the log queue (%d records) was full because a log "
            "destination is slower than the broker logs",
            (n, self.capacity),
            None,
        )
        return self.prepare(record)


#: Seconds :func:`shutdown` waits for the listener to write out the queue at exit: a
#: destination stalled for good must not keep the broker from exiting (systemd's stop
#: timeout is 90 s; the rest of the shutdown needs its share).
STOP_TIMEOUT = 5.0


class QueueListener(logging.handlers.QueueListener):
    """The stdlib listener with a stop that cannot hang: the end marker is put with a
    timeout (the queue may be full) and the thread joined with one (a destination may
    never return). The thread is a daemon, so one left behind does not stop the exit."""

    def stop_within(self, timeout: float) -> bool:
        """Stop after the records queued so far are written; False if that did not finish
        within ``timeout`` seconds (the thread is then left to the interpreter's exit)."""
        thread = self._thread
        if thread is None:
            return True
        deadline = time.monotonic() + timeout
        try:
            self.queue.put(self._sentinel, timeout=timeout)  # type: ignore[attr-defined]
        except queue.Full:
            return False
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return False
        self._thread = None
        return True


class LogFileError(OSError):
    """The log file cannot be opened (the configuration is refused)."""


@attrs.define
class PreparedLogging:
    """Handlers built for some settings, not installed yet (see :func:`prepare`).

    ``handlers`` are the destinations; ``front`` is the one handler the root logger gets
    and ``listener`` the thread that feeds the destinations from its queue (started by
    :func:`install`).
    """

    settings: LogSettings
    handlers: list[logging.Handler]
    #: Destinations that failed and were replaced by stderr (a missing syslog socket).
    problems: list[str]
    front: BoundedQueueHandler
    listener: QueueListener

    def discard(self) -> None:
        """Close handlers that were never installed."""
        for h in self.handlers:
            h.close()

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Write out what is queued (waiting at most ``timeout`` seconds), stop the
        listener thread, close the destinations (unless the thread is still writing)."""
        if self.listener.stop_within(timeout):
            self.discard()


def queue_records() -> tuple[int, str | None]:
    """The log queue's size: ``$MSGQ_TRIO_LOG_QUEUE_RECORDS`` or :data:`QUEUE_RECORDS`,
    and a problem to report if the variable is set but not a positive integer (the
    default is used then)."""
    raw = os.environ.get(QUEUE_RECORDS_ENV, "")
    if not raw:
        return QUEUE_RECORDS, None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n <= 0:
        return QUEUE_RECORDS, (
            f"{QUEUE_RECORDS_ENV}={raw!r} is not a positive integer; "
            f"the log queue holds {QUEUE_RECORDS} records"
        )
    return n, None


def prepare(settings: LogSettings, *, capacity: int | None = None) -> PreparedLogging:
    """Build the handlers for ``settings`` without touching the running logging.

    ``capacity`` is the log queue's size in records (default :func:`queue_records`).

    Raises:
        LogFileError: ``log.file`` cannot be opened for appending.

    A syslog socket that is missing is not an error: it becomes a problem to report and
    the log goes to stderr; so does a malformed ``$MSGQ_TRIO_LOG_QUEUE_RECORDS``.
    """
    handlers: list[logging.Handler] = []
    problems: list[str] = []
    if capacity is None:
        capacity, problem = queue_records()
        if problem:
            problems.append(problem)
    if settings.file:
        try:
            handlers.append(FileHandler(settings.file, encoding="utf-8"))
        except OSError as exc:
            raise LogFileError(
                f"log.file = {settings.file!r}: cannot open: {exc.strerror or exc}"
            ) from None
    if settings.syslog:
        address = settings.syslog_address
        journal = address == "journal" or address.startswith("journal:")
        path = (address.partition(":")[2] or JOURNAL_SOCKET) if journal else address
        if path.startswith("/") and not os.path.exists(path):
            problems.append(
                f"syslog requested but {path} does not exist (no syslog daemon or journald socket)"
            )
        else:
            try:
                facility = logging.handlers.SysLogHandler.facility_names[settings.syslog_facility]
                if journal:
                    handlers.append(JournalHandler(path, facility))
                else:
                    target: str | tuple[str, int] = address
                    if not address.startswith("/"):
                        host, _, port = address.rpartition(":")
                        target = (host, int(port))
                    h = SyslogHandler(address=target, facility=facility)
                    h.ident = f"msgq-trio[{os.getpid()}]: "
                    handlers.append(h)
            except (OSError, ValueError) as exc:
                problems.append(f"cannot log to syslog at {address}: {exc}")
    if not handlers:
        handlers.append(StderrHandler())
    formatter: logging.Formatter = JsonFormatter() if settings.format == "json" else TextFormatter()
    for handler in handlers:
        handler.setFormatter(formatter)
    q: queue.Queue[logging.LogRecord] = queue.Queue(maxsize=capacity)
    front = BoundedQueueHandler(q)
    # The identity fields are read from the record's arguments, which prepare() then
    # renders away: the filter runs on the front handler, before the queue.
    front.addFilter(IdentityFilter())
    listener = QueueListener(q, *handlers, respect_handler_level=True)
    return PreparedLogging(settings, handlers, problems, front, listener)


def level_number(name: str) -> int:
    return TRAFFIC if name == "TRAFFIC" else int(logging.getLevelName(name))


def configure(settings: LogSettings) -> list[str]:
    """(Re)configure the root logger for ``settings``; returns the problems reported.

    Raises:
        LogFileError: the log file cannot be opened (nothing changed).
    """
    return install(prepare(settings))


def dropped_records() -> int:
    """Log records dropped because the log queue was full since the first :func:`install`
    (a reconfiguration carries the count over)."""
    with _lock:
        return _installed[0].front.dropped if _installed else 0


def shutdown() -> None:
    """Write out the queued records and stop the listener (registered with atexit by
    :func:`install`; safe to call more than once)."""
    root = logging.getLogger()
    with _lock:
        old = list(_installed)
        _installed.clear()
        for prepared in old:
            root.removeHandler(prepared.front)
    for prepared in old:
        prepared.stop()


def install(prepared: PreparedLogging) -> list[str]:
    """Make prepared handlers the root logger's; returns problems (reported on stderr and
    in the log). Safe at runtime: the new handlers are in place before the old close, and
    the old listener writes out its queue before it stops."""
    global _atexit_registered
    handlers, problems, settings = prepared.handlers, prepared.problems, prepared.settings
    root = logging.getLogger()
    prepared.listener.start()
    with _lock:
        old = list(_installed)
        prepared.front.dropped += sum(o.front.dropped for o in old)
        root.addHandler(prepared.front)
        for o in old:
            root.removeHandler(o.front)
        _installed[:] = [prepared]
        # Handlers a plain basicConfig() installed before us would print twice.
        for h in list(root.handlers):
            if h is not prepared.front and type(h) is logging.StreamHandler:
                root.removeHandler(h)
        if not _atexit_registered:
            # Runs before logging's own atexit flush (atexit is last-in, first-out).
            atexit.register(shutdown)
            _atexit_registered = True
    for o in old:
        # Not on this (the event loop's) thread: a stalled old destination may take the
        # whole STOP_TIMEOUT to give up.
        threading.Thread(target=o.stop, name="msgq-log-stop", daemon=True).start()
    root.setLevel(level_number(settings.level))
    fell_back = settings.syslog and all(isinstance(h, StderrHandler) for h in handlers)
    for p in problems:
        # Said on stderr too: the log may not go where the operator looks for it.
        instead = fell_back and "syslog" in p
        sys.stderr.write(f"msgq-trio: {p}" + ("; logging to stderr instead\n" if instead else "\n"))
        logging.getLogger("msgq_trio.ops").error("%s", p)
    return problems


def install_exception_hooks() -> None:
    """Route every uncaught exception (main thread or worker thread) and every warning
    through logging, so no traceback reaches stderr outside the log."""

    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            return
        logging.getLogger("msgq_trio").critical("uncaught exception", exc_info=(exc_type, exc, tb))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit or args.exc_value is None:
            return
        logging.getLogger("msgq_trio").critical(
            "uncaught exception in thread %s",
            args.thread.name if args.thread else "?",
            exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
        )

    sys.excepthook = excepthook
    threading.excepthook = thread_hook
    logging.captureWarnings(True)


def describe_fields(**fields: Any) -> dict[str, Any]:
    """``extra=`` with only the fields that are set."""
    return {k: v for k, v in fields.items() if v is not None}
