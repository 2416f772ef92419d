"""End to end: a broker whose descriptor limit is low (set with prlimit, soft and hard, so
it cannot raise it) under a flood of connects. Established clients keep answering, the
broker survives, and every refused client gets a clear error instead of a hang."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import trio

import msgq_trio
from msgq_trio import Bus
from msgq_trio._procs import cpu_seconds
from msgq_trio.errors import ConnectError

pytestmark = pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit(1)")

NOFILE = 96
FLOOD = 240


async def exchange(left: Bus, right: Bus, rounds: int = 10) -> None:
    with trio.fail_after(10):
        for i in range(rounds):
            await left.send(right.lname, i)
            assert (await right.receive()).body == i
        assert await left.call("Right", "echo", {"still": "alive"}) == {"still": "alive"}


async def test_connect_flood_past_the_descriptor_limit(broker_factory: Any) -> None:
    b = broker_factory(prefix=("prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"))
    log = b.log_with(f"RLIMIT_NOFILE is {NOFILE}", "connections only")
    room = re.search(r"leaves room for (\d+) connections only: .* max_connections=8192", log)
    assert room, log
    capacity = int(room.group(1))
    # What the broker holds before its first client and a margin stay out of the budget.
    assert NOFILE // 2 < capacity < NOFILE - 16, capacity

    async with (
        msgq_trio.connect(b.path, name="left") as left,
        msgq_trio.connect(b.path, name="right") as right,
    ):

        @right.command("echo")
        def echo(params: object) -> object:
            return params

        await right.subscribe("Right")
        await exchange(left, right)

        outcomes: list[str] = []
        held: list[Bus] = []
        release = trio.Event()

        async def one(i: int) -> None:
            try:
                async with msgq_trio.connect(b.path, name=f"flood{i}") as bus:
                    held.append(bus)
                    outcomes.append("connected")
                    await release.wait()
            except ConnectError as exc:
                outcomes.append(f"{exc.code}: {exc}")

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(FLOOD):
                    nursery.start_soon(one, i)
                # While the flood is held open, the established pair still talks.
                while len(outcomes) < FLOOD:
                    await exchange(left, right, rounds=2)
                    await trio.sleep(0.05)
                assert len(held) <= capacity
                await exchange(left, right)
                release.set()

        connected = outcomes.count("connected")
        refused = [o for o in outcomes if o != "connected"]
        assert connected >= capacity // 2, outcomes
        assert refused, "nobody was refused"
        for o in refused:
            # Whose fault and why: the broker's descriptor limit, not a lost connection.
            assert o.startswith("limit-exceeded: ") and "descriptor" in o, o

        # Capacity comes back once the flood is gone.
        with trio.fail_after(10):
            while True:
                try:
                    async with msgq_trio.connect(b.path, name="late") as late:
                        await late.send(right.lname, "late")
                        assert (await right.receive()).body == "late"
                        break
                except ConnectError:
                    await trio.sleep(0.2)
    b.log_with("refusing connection from")
    assert b.proc.poll() is None


#: A process that listens with io.listeners.accept_loop, holds every connection it takes,
#: and then uses up all its descriptors: only the spare is left to take a connection.
_EXHAUSTED = """
import os, resource, socket, sys, trio
from msgq_trio.io.listeners import SpareFd, accept_loop

async def main(path):
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(128)
    listener = trio.SocketListener(sock)

    async def serve(stream, tcp):
        await trio.sleep_forever()

    async def refuse(stream):
        await stream.send_all(b"refused")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_loop, listener, nursery, serve, False, SpareFd(), refuse)
        await trio.sleep(0.2)
        hog = []
        try:
            while True:
                hog.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        print("exhausted", flush=True)
        await trio.sleep_forever()

trio.run(main, sys.argv[1])
"""


def test_out_of_descriptors_every_client_hears_why(short_tmp: Any) -> None:
    """With no descriptor left, each connect is taken on the spare descriptor and told
    why, promptly, instead of waiting in the backlog; the accept loop does not spin."""
    path = str(short_tmp / "x.sock")
    child = subprocess.Popen(
        [sys.executable, "-c", _EXHAUSTED, path], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "exhausted"
        cpu_before = cpu_seconds(child.pid) or 0.0
        answers = []
        for _ in range(20):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(path)
                answers.append(s.recv(64))
        assert answers == [b"refused"] * 20
        # Idle again with no descriptor free: waiting, not retrying accept() in a loop.
        time.sleep(0.5)
        idle_cpu = (cpu_seconds(child.pid) or 0.0) - cpu_before
        assert idle_cpu < 0.06, idle_cpu
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
