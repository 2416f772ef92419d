"""``limits.busy_poll``: after a read the broker polls instead of sleeping for that long, and
then stops. Measured on a real broker process through its CPU time (``/proc/PID/stat``)
and its ``stats`` counter; calls through it are tested in test_e2e_direct.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

import msgq_trio

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (clock-tick resolution, 10 ms here)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def cpu_during(pid: int, seconds: float) -> float:
    before = cpu_seconds(pid)
    await trio.sleep(seconds)
    return cpu_seconds(pid) - before


async def poke(bus: msgq_trio.Bus) -> None:
    """One read by the broker: a round trip it answers itself."""
    await bus.version()


async def test_busy_poll_spins_after_a_read_then_sleeps(broker_factory) -> None:
    b = broker_factory("--busy-poll", "0.8")
    async with msgq_trio.connect(b.path, name="poller") as bus:
        await trio.sleep(1.0)  # the handshake's window is over
        assert await cpu_during(b.pid, 0.5) < 0.1  # idle: asleep
        passes = (await bus.call("msgq", "stats"))["busy_poll_passes"]
        await poke(bus)
        # Within the window the broker runs without sleeping: most of a core.
        assert await cpu_during(b.pid, 0.6) >= 0.2
        await trio.sleep(0.5)  # past 0.8 s after the last read
        assert await cpu_during(b.pid, 0.5) < 0.1
        assert (await bus.call("msgq", "stats"))["busy_poll_passes"] > passes + 100


async def test_busy_poll_off_by_default_and_set_at_runtime(broker_factory) -> None:
    b = broker_factory()
    async with msgq_trio.connect(b.path, name="poller") as bus:
        for _ in range(20):
            await poke(bus)
        assert await cpu_during(b.pid, 0.4) < 0.1
        assert (await bus.call("msgq", "stats"))["busy_poll_passes"] == 0
        r = await bus.call("msgq", "config-set", {"key": "limits.busy_poll", "value": 0.8})
        assert r["changed"][0]["applies"] == "now"
        await poke(bus)
        assert await cpu_during(b.pid, 0.6) >= 0.2
        with pytest.raises(msgq_trio.RemoteError, match="busy_poll must be at most 1 s"):
            await bus.call("msgq", "config-set", {"key": "limits.busy_poll", "value": 5})
