"""Helpers for the operations tests: the ``msgq-trio ctl`` command line as a subprocess,
polling, reading capture files and HTTP GET (imported as ``ops_helpers``; fixtures are in
this directory's conftest.py). Brokers come from the shared ``broker_factory`` fixture:
real processes, real sockets."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

PY = sys.executable


def run_cli(*argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``python -m msgq_trio ARGV`` (blocking; call through trio.to_thread)."""
    return subprocess.run(
        [PY, "-m", "msgq_trio", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )


async def ctl(socket: Path, *argv: str, json_out: bool = True) -> Any:
    """Run ``msgq-trio ctl`` and return its parsed JSON answer (``json_out``) or the
    CompletedProcess (for tables and failures)."""
    flags = ["--json"] if json_out else []
    r = await trio.to_thread.run_sync(
        lambda: run_cli("ctl", "--socket", str(socket), *flags, *argv)
    )
    if not json_out:
        return r
    assert r.returncode == 0, f"ctl {argv} failed ({r.returncode}): {r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout)


async def wait_for(
    predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05
) -> Any:
    """Poll ``predicate`` (sync or async) until it returns something truthy."""
    with trio.fail_after(timeout):
        while True:
            value = predicate()
            if hasattr(value, "__await__"):
                value = await value
            if value:
                return value
            await trio.sleep(interval)


def read_records(directory: Path, prefix: str = "capture") -> list[dict[str, Any]]:
    """Every record of every capture file in ``directory``, oldest file first."""
    out: list[dict[str, Any]] = []
    for f in sorted(directory.glob(f"{prefix}-*.jsonl")):
        for line in f.read_text().splitlines():
            out.append(json.loads(line))
    return out


async def http_get(address: str, path: str = "/metrics") -> tuple[int, dict[str, str], str]:
    """A plain HTTP/1.1 GET over a real TCP connection: (status, headers, body)."""
    host, _, port = address.rpartition(":")
    stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        with trio.fail_after(10):
            while True:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return status, headers, body.decode()
