"""Parent side of the worker protocol: start worker and server processes, wait for their
READY/RESULT lines with a deadline, and always kill them (whole process groups).

Helpers the scenario runner needs too (a free port, a process's RSS and CPU time, the
descriptor limit) are in :mod:`msgq_trio._procs`, which both import.

Every child gets its own session (``start_new_session``), so ``os.killpg`` ends it and
anything it started; stderr goes to a file in the run's directory and its tail is quoted
when a child fails.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import child_env
from .common import GO, RESULT, Spec


class RunTimeout(Exception):
    """The run's hard deadline passed."""


class WorkerFailed(Exception):
    """A child exited, or reported an error, before finishing its part."""


def stderr_tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


class Proc:
    """One child process in its own process group, speaking the line protocol."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_dir: Path,
        *,
        stdin: bool = True,
        env: dict[str, str] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.name = name
        self.stderr_path = log_dir / f"{name}.stderr"
        with open(self.stderr_path, "wb") as err:
            self.popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
                env=child_env(env),
                pass_fds=tuple(pass_fds),
            )
        self._buf = b""
        self.lines: list[str] = []
        self._cursor = 0  # lines[:_cursor] were looked at by wait_line
        self.eof = False
        self.result: dict[str, Any] | None = None

    @classmethod
    def worker(
        cls, name: str, module: str, spec: Spec, log_dir: Path, pass_fds: Sequence[int] = ()
    ) -> Proc:
        """Start ``python -m benchmarks.<module> SPEC_JSON``."""
        return cls(
            name,
            [sys.executable, "-m", f"benchmarks.{module}", json.dumps(spec)],
            log_dir,
            pass_fds=pass_fds,
        )

    def fileno(self) -> int:
        assert self.popen.stdout is not None
        return self.popen.stdout.fileno()

    def _read(self) -> None:
        data = os.read(self.fileno(), 65536)
        if not data:
            self.eof = True
            return
        self._buf += data
        *done, self._buf = self._buf.split(b"\n")
        for raw in done:
            line = raw.decode(errors="replace").strip()
            self.lines.append(line)
            if line.startswith(RESULT + " ") and self.result is None:
                try:
                    self.result = json.loads(line[len(RESULT) + 1 :])
                except json.JSONDecodeError as exc:
                    self.result = {"error": f"unreadable RESULT line: {exc}"}

    def has(self, marker: str) -> bool:
        if marker == RESULT:
            return self.result is not None
        return marker in self.lines

    def failure(self, what: str) -> WorkerFailed:
        code = self.popen.poll()
        status = f"exit status {code}" if code is not None else "still running"
        tail = stderr_tail(self.stderr_path)
        return WorkerFailed(f"{self.name} {what} ({status}){': ' + tail if tail else ''}")

    def go(self) -> None:
        self.send(GO)

    def send(self, line: str) -> None:
        """Write one line to the child's stdin (``GO``, or a worker's own command)."""
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write((line + "\n").encode())
            self.popen.stdin.flush()
        except BrokenPipeError as exc:
            raise self.failure(f"exited before {line.split(maxsplit=1)[0]}") from exc

    def wait_line(self, prefix: str, deadline: float) -> str:
        """The next line (after the ones an earlier ``wait_line`` returned) that starts
        with ``prefix``; lines in between are skipped.

        Raises:
            RunTimeout: ``deadline`` (``time.monotonic()``) passed first.
            WorkerFailed: the child closed its stdout first.
        """
        while True:
            while self._cursor < len(self.lines):
                line = self.lines[self._cursor]
                self._cursor += 1
                if line.startswith(prefix):
                    return line
            if self.eof:
                self.popen.wait(5)
                raise self.failure(f"exited before {prefix}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RunTimeout(f"timed out waiting for {prefix} from {self.name}")
            readable, _, _ = select.select([self], [], [], min(left, 1.0))
            if readable:
                self._read()

    def kill(self, sig: int = signal.SIGKILL, wait: float = 5.0) -> int | None:
        """Signal the whole process group; wait up to ``wait`` s; SIGKILL if still alive."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(wait)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.popen.wait(5)
        else:
            # The leader is gone; make sure nothing it started lingers in its group.
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for f in (self.popen.stdin, self.popen.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        return self.popen.returncode


def wait_all(procs: Sequence[Proc], marker: str, deadline: float) -> None:
    """Wait until every proc printed ``marker`` (READY or RESULT) or fail.

    Raises:
        RunTimeout: ``deadline`` (``time.monotonic()``) passed first.
        WorkerFailed: a proc exited first, or its RESULT is an error.
    """
    while True:
        for p in procs:
            if marker == RESULT and p.result is not None and "error" in p.result:
                raise p.failure(f"failed: {p.result['error']}")
        pending = [p for p in procs if not p.has(marker)]
        if not pending:
            return
        for p in pending:
            if p.eof:
                p.popen.wait(5)
                raise p.failure(f"exited before {marker}")
        left = deadline - time.monotonic()
        if left <= 0:
            names = ", ".join(p.name for p in pending)
            raise RunTimeout(f"timed out waiting for {marker} from {names}")
        readable, _, _ = select.select(pending, [], [], min(left, 1.0))
        for p in readable:
            p._read()


def wait_port(host: str, port: int, deadline: float, proc: Proc | None = None) -> None:
    """Wait until a TCP server accepts on (host, port)."""
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise proc.failure("exited at start-up")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise RunTimeout(f"nothing accepts on {host}:{port}")


def wait_unix(path: Path, deadline: float, proc: Proc | None = None) -> None:
    """Wait until a server accepts on the Unix socket ``path``."""
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise proc.failure("exited at start-up")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(path))
            return
        except OSError:
            time.sleep(0.02)
        finally:
            s.close()
    raise RunTimeout(f"nothing accepts on {path}")


@dataclass
class Service:
    """A running broker (or nothing, for raw-unix): clients' address and a stop action."""

    addr: dict[str, Any]
    stops: list[Callable[[], None]] = field(default_factory=list)
    #: The broker's processes, whose CPU time the run reports.
    pids: list[int] = field(default_factory=list)

    def stop(self) -> None:
        for stop in reversed(self.stops):
            stop()


def stop_popen(proc: subprocess.Popen[bytes]) -> Callable[[], None]:
    """A stop action for a server started with plain ``Popen``: SIGTERM, then SIGKILL."""

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    return stop


def stop_proc(proc: Proc) -> Callable[[], None]:
    """A stop action for a :class:`Proc` server: SIGTERM to its group, then SIGKILL."""

    def stop() -> None:
        proc.kill(signal.SIGTERM, wait=5.0)

    return stop
