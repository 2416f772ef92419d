"""Helpers and fixtures of the web console's tests (imported as ``console_helpers``; the
fixtures are re-exported by this directory's conftest.py): a real ``msgq-trio console``
process against a real broker, component processes with a declared command, and a viewer
that talks HTTP to the console with a cookie jar (urllib, no mocks)."""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

PY = sys.executable
START_TIMEOUT = 30.0


def first_line(fd: int, timeout: float) -> str | None:
    """The first line written to pipe ``fd``, or None at EOF or after ``timeout``."""
    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            buf += chunk
    return buf.partition(b"\n")[0].decode(errors="replace")


class ConsoleProcess:
    """A running ``msgq-trio console``: its URL (the first line of its stdout) and log."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
        self.proc = proc
        self.url = url
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
            raise AssertionError("the console ignored SIGTERM for 15 s") from None
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def launch_console(
    socket: str, *flags: str, log_path: Path, env: dict[str, str] | None = None
) -> ConsoleProcess:
    """Start ``msgq-trio console -s SOCKET --listen 127.0.0.1:0 FLAGS`` and read its URL."""
    argv = [PY, "-m", "msgq_trio", "console", "-s", socket, "--listen", "127.0.0.1:0", *flags]
    with open(log_path, "wb") as err:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env
        )
    assert proc.stdout is not None
    line = first_line(proc.stdout.fileno(), START_TIMEOUT)
    if not line or not line.startswith("http"):
        proc.kill()
        proc.wait(15)
        raise RuntimeError(f"console did not start ({line!r}):\n{log_path.read_text()}")
    return ConsoleProcess(proc, line.strip(), log_path)


@pytest.fixture
def console_factory(short_tmp: Path) -> Iterator[Callable[..., ConsoleProcess]]:
    """``start(socket, *flags)``: a console process; stopped at teardown, which fails the
    test if it did not exit 0 on SIGTERM or logged a traceback."""
    started: list[ConsoleProcess] = []

    def start(socket: str | Path, *flags: str, env: dict[str, str] | None = None) -> ConsoleProcess:
        c = launch_console(
            str(socket), *flags, log_path=short_tmp / f"console{len(started)}.log", env=env
        )
        started.append(c)
        return c

    yield start
    problems = []
    for c in started:
        rc = c.stop()
        if rc != 0:
            problems.append(f"console exited {rc}:\n{c.log()[-3000:]}")
        if "Traceback" in c.log():
            problems.append(f"console logged a traceback:\n{c.log()[-3000:]}")
    assert not problems, "\n".join(problems)


class Viewer:
    """A browser without the browser: a cookie jar, the page's CSRF token, JSON calls."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))
        self.csrf = ""

    def request(
        self,
        path: str,
        *,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, dict[str, str], bytes]:
        req = urllib.request.Request(self.url + path, data=data, headers=headers or {})
        try:
            with self.opener.open(req, timeout=timeout) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def open_page(self) -> str:
        status, _, body = self.request("/")
        assert status == 200, body[:500]
        page = body.decode()
        m = re.search(r'<meta name="csrf-token" content="([^"]+)">', page)
        assert m, page[:500]
        self.csrf = m.group(1)
        return page

    def snapshot(self) -> dict[str, Any]:
        status, _, body = self.request("/api/snapshot")
        assert status == 200, body[:500]
        doc: dict[str, Any] = json.loads(body)
        return doc

    def wait_snapshot(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 20.0
    ) -> dict[str, Any]:
        """The first snapshot for which ``pred`` holds (polled; fails after ``timeout``)."""
        deadline = time.monotonic() + timeout
        doc = self.snapshot()
        while not pred(doc):
            if time.monotonic() > deadline:
                raise AssertionError(f"no snapshot matched in {timeout} s; last: {doc}")
            time.sleep(0.1)
            doc = self.snapshot()
        return doc

    def act(self, action: dict[str, Any], *, csrf: str | None = None) -> tuple[int, Any]:
        status, _, body = self.request(
            "/api/action",
            data=json.dumps(action).encode(),
            headers={
                "Content-Type": "application/json",
                "X-CSRF-Token": self.csrf if csrf is None else csrf,
            },
        )
        return status, json.loads(body)


@pytest.fixture
def viewer() -> Callable[[str], Viewer]:
    return Viewer


class Component:
    """A client process (component.py) with a declared command; SIGKILLed at teardown."""

    def __init__(self, proc: subprocess.Popen[bytes], lname: str) -> None:
        self.proc = proc
        self.lname = lname


@pytest.fixture
def component() -> Iterator[Callable[..., Component]]:
    """``component(socket, group="ZoneMgr", name="zonemgr")``: a component process that
    declares ``get_zone_count``; its lname once it is subscribed."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(socket: str | Path, group: str = "ZoneMgr", name: str = "zonemgr") -> Component:
        script = Path(__file__).with_name("component.py")
        proc = subprocess.Popen(
            [PY, str(script), str(socket), group, name],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = first_line(proc.stdout.fileno(), START_TIMEOUT)
        assert line and line.startswith("l."), f"component did not start: {line!r}"
        return Component(proc, line.strip())

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(15)
        if p.stdout is not None:
            p.stdout.close()
