"""Backlog benchmark: a queue holding more than memory, with no consumer, then drained.

``run_backlog(messages, size, workdir)`` starts a broker with the queue plugin (store in
``workdir``, ``sync = true``, default settings otherwise), fills one queue with
``messages`` bodies of ``size`` bytes from one windowed producer (``start_put_many``, as
docs/QUEUE.md teaches) while no consumer is online, SIGKILLs the broker (its plugin dies
with it), starts it again on the same store and times how long it takes to say
``listening`` (the plugin is ready only once its store is open), then drains the queue
with one push consumer (``consume(window=1000)``, acking each message) and checks that
every message arrived once, in order.

Figures: fill and drain msgs/s, store size, the plugin's peak RSS during the fill (its
``VmHWM``) and during the drain (anonymous memory apart from the mapped store file, which
the kernel may drop at any time), restart time with the backlog and with an empty store.

``python -m benchmarks.backlog --messages 4000000 --size 1024`` is the recorded run
(BENCHMARKS.md, "Backlog"); the defaults are a quick one.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

QUEUE = "backlog"
#: Messages per put_many frame and frames in flight: the durable benchmark's choice
#: (one commit per batch, the next batches arriving while one is fsynced).
BATCH = 500
WINDOW = 4
CONSUMER_WINDOW = 1000
_INDEX = struct.Struct(">Q")


def _status(pid: int) -> dict[str, int]:
    """The kB fields of /proc/PID/status (VmHWM, VmRSS, RssAnon, RssFile...)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0])
    return out


def _wait_gone(pid: int, timeout: float = 60.0) -> None:
    """Wait until process ``pid`` (a child of a killed broker, so reaped by init) is
    gone: a restarted plugin waits for its store's lock until then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.005)
    raise RuntimeError(f"plugin {pid} still runs {timeout} s after its broker was killed")


def _plugin_pid(broker_pid: int) -> int:
    """The broker's child process running the queue plugin."""
    for task in os.listdir(f"/proc/{broker_pid}/task"):
        with open(f"/proc/{broker_pid}/task/{task}/children") as f:
            for child in f.read().split():
                with open(f"/proc/{child}/cmdline", "rb") as c:
                    if b"msgq_trio.plugins.host" in c.read():
                        return int(child)
    raise RuntimeError(f"broker {broker_pid} has no plugin process")


