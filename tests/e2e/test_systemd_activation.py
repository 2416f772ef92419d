"""The broker under systemd: socket activation and readiness notification, with the real
tools standing in for the service manager.

Socket activation runs ``systemd-socket-activate`` (Debian's systemd package): it binds
and listens, waits for the first connection, then execs ``msgq-trio serve`` with the
socket as descriptor 3 (``LISTEN_FDS``/``LISTEN_PID``), as a ``.socket`` unit does. The
first client must be served from that queue. Readiness uses a datagram socket bound by
the test as ``$NOTIFY_SOCKET`` (a path, or an abstract name written ``@name``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from msgq_trio.core.access import hash_token

MSGQ = str(Path(sys.executable).with_name("msgq-trio"))
ACTIVATE = shutil.which("systemd-socket-activate")
#: Generous: a busy machine may take seconds to start an interpreter.
TIMEOUT = 60.0

needs_activate = pytest.mark.skipif(
    ACTIVATE is None,
    reason="systemd-socket-activate not installed (Debian: apt-get install systemd)",
)


def run(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real console script, ``msgq-trio ARGV``."""
    return subprocess.run(
        [MSGQ, *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        stdin=subprocess.DEVNULL,
        env=env,
    )


def wait_for_line(path: Path, needle: str, proc: subprocess.Popen[bytes]) -> None:
    """Wait until the file ``path`` (a child's stderr) contains ``needle``."""
    deadline = time.monotonic() + TIMEOUT
    while needle not in path.read_text(errors="replace"):
        assert proc.poll() is None, f"exited {proc.returncode}:\n{path.read_text()}"
        assert time.monotonic() < deadline, f"no {needle!r} in:\n{path.read_text()}"
        time.sleep(0.02)


@pytest.fixture
def activated(short_tmp: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes the test starts; each is stopped (SIGTERM, then SIGKILL) afterwards."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(15)


@needs_activate
def test_socket_activation_serves_the_first_client(short_tmp: Path, activated) -> None:
    """``systemd-socket-activate -l bus.sock msgq-trio serve -s bus.sock``: the first
    client's connection, made before the broker exists, is answered (pong); the broker
    serves the inherited socket instead of refusing it as "already running", leaves
    the socket file to the manager at exit, and exits 0 on SIGTERM."""
    sock = short_tmp / "bus.sock"
    log = short_tmp / "activate.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [ACTIVATE or "", "-l", str(sock), MSGQ, "serve", "-s", str(sock)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    activated.append(proc)
    wait_for_line(log, "Listening on", proc)  # bound and listening; no broker yet
    first = run("call", "-s", str(sock), "msgq", "ping")
    assert (first.returncode, first.stdout.strip()) == (0, '"pong"'), (first, log.read_text())
    second = run("call", "-s", str(sock), "msgq", "ping")
    assert second.stdout.strip() == '"pong"', second
    proc.send_signal(signal.SIGTERM)  # exec'd: the activator's pid is the broker's
    assert proc.wait(TIMEOUT) == 0, log.read_text()
    text = log.read_text()
    assert "already running" not in text and "Traceback" not in text, text
    assert sock.is_socket(), "the broker removed the socket file the manager owns"


@needs_activate
def test_socket_activation_of_a_tcp_listener(short_tmp: Path, activated) -> None:
    """A ``.socket`` unit with a Unix path and a TCP port: both are served; the TCP one
    with the configuration's tokens (here plain TCP on loopback, ``tcp.insecure``). The
    command line reaches it with ``-s tcp://...`` and ``--token`` after the subcommand."""
    with socket.socket() as probe:  # a free port for the activator to bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token = "cli-token-8c1e5a"
    conf = short_tmp / "broker.toml"
    conf.write_text(f'[tcp]\ninsecure = true\ntokens = {{ cli = "{hash_token(token)}" }}\n')
    sock = short_tmp / "bus.sock"
    log = short_tmp / "activate.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [
                ACTIVATE or "",
                "-l",
                str(sock),
                "-l",
                f"127.0.0.1:{port}",
                MSGQ,
                "serve",
                "-s",
                str(sock),
                "--config",
                str(conf),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            stdin=subprocess.DEVNULL,
        )
    activated.append(proc)
    wait_for_line(log, f"127.0.0.1:{port}", proc)
    r = run("call", "msgq", "ping", "-s", f"tcp://127.0.0.1:{port}", "--token", token)
    assert (r.returncode, r.stdout.strip()) == (0, '"pong"'), (r, log.read_text())
    r = run("call", "-s", str(sock), "msgq", "ping")
    assert r.stdout.strip() == '"pong"', r
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(TIMEOUT) == 0, log.read_text()


def _notify_socket(short_tmp: Path, abstract: bool) -> tuple[socket.socket, str]:
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"msgq-trio-test-{os.getpid()}-{short_tmp.name}"
        rx.bind("\0" + name)
        return rx, "@" + name
    rx.bind(str(short_tmp / "notify"))
    return rx, str(short_tmp / "notify")


def _receive(rx: socket.socket) -> dict[str, str]:
    rx.settimeout(TIMEOUT)
    data = rx.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.split("\n") if line)


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_ready_after_listeners_and_plugins_then_watchdog_and_stopping(
    short_tmp: Path, abstract: bool
) -> None:
    """With ``NOTIFY_SOCKET``: ``READY=1`` (with MAINPID and STATUS) arrives only when
    the socket accepts clients and the queue plugin already answers on its group; then
    ``WATCHDOG=1`` pings (``WATCHDOG_USEC``); SIGTERM sends ``STOPPING=1`` and the
    broker exits 0. Nothing arrives before READY=1 except nothing at all."""
    rx, address = _notify_socket(short_tmp, abstract)
    sock = short_tmp / "bus.sock"
    env = {
        **os.environ,
        "NOTIFY_SOCKET": address,
        "WATCHDOG_USEC": "200000",
        "STATE_DIRECTORY": str(short_tmp / "state"),
    }
    log = short_tmp / "broker.log"
    with rx, open(log, "wb") as err:
        proc = subprocess.Popen(
            [MSGQ, "serve", "-s", str(sock), "--plugin", "queue"],
            stdout=subprocess.DEVNULL,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        try:
            first = _receive(rx)
            assert first.get("READY") == "1", first
            assert first["MAINPID"] == str(proc.pid) and "serving" in first["STATUS"]
            # Ready means: a client connects at once, and the plugin already answers.
            members = run("members", "--json", "-s", str(sock), "msgq-queue")
            assert members.returncode == 0, members
            assert '"lname"' in members.stdout, f"no queue plugin at READY: {members.stdout}"
            pings = [_receive(rx) for _ in range(2)]
            assert all(p == {"WATCHDOG": "1"} for p in pings), pings
            proc.send_signal(signal.SIGTERM)
            msgs = [_receive(rx)]
            while "STOPPING" not in msgs[-1]:
                msgs.append(_receive(rx))
            assert proc.wait(TIMEOUT) == 0, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(TIMEOUT)
    assert "Traceback" not in log.read_text()


def test_without_notify_socket_nothing_is_sent(broker_factory) -> None:
    """Without ``NOTIFY_SOCKET`` (an ordinary start) the broker starts and serves as
    before: the notifier does nothing, and no warning about it is logged."""
    b = broker_factory()
    assert "notify" not in b.log().lower()
