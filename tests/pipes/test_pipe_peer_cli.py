"""The acceptance of pipes across brokers, with the command line: two brokers on this
machine (separate processes, each on its own Unix socket) started as ``msgq-trio serve
-s A --plugin pipe --pipe-peer B`` and the other way round; ``msgq-trio pipe write`` on
one, ``msgq-trio pipe read`` on the other; SIGKILL of the writer's broker mid-transfer;
``msgq-trio pipe ls GLOB``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from peer_helpers import wait_connected

MiB = 1 << 20
CLI = [sys.executable, "-m", "msgq_trio"]


def two_brokers(broker_factory: Callable[..., Any], short_tmp: Path) -> list[Any]:
    a, b = short_tmp / "A.sock", short_tmp / "B.sock"
    brokers = [
        broker_factory("--plugin", "pipe", "--pipe-peer", str(b), path=a),
        broker_factory("--plugin", "pipe", "--pipe-peer", str(a), path=b),
    ]
    trio.run(wait_connected, [a, b])
    return brokers


def pipe_cli(action: str, name: str, socket: Path, **kw: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*CLI, "pipe", action, name, "-s", str(socket)], stderr=subprocess.PIPE, **kw
    )


@pytest.mark.parametrize("first", ["reader", "writer"])
def test_cli_copy_across_two_brokers(
    broker_factory: Callable[..., Any], short_tmp: Path, first: str
) -> None:
    """8 MiB through ``pipe write NAME -s A < file`` and ``pipe read NAME -s B > copy``
    (either started first): the copy is identical, both exit 0."""
    a, b = two_brokers(broker_factory, short_tmp)
    src, dst = short_tmp / "in", short_tmp / "copy"
    data = os.urandom(8 * MiB)
    src.write_bytes(data)
    for name in ("acc-1", "acc-2"):  # two names: at least one homed on each side, likely
        with src.open("rb") as fin, dst.open("wb") as fout:
            if first == "reader":
                r = pipe_cli("read", name, b.path, stdout=fout)
                time.sleep(0.3)
                w = pipe_cli("write", name, a.path, stdin=fin)
            else:
                w = pipe_cli("write", name, a.path, stdin=fin)
                time.sleep(0.3)
                r = pipe_cli("read", name, b.path, stdout=fout)
            assert w.wait(60) == 0, w.stderr.read() if w.stderr else ""
            assert r.wait(60) == 0, r.stderr.read() if r.stderr else ""
            for p in (w, r):
                assert p.stderr is not None
                p.stderr.close()
        assert dst.read_bytes() == data


def test_cli_reader_fails_when_the_writers_broker_is_killed(
    broker_factory: Callable[..., Any], short_tmp: Path
) -> None:
    """64 MiB flow from a writer on A to ``pipe read`` on B; A is SIGKILLed mid-way: the
    reader exits 1 with a pipe-broken error within moments (Unix sockets: the broken
    connection is seen at once), and what it wrote out is a prefix of the input --
    nothing after the gap passes as contiguous."""
    a, b = two_brokers(broker_factory, short_tmp)
    src, dst = short_tmp / "in", short_tmp / "copy"
    data = os.urandom(64 * MiB)
    src.write_bytes(data)
    with src.open("rb") as fin, dst.open("wb") as fout:
        r = pipe_cli("read", "big", b.path, stdout=fout)
        w = pipe_cli("write", "big", a.path, stdin=fin)
        deadline = time.monotonic() + 60
        while dst.stat().st_size < 8 * MiB:
            assert time.monotonic() < deadline and r.poll() is None
            time.sleep(0.01)
        a.expect_exit = True
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
        t0 = time.monotonic()
        assert r.wait(10) == 1
        assert time.monotonic() - t0 < 5
        assert r.stderr is not None
        err = r.stderr.read().decode()
        r.stderr.close()
        assert "pipe-broken" in err, err
        w.wait(10)
        assert w.stderr is not None
        w.stderr.close()
    out = dst.read_bytes()
    assert 8 * MiB <= len(out) < len(data)
    assert out == data[: len(out)]


def test_pipe_ls_shows_ends_and_their_brokers(
    broker_factory: Callable[..., Any], short_tmp: Path
) -> None:
    """``msgq-trio pipe ls "list*"`` on either broker lists the pipe once, on its home, with a
    reader on B and a writer on A."""
    a, b = two_brokers(broker_factory, short_tmp)
    r = pipe_cli("read", "listed", b.path, stdout=subprocess.DEVNULL)
    w = pipe_cli("write", "listed", a.path, stdin=subprocess.PIPE)
    try:
        node_a, node_b = (f"{os.uname().nodename}:{x.path}" for x in (a, b))
        for socket in (a.path, b.path):
            deadline = time.monotonic() + 20
            while True:
                out = subprocess.run(
                    [*CLI, "pipe", "ls", "list*", "-s", str(socket)],
                    capture_output=True,
                    check=True,
                ).stdout.decode()
                rows = [ln for ln in out.splitlines() if ln.startswith("listed ")]
                if rows and f"r@{node_b}" in rows[0] and f"w@{node_a}" in rows[0]:
                    break
                assert time.monotonic() < deadline, out
                time.sleep(0.1)
            assert len(rows) == 1, out
    finally:
        assert w.stdin is not None
        w.stdin.close()
        assert w.wait(20) == 0
        assert r.wait(20) == 0
        for p in (w, r):
            assert p.stderr is not None
            p.stderr.close()