class Broker:
    """One broker process with the queue plugin on ``store``; ``start`` returns the
    seconds until it printed ``listening``."""

    def __init__(self, workdir: Path, store: Path) -> None:
        self.sock = workdir / "b.sock"
        self.cfg = workdir / "backlog.toml"
        self.cfg.write_text(
            f'[plugins.queue]\ndir = "{store}"\nsync = true\n[plugins.queue.queues.{QUEUE}]\n'
        )
        self.log_path = workdir / "broker.log"
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 120.0) -> float:
        t0 = time.perf_counter()
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "msgq_trio",
                    "--log-level",
                    "WARNING",
                    "serve",
                    "--socket",
                    str(self.sock),
                    "--config",
                    str(self.cfg),
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        elapsed = time.perf_counter() - t0
        if "listening" not in line:
            raise RuntimeError(f"broker did not start; see {self.log_path}")
        if elapsed > timeout:
            raise RuntimeError(f"broker took {elapsed:.1f} s to start")
        return elapsed

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL the broker; its plugin sees its stdin close and exits (the next
        plugin waits for the store's lock until it has)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self._close()

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.kill()
            self._close()

    def _close(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


async def _fill(sock: Path, messages: int, size: int) -> float:
    from msgq_trio import connect

    pad = b"x" * max(0, size - _INDEX.size)
    async with connect(sock, "backlog-producer") as bus:
        q = bus.queue(QUEUE, producer="backlog-producer")
        await q.prepare()
        waits: collections.deque[Callable[[], Awaitable[Any]]] = collections.deque()
        t0 = time.perf_counter()
        for lo in range(0, messages, BATCH):
            if len(waits) == WINDOW:
                await waits.popleft()()
            hi = min(messages, lo + BATCH)
            waits.append(q.start_put_many([_INDEX.pack(i) + pad for i in range(lo, hi)]))
        while waits:
            await waits.popleft()()
        return time.perf_counter() - t0


async def _drain(sock: Path, messages: int, plugin: int) -> dict[str, Any]:
    from msgq_trio import connect

    peak_anon = peak_rss = 0
    expected = 0
    async with connect(sock, "backlog-consumer") as bus:
        st = await bus.queue(QUEUE).stats()
        if st["depth"] != messages:
            raise RuntimeError(
                f"after the restart the queue holds {st['depth']} messages, not {messages}"
            )
        t0 = time.perf_counter()
        async with bus.queue(QUEUE).consume(window=CONSUMER_WINDOW) as msgs:
            async for m in msgs:
                i = _INDEX.unpack_from(m.body)[0]
                if i != expected:
                    raise RuntimeError(f"message {i} arrived where {expected} was due")
                expected += 1
                await m.ack()
                if expected % 100_000 == 0 or expected == messages:
                    s = _status(plugin)
                    peak_anon = max(peak_anon, s.get("RssAnon", 0))
                    peak_rss = max(peak_rss, s.get("VmRSS", 0))
                if expected == messages:
                    break
        elapsed = time.perf_counter() - t0
        st = await bus.queue(QUEUE).stats()
    return {
        "drain_s": elapsed,
        "drain_msgs_per_s": messages / elapsed,
        "drain_rss_anon_mib": peak_anon / 1024,
        "drain_rss_mib": peak_rss / 1024,
        "depth_after": st["depth"],
    }


def run_backlog(messages: int, size: int, workdir: Path) -> dict[str, Any]:
    """Run the benchmark once; see the module docstring.

    Raises:
        RuntimeError: the broker failed, or a message was lost, duplicated or reordered.
    Resource handling: the broker is stopped on return and ``workdir`` removed.
    """
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    store = workdir / "store"
    broker = Broker(workdir, store)
    try:
        empty_start = broker.start()
        plugin = _plugin_pid(broker.pid)
        fill_s = trio.run(_fill, broker.sock, messages, size)
        fill_status = _status(plugin)
        broker.kill()
        t0 = time.perf_counter()
        _wait_gone(plugin)
        plugin_exit = time.perf_counter() - t0
        store_bytes = (store / "data.mdb").stat().st_size
        restart = broker.start()
        plugin = _plugin_pid(broker.pid)
        drained = trio.run(_drain, broker.sock, messages, plugin)
    finally:
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "messages": messages,
        "size": size,
        "backlog_gib": messages * size / (1 << 30),
        "store_gib": store_bytes / (1 << 30),
        "fill_msgs_per_s": messages / fill_s,
        "fill_peak_rss_mib": fill_status["VmHWM"] / 1024,
        "start_empty_s": empty_start,
        "restart_with_backlog_s": restart,
        "old_plugin_exit_s": plugin_exit,
        **drained,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--workdir", type=Path, default=Path(f"/tmp/msgq-backlog-{os.getpid()}"))
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    res = run_backlog(args.messages, args.size, args.workdir)
    if args.json:
        print(json.dumps(res))
        return 0
    print(
        f"backlog: {res['messages']:,} x {res['size']} B = {res['backlog_gib']:.2f} GiB "
        f"(store file {res['store_gib']:.2f} GiB), no consumer, ack 1 after fsync\n"
        f"  fill            {res['fill_msgs_per_s']:10,.0f} msgs/s, plugin peak RSS "
        f"{res['fill_peak_rss_mib']:.0f} MiB\n"
        f"  restart         {res['restart_with_backlog_s']:.2f} s to listening "
        f"(empty store: {res['start_empty_s']:.2f} s), after the killed broker's "
        f"plugin took {res['old_plugin_exit_s']:.2f} s to exit\n"
        f"  drain           {res['drain_msgs_per_s']:10,.0f} msgs/s, every message once "
        f"and in order; plugin RSS peak {res['drain_rss_mib']:.0f} MiB "
        f"(anonymous {res['drain_rss_anon_mib']:.0f} MiB, the rest the mapped store)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
