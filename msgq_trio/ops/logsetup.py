"""Logging for the broker: stdlib logging with structured client fields.

* Destinations: stderr (default), a file (``log.file``, reopened when rotated away, like
  ``WatchedFileHandler``), syslog/journald through ``/dev/log`` (``log.syslog``). A syslog
  socket that is missing is reported on stderr once and the log falls back to stderr.
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
import json
import logging
import logging.handlers
import os
import re
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

#: Handlers this module installed on the root logger (replaced on reconfiguration).
_installed: list[logging.Handler] = []
_lock = threading.Lock()


def peer_fields(peer: Peer) -> dict[str, object]:
    """``extra=`` for a log call about ``peer``."""
    return {"lname": peer.lname, "client": peer.name, "pid": peer.pid, "uid": peer.uid,
            "gid": peer.gid}


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
            line += " [" + " ".join(
                f"{k}={v!r}" if isinstance(v, str) and k == "client" else f"{k}={v}"
                for k, v in fields.items()
            ) + "]"
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


class LogFileError(OSError):
    """The log file cannot be opened (the configuration is refused)."""


@attrs.define
class PreparedLogging:
    """Handlers built for some settings, not installed yet (see :func:`prepare`)."""

    settings: LogSettings
    handlers: list[logging.Handler]
    #: Destinations that failed and were replaced by stderr (a missing syslog socket).
    problems: list[str]

    def discard(self) -> None:
        for h in self.handlers:
            h.close()


def prepare(settings: LogSettings) -> PreparedLogging:
    """Build the handlers for ``settings`` without touching the running logging.

    Raises:
        LogFileError: ``log.file`` cannot be opened for appending.

    A syslog socket that is missing is not an error: it becomes a problem to report and
    the log goes to stderr.
    """
    handlers: list[logging.Handler] = []
    problems: list[str] = []
    if settings.file:
        try:
            handlers.append(FileHandler(settings.file, encoding="utf-8"))
        except OSError as exc:
            raise LogFileError(
                f"log.file = {settings.file!r}: cannot open: {exc.strerror or exc}"
            ) from None
    if settings.syslog:
        address = settings.syslog_address
        if address.startswith("/") and not os.path.exists(address):
            problems.append(f"syslog requested but {address} does not exist (no syslog daemon "
                            "or journald socket)")
        else:
            try:
                facility = logging.handlers.SysLogHandler.facility_names[settings.syslog_facility]
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
    formatter: logging.Formatter = (
        JsonFormatter() if settings.format == "json" else TextFormatter()
    )
    identity = IdentityFilter()
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(identity)
    return PreparedLogging(settings, handlers, problems)


def level_number(name: str) -> int:
    return TRAFFIC if name == "TRAFFIC" else int(logging.getLevelName(name))


def configure(settings: LogSettings) -> list[str]:
    """(Re)configure the root logger for ``settings``; returns the problems reported.

    Raises:
        LogFileError: the log file cannot be opened (nothing changed).
    """
    return install(prepare(settings))


def install(prepared: PreparedLogging) -> list[str]:
    """Make prepared handlers the root logger's; returns problems (reported on stderr and
    in the log). Safe at runtime: the new handlers are in place before the old close."""
    handlers, problems, settings = prepared.handlers, prepared.problems, prepared.settings
    root = logging.getLogger()
    with _lock:
        old = list(_installed)
        for h in handlers:
            root.addHandler(h)
        for h in old:
            root.removeHandler(h)
            h.close()
        _installed[:] = handlers
        # Handlers a plain basicConfig() installed before us would print twice.
        for h in list(root.handlers):
            if h not in handlers and type(h) is logging.StreamHandler:
                root.removeHandler(h)
    root.setLevel(level_number(settings.level))
    fell_back = bool(problems) and all(isinstance(h, StderrHandler) for h in handlers)
    for p in problems:
        # Said on stderr too: the log may not go where the operator looks for it.
        sys.stderr.write(f"msgq-trio: {p}" + ("; logging to stderr instead\n" if fell_back
                                              else "\n"))
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
