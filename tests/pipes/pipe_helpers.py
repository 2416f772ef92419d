"""Helpers of the pipe tests: reading a child's stdout lines with a timeout, finding the
plugin process, reading RSS from /proc."""

from __future__ import annotations

import os
import select
import subprocess
import time
from pathlib import Path


def readline(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The next stdout line of ``proc`` (without newline); "" at EOF. Raises TimeoutError.

    Reads one byte at a time with select (the lines are short and few), so nothing is
    buffered beyond the line: the next call sees the rest.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    out = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no line from pid {proc.pid} within {timeout} s ({out!r})")
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        b = os.read(fd, 1)
        if not b or b == b"\n":
            return out.decode()
        out += b


def wait_line(proc: subprocess.Popen[bytes], prefix: str, timeout: float) -> str:
    """Skip lines until one starts with ``prefix``; returns it. Raises TimeoutError/EOFError."""
    deadline = time.monotonic() + timeout
    while True:
        line = readline(proc, max(0.01, deadline - time.monotonic()))
        if line.startswith(prefix):
            return line
        if line == "":
            raise EOFError(f"pid {proc.pid} ended before a {prefix!r} line")


def plugin_pid(broker_pid: int) -> int:
    """The pipe plugin process: the broker's child running ``msgq_trio.plugins.host``."""
    for task in os.listdir(f"/proc/{broker_pid}/task"):
        children = Path(f"/proc/{broker_pid}/task/{task}/children").read_text().split()
        for c in children:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes()
            if b"msgq_trio.plugins.host" in cmd:
                return int(c)
    raise LookupError("no plugin process under the broker")


def rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (VmRSS of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LookupError(pid)
