"""Socket send buffers (``Limits.socket_send_buffer``, the client's ``send_buffer``): what
the kernel reports for the real sockets of a running broker and client (``ss -xmp``)."""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path

import pytest

import msgq_trio

MiB = 1024 * 1024
WMEM_DEFAULT = int(Path("/proc/sys/net/core/wmem_default").read_text())
WMEM_MAX = int(Path("/proc/sys/net/core/wmem_max").read_text())


def sndbufs(pid: int) -> list[int]:
    """SO_SNDBUF (``tb`` in ``ss -m``) of every connected Unix stream socket of ``pid``."""
    out = subprocess.run(
        ["ss", "-x", "-m", "-p", "state", "established"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # One socket per entry; -p and -m may wrap onto a second line.
    entries = re.split(r"\n(?=u_str)", out)
    return [
        int(m.group(1)) for e in entries if f"pid={pid}," in e and (m := re.search(r"\btb(\d+)", e))
    ]


def expected(asked: int) -> int:
    """What the kernel makes of SO_SNDBUF=asked (0: left alone): doubled, capped."""
    return WMEM_DEFAULT if asked == 0 else 2 * min(asked, WMEM_MAX)


@pytest.mark.parametrize(
    "flags,asked",
    [
        ((), 1 * MiB),
        (("--socket-send-buffer", "0"), 0),
        (("--socket-send-buffer", "262144"), 262144),
    ],
)
async def test_broker_sets_each_client_socket_send_buffer(broker_factory, flags, asked) -> None:
    b = broker_factory(*flags)
    before = sndbufs(b.pid)
    async with msgq_trio.connect(b.path, name="buf", send_buffer=0) as bus:
        await bus.version()  # the connection is accepted and through its handshake
        after = sndbufs(b.pid)
    assert len(after) == len(before) + 1
    new = list(after)
    for v in before:
        new.remove(v)
    assert new == [expected(asked)]


async def test_client_send_buffer(broker) -> None:
    async with msgq_trio.connect(broker.path, name="buf") as bus:
        got = bus._stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert got == expected(msgq_trio.client.bus.SEND_BUFFER)
    async with msgq_trio.connect(broker.path, name="buf", send_buffer=64 * 1024) as bus:
        got = bus._stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        assert got == expected(64 * 1024)
