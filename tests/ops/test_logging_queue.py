"""Logging that never blocks the broker: a bounded queue in front of the destinations,
records dropped and counted when it is full, a notice once there is room again; and
journald's native protocol with the structured fields.

The slow destination is real: a Unix datagram socket bound and not read. Once its
receive queue is full (net.unix.max_dgram_qlen datagrams) every send to it blocks, which
is what a stalled syslog daemon does to a synchronous ``SysLogHandler``.
"""

from __future__ import annotations

import logging
import re
import socket
import struct
import threading
from pathlib import Path

import pytest
import trio

import msgq_trio
from msgq_trio.config import LogSettings
from msgq_trio.ops import logsetup


def journal_fields(datagram: bytes) -> dict[str, str]:
    """Decode one datagram of journald's native protocol (both field forms)."""
    out: dict[str, str] = {}
    i = 0
    while i < len(datagram):
        nl = datagram.index(b"\n", i)
        line = datagram[i:nl]
        if b"=" in line:
            name, _, value = line.partition(b"=")
            out[name.decode()] = value.decode()
            i = nl + 1
        else:
            (n,) = struct.unpack("<Q", datagram[nl + 1 : nl + 9])
            out[line.decode()] = datagram[nl + 9 : nl + 9 + n].decode()
            assert datagram[nl + 9 + n : nl + 10 + n] == b"\n"
            i = nl + 10 + n
    return out


def drain(rx: socket.socket) -> list[str]:
    """Every datagram waiting on ``rx`` now (non-blocking)."""
    out = []
    while True:
        try:
            out.append(rx.recv(65536, socket.MSG_DONTWAIT).decode(errors="replace"))
        except BlockingIOError:
            return out


def test_stalled_syslog_drops_and_counts_then_says_so(short_tmp: Path) -> None:
    """A syslog socket nobody reads and a queue of 5: logging 200 records returns at
    once every time (the caller never waits on the socket); the records the socket and
    the queue cannot hold are dropped and counted; once the socket is read again, the
    next record is preceded by a WARNING naming exactly how many were dropped, and
    every record is either delivered or counted."""
    addr = short_tmp / "log"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(addr))
    prepared = logsetup.prepare(LogSettings(syslog=True, syslog_address=str(addr)), capacity=5)
    assert prepared.problems == []
    logger = logging.getLogger("msgq_trio.test.stalled")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(prepared.front)
    prepared.listener.start()
    try:
        for i in range(200):
            logger.info("record %d", i)
        dropped = prepared.front.dropped
        # The socket holds a few datagrams (net.unix.max_dgram_qlen), the queue 5, the
        # listener one in hand: the rest of the 200 must have been dropped.
        assert dropped > 0
        seen: list[str] = []
        # Reading frees the socket; the listener then empties the queue into it.
        with_after = False
        for _ in range(2000):
            seen += drain(rx)
            if not with_after and sum("record " in s for s in seen) == 200 - dropped:
                logger.info("after the stall")
                with_after = True
            if with_after and any("after the stall" in s for s in seen):
                break
            threading.Event().wait(0.01)
        else:
            raise AssertionError(f"never delivered: {seen[-3:]}")
    finally:
        logger.removeHandler(prepared.front)
        prepared.stop()
        rx.close()
    records = [s for s in seen if "record " in s]
    assert len(records) + dropped == 200 and dropped == prepared.front.dropped
    notice = [s for s in seen if "log records dropped" in s]
    # One notice, or (on a busy machine, when the listener got the socket back for a
    # moment mid-burst) several whose counts add up: every dropped record is counted.
    counts = [int(m.group(1)) for s in notice if (m := re.search(r"(\d+) log records dropped", s))]
    assert notice and len(counts) == len(notice) and sum(counts) == dropped, notice
    assert seen.index(notice[-1]) < next(i for i, s in enumerate(seen) if "after the stall" in s)
    assert all("<28>" in s for s in notice)  # daemon.warning


async def test_broker_answers_while_syslog_is_stalled(
    broker_factory, short_tmp, write_config, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker logging every frame (TRAFFIC) to a syslog socket nobody reads still
    routes 300 messages and answers a ping; the broker's log queue (50 records, set with
    MSGQ_TRIO_LOG_QUEUE_RECORDS) dropped records, and says how many once the socket is
    read again."""
    monkeypatch.setenv(logsetup.QUEUE_RECORDS_ENV, "50")
    addr = short_tmp / "log"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(addr))
    conf = write_config(f"[log]\nsyslog = true\nsyslog_address = '{addr}'\n")
    b = broker_factory("--config", str(conf), log_level="TRAFFIC")
    seen: list[str] = []
    try:
        async with (
            msgq_trio.connect(b.path, name="busy") as bus,
            msgq_trio.connect(b.path, name="sink") as sink,
        ):
            await sink.subscribe("G")
            with trio.fail_after(60):
                for i in range(300):
                    await bus.send("G", i)
                for i in range(300):
                    assert (await sink.receive()).body == i
                assert await bus.call("msgq", "ping") == "pong"
            with trio.fail_after(60):
                while not any("log records dropped" in s for s in seen):
                    seen += drain(rx)
                    await bus.call("msgq", "ping")  # a TRAFFIC line: brings the notice
                    await trio.sleep(0.01)
    finally:
        rx.close()
    notice = next(s for s in seen if "log records dropped" in s)
    assert "the log queue (50 records) was full" in notice
    assert int(notice.split("log records dropped")[0].split()[-1]) > 0


def test_journal_native_protocol_with_fields(short_tmp: Path) -> None:
    """``syslog_address = "journal:PATH"``: one datagram per record in journald's native
    format, MESSAGE (multi-line ones in the length-prefixed form), PRIORITY, facility,
    identifier and the structured fields as MSGQ_* journal fields."""
    addr = short_tmp / "journal"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(addr))
    prepared = logsetup.prepare(LogSettings(syslog=True, syslog_address=f"journal:{addr}"))
    assert prepared.problems == [] and isinstance(prepared.handlers[0], logsetup.JournalHandler)
    logger = logging.getLogger("msgq_trio.test.journal")
    logger.propagate = False
    logger.addHandler(prepared.front)
    prepared.listener.start()
    try:
        logger.warning("dropping %s: slow", "l.7 (name='jx' pid=42 uid=1000)")
        try:
            raise ValueError("two\nlines")
        except ValueError:
            logger.exception("it failed")
    finally:
        logger.removeHandler(prepared.front)
        prepared.stop()
    rx.settimeout(10)
    first = journal_fields(rx.recv(65536))
    second = journal_fields(rx.recv(65536))
    rx.close()
    assert first["PRIORITY"] == "4" and first["SYSLOG_FACILITY"] == "3"
    assert first["SYSLOG_IDENTIFIER"] == "msgq-trio"
    assert (first["MSGQ_LNAME"], first["MSGQ_CLIENT"], first["MSGQ_PID"], first["MSGQ_UID"]) == (
        "l.7",
        "jx",
        "42",
        "1000",
    )
    assert "dropping l.7" in first["MESSAGE"] and first["LOGGER"] == "msgq_trio.test.journal"
    assert second["PRIORITY"] == "3"
    assert "ValueError: two\nlines" in second["MESSAGE"]
