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
    """User + system CPU time of ``pid`` so far (resolution: one clock tick, ``TICK``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def cpu_during(pid: int, seconds: float) -> float:
    before = cpu_seconds(pid)
    await trio.sleep(seconds)
    return cpu_seconds(pid) - before


async def poke(bus: msgq_trio.Bus) -> None:
    """One read by the broker: a round trip it answers itself."""
    await bus.version()


MULTI_CPU = len(os.sched_getaffinity(0)) > 1
needs_two_cpus = pytest.mark.skipif(not MULTI_CPU, reason="busy polling is off on one CPU")


async def stats(bus: msgq_trio.Bus) -> dict[str, object]:
    return await bus.call("msgq", "stats")  # type: ignore[no-any-return]


@needs_two_cpus
async def test_busy_poll_spins_while_reads_come_close_then_sleeps(broker_factory) -> None:
    """Reads 0.3 s apart (within the 0.8 s limit): from the second short gap in a row the
    window grows (0.2, then 0.4 s, which catches them); the broker then spins after a
    read (its poll passes climb), and sleeps once no read came for the window (no pass,
    next to no CPU time). Every call is a read, stats included.

    Nothing here depends on how much CPU a busy machine gives the broker: passes are
    counted, not CPU time, and only an idle broker's CPU time is bounded (from above)."""
    b = broker_factory("--busy-poll", "0.8")
    async with msgq_trio.connect(b.path, name="poller") as bus:
        await trio.sleep(1.0)  # the handshake's reads are long past
        assert await cpu_during(b.pid, 0.5) < 0.1  # idle: asleep
        for _ in range(4):
            await poke(bus)
            await trio.sleep(0.3)
        st = await stats(bus)
        # 0.4 s; 0.8 s if the stats call came after the window closed on a slow machine
        # (a read the polling did not catch is a third short gap).
        assert st["busy_poll_window"] in (pytest.approx(0.4), pytest.approx(0.8))
        await poke(bus)
        # Within the window the broker runs without sleeping: pass after pass. Each
        # stats call is a read that keeps the window open, so a busy machine that gives
        # the broker little CPU only makes this take longer; a broker that sleeps makes
        # no pass at all.
        with trio.fail_after(20):
            for _ in range(10_000):  # polled: the count lives in the broker
                if (await stats(bus))["busy_poll_passes"] > st["busy_poll_passes"] + 100:
                    break
                await trio.sleep(0.05)
        await trio.sleep(1.0)  # past the window after the last read
        quiet = (await stats(bus))["busy_poll_passes"]
        assert await cpu_during(b.pid, 0.5) < 0.1
        assert (await stats(bus))["busy_poll_passes"] == quiet


@needs_two_cpus
async def test_busy_poll_stops_for_reads_spaced_wider_than_the_limit(broker_factory) -> None:
    """Reads 0.5 s apart (the limit is 0.2 s): polling after them would be wasted, so the
    window shrinks to 0 and the broker sleeps between them. Every call is a read, stats
    included, so stats are read 0.5 s after the last call too."""
    b = broker_factory("--busy-poll", "0.2")
    async with msgq_trio.connect(b.path, name="poller") as bus:
        for _ in range(3):  # reads close together: the window opens
            await poke(bus)
        assert (await stats(bus))["busy_poll_window"] > 0
        for _ in range(3):
            await trio.sleep(0.5)
            await poke(bus)
        await trio.sleep(0.5)
        st = await stats(bus)
        assert st["busy_poll_window"] == 0
        for _ in range(3):
            await trio.sleep(0.5)
            await poke(bus)
        await trio.sleep(0.5)
        assert (await stats(bus))["busy_poll_passes"] == st["busy_poll_passes"]


@needs_two_cpus
async def test_busy_poll_stays_closed_for_calls_paced_apart(broker_factory) -> None:
    """Calls paced apart give the broker pairs of reads: one after a long gap, one right
    after it. A single short gap does not open the window (two in a row do), so the
    broker never polls for such traffic."""
    b = broker_factory("--busy-poll", "0.2")
    async with msgq_trio.connect(b.path, name="poller") as bus:
        await trio.sleep(0.5)
        st = await stats(bus)
        for _ in range(4):
            await trio.sleep(0.5)
            await poke(bus)  # after a long gap: the window closes
            await poke(bus)  # one short gap
        await trio.sleep(0.5)
        after = await stats(bus)
        assert after["busy_poll_passes"] == st["busy_poll_passes"]
        assert after["busy_poll_window"] == 0


async def test_busy_poll_on_by_default_and_set_at_runtime(broker_factory) -> None:
    """On by default (200 us) where the broker has two CPUs or more (off on one, and the
    log says so); set at runtime, a limit takes effect at once: 1 s (the largest allowed)
    makes back-to-back calls open the window, 0 closes it and no pass follows; more than
    1 s is refused.

    Whether reads come within 200 us of each other depends on how busy the machine is,
    so the default limit's effect is not asserted here (test_e2e_direct.py measures calls
    through it); 1 s separates back-to-back calls from the limit by a wide margin."""
    b = broker_factory()
    async with msgq_trio.connect(b.path, name="poller") as bus:
        assert await bus.call("msgq", "config-get", {"key": "limits.busy_poll"}) == 0.0002
        off_line = "busy polling off: this broker may run on one CPU only"
        assert (off_line in b.log()) == (not MULTI_CPU)
        r = await bus.call("msgq", "config-set", {"key": "limits.busy_poll", "value": 1.0})
        assert r["changed"][0]["applies"] == "now"
        for _ in range(20):
            await poke(bus)
        st = await stats(bus)
        if MULTI_CPU:
            assert st["busy_poll_passes"] > 0 and st["busy_poll_window"] > 0
        else:
            assert st["busy_poll_passes"] == 0
        r = await bus.call("msgq", "config-set", {"key": "limits.busy_poll", "value": 0})
        assert r["changed"][0]["applies"] == "now"
        passes = (await stats(bus))["busy_poll_passes"]
        for _ in range(200):
            await poke(bus)
        assert (await stats(bus))["busy_poll_passes"] == passes
        assert (await stats(bus))["busy_poll_window"] == 0
        with pytest.raises(msgq_trio.RemoteError, match="busy_poll must be at most 1 s"):
            await bus.call("msgq", "config-set", {"key": "limits.busy_poll", "value": 5})
