"""Logging: structured identity fields on every line about a client, a JSON log file,
per-frame TRAFFIC lines, syslog through a real datagram socket and its fallback, and
uncaught exceptions going through logging."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import trio
from ops_helpers import wait_for

import msgq_trio
from msgq_trio.config import LogSettings
from msgq_trio.ops import logsetup
from msgq_trio.protocol.codes import FrameType


def json_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_dropped_clients_are_logged_with_identity(
    broker_factory, raw_peer, short_tmp
) -> None:
    """With ``--log-file`` and ``--log-format json``: a client dropped for a protocol
    violation and a connection that never says HELLO are logged with lname, client name,
    pid and uid as fields; at level TRAFFIC every frame gets a line; nothing goes to
    stderr."""
    log_file = short_tmp / "broker.jsonl"
    b = broker_factory(
        "--log-file",
        str(log_file),
        "--log-format",
        "json",
        "--handshake-timeout",
        "0.3",
        log_level="TRAFFIC",
    )
    async with msgq_trio.connect(b.path, name="bystander") as bus:
        await bus.send("Nobody", {"hello": 1})
        async with raw_peer(b.path) as raw:
            assert (await raw.hello("vandal")).type == FrameType.WELCOME
            await raw.send_bytes(b"\x00\x00\x00\x1c" + b"\xee" * 28)
            await raw.frames_until_eof(timeout=5)
        async with raw_peer(b.path) as silent:
            assert await silent.frames_until_eof(timeout=5) == []

        def find(pred: Any) -> dict[str, Any] | None:
            return next((r for r in json_lines(log_file) if pred(r)), None)

        drop = await wait_for(lambda: find(lambda r: "protocol violation" in r["msg"]))
        assert drop["level"] == "WARNING"
        assert (drop["lname"], drop["client"]) == (raw.lname, "vandal")
        assert (drop["pid"], drop["uid"]) == (os.getpid(), os.getuid())
        silent_drop = await wait_for(lambda: find(lambda r: "no HELLO" in r["msg"]))
        assert (silent_drop["pid"], silent_drop["uid"]) == (os.getpid(), os.getuid())
        traffic = find(
            lambda r: (
                r["logger"] == "msgq_trio.traffic"
                and r.get("lname") == bus.lname
                and "Nobody" in r["msg"]
            )
        )
        assert traffic is not None and traffic["level"] == "TRAFFIC"
        assert "message" in traffic["msg"] and "no-recipient" in traffic["msg"]
    assert b.log() == ""


async def test_syslog_through_a_real_datagram_socket(
    broker_factory, short_tmp, write_config
) -> None:
    """``[log] syslog = true`` sends RFC 3164 datagrams (facility daemon) with the
    structured fields to the syslog socket."""
    addr = short_tmp / "log"
    rx = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await rx.bind(str(addr))
    conf = write_config(f"[log]\nsyslog = true\nsyslog_address = '{addr}'\n")
    b = broker_factory("--config", str(conf))
    async with msgq_trio.connect(b.path, name="viaslog"):
        pass
    seen = []
    with trio.fail_after(10):
        while not any("listening on" in s for s in seen):
            seen.append((await rx.recv(65536)).decode())
    line = next(s for s in seen if "listening on" in s)
    assert line.startswith(f"<{3 * 8 + 6}>msgq-trio[{b.pid}]: ")  # daemon.info
    rx.close()
    assert b.log() == ""


async def test_missing_syslog_socket_falls_back_to_stderr(
    broker_factory, short_tmp, write_config
) -> None:
    """No syslog socket: one clear line on stderr, then the log continues on stderr."""
    conf = write_config(f"[log]\nsyslog = true\nsyslog_address = '{short_tmp}/absent'\n")
    b = broker_factory("--config", str(conf))
    await wait_for(lambda: "listening on" in b.log())
    log = b.log()
    assert "does not exist" in log and "logging to stderr instead" in log
    assert "Traceback" not in log


def test_uncaught_exceptions_go_through_logging(tmp_path: Path, capsys: Any) -> None:
    """After install_exception_hooks, an exception escaping a thread or reaching the top
    level is written to the configured log with its traceback, not to stderr."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, sys.excepthook, threading.excepthook)
    log_file = tmp_path / "x.log"
    try:
        logsetup.configure(LogSettings(file=str(log_file)))
        logsetup.install_exception_hooks()

        def boom() -> None:
            raise RuntimeError("kaboom in a thread")

        t = threading.Thread(target=boom, name="worker-7")
        t.start()
        t.join()
        try:
            raise ValueError("kaboom at the top")
        except ValueError:
            sys.excepthook(*sys.exc_info())  # what the interpreter does at the top level
    finally:
        logsetup.shutdown()  # writes out the log queue before the file is read
        for h in list(root.handlers):
            if h not in saved[0]:
                root.removeHandler(h)
                h.close()
        root.setLevel(saved[1])
        sys.excepthook, threading.excepthook = saved[2], saved[3]
        logging.captureWarnings(False)
    text = log_file.read_text()
    assert "uncaught exception in thread worker-7" in text and "kaboom in a thread" in text
    assert "uncaught exception" in text and "kaboom at the top" in text
    assert "Traceback" in text
    assert "kaboom" not in capsys.readouterr().err


def test_identity_filter_reads_describe_strings() -> None:
    """Lines that name a client with Peer.describe() get the fields, names with quotes
    included."""
    rec = logging.LogRecord(
        "x",
        logging.WARNING,
        __file__,
        1,
        "dropping client %s: %s",
        ('l.12 (name="it\'s" pid=42 uid=1000)', "why"),
        None,
    )
    logsetup.IdentityFilter().filter(rec)
    assert (rec.lname, rec.client, rec.pid, rec.uid) == (  # type: ignore[attr-defined]
        "l.12",
        "it's",
        42,
        1000,
    )
    text = logsetup.TextFormatter().format(rec)
    assert text.endswith('[lname=l.12 client="it\'s" pid=42 uid=1000]')
