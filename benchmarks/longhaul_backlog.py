"""Long-haul backlog run: a durable queue's backlog of GIB gibibytes built on a disk that
forgets what was not synced, then drained through plugin and broker SIGKILLs, each
followed by a power loss; no acked message may be lost.

``python -m benchmarks.longhaul_backlog --gib 4`` is the recorded run (docs/FAULTS.md,
"Long-haul runs"); tests/test_scenario_longhaul.py runs it with a few MiB.

Why a script and not a scenario: the store lives on the power-loss file system of
tests/storage/powerloss_fs.py (a FUSE daemon whose memory is the disk's volatile cache:
a power loss SIGKILLs it and detaches the mount, and every write not fsynced is gone),
which is test code, not part of the package the scenario runner ships in; and each kill
here is a sequence the runner has no action for (kill, power loss, remount, restart).

The run:

1. mount the power-loss disk, start a broker with the queue plugin on it (``sync =
   true``: a put is acked once its commit is fsynced);
2. fill: one windowed producer puts ``--size``-byte messages (``put_many`` batches)
   until GIB GiB are acked, no consumer online; each message is a history operation
   (``send`` invoke, ``ok`` when its batch is acked: msgq_trio/scenario/history.py);
3. drain: one push consumer records each delivery (``deliver``, with its session) and
   acks it; after each tenth of the backlog, alternately: the plugin is SIGKILLed (the
   broker SIGSTOPped meanwhile, so that its supervisor restarts the plugin only on the
   remounted disk), or the broker is SIGKILLed and restarted; either way a power loss
   and a remount come between the kill and the restart. The consumer reconnects or
   re-attaches (a new session) and goes on;
4. the history checker: every acked ``send`` delivered (``lost``), none twice within
   a session (a redelivery after a crash is at-least-once); the queue empty at the end.

Figures (``--json``): bytes and messages acked and delivered, redeliveries, kills by
kind, the store's size, fill and drain time, the plugin's and the broker's peak RSS.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from benchmarks.backlog import QUEUE, Broker, _plugin_pid, _status, _wait_gone

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "storage"))
# Test code outside the typed packages: imported by name at run time.
_powerloss: Any = importlib.import_module("powerloss_fs")
PowerLossDisk = _powerloss.PowerLossDisk
fuse_missing = _powerloss.fuse_missing

from msgq_trio.errors import ConnectError, ConnectionLost, RpcError  # noqa: E402
from msgq_trio.scenario.history import Recorder, check, merge, parse  # noqa: E402

GiB = 1 << 30
#: Messages per put_many frame, frames in flight (a batch is one commit, one fsync).
BATCH = 4
WINDOW = 8
CONSUMER_WINDOW = 64
#: Seconds without a delivery after which a drained queue is checked for emptiness.
IDLE = 2.0
#: Seconds without a delivery, messages still missing, after which the drain gives up
#: (the store lost them: the history checker names them).
STALL = 120.0
PRODUCER = "backlog"


class History:
    """One process's operations as JSON lines in ``path`` (msgq_trio/scenario/history.py)."""

    def __init__(self, path: Path, process: str) -> None:
        self.rec = Recorder(process)
        self.out = open(path, "a")  # noqa: SIM115 - closed by close()

    def invoke(self, f: str, **fields: Any) -> int:
        op_id, line = self.rec.invoke(f, time.monotonic(), **fields)
        self.out.write(line + "\n")
        return op_id

    def complete(self, op_id: int, type_: str, f: str, **fields: Any) -> None:
        self.out.write(self.rec.complete(op_id, type_, f, time.monotonic(), **fields) + "\n")

    def event(self, f: str, **fields: Any) -> None:
        self.out.write(self.rec.event(f, time.monotonic(), **fields) + "\n")

    def close(self) -> None:
        self.out.close()


class Run:
    """The broker, its disk and the figures of one run."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.disk = PowerLossDisk(workdir / "disk")
        self.broker: Broker | None = None
        self.kills: collections.Counter[str] = collections.Counter()
        self.peak_plugin_kib = 0
        self.peak_broker_kib = 0
        #: seconds from power loss to a remounted disk with the store read back
        self.remount_s: list[float] = []

    def power_cycle(self) -> None:
        """Power loss, remount, and the store's files read once through the new mount:
        the daemon loads a file's durable image on first access (for a 4 GiB store,
        longer than a plugin may take to start), so it happens here, timed apart."""
        t0 = time.monotonic()
        self.disk.power_loss()
        self.disk.mount()
        store = self.disk.mountpoint / "store"
        for f in sorted(store.iterdir()) if store.is_dir() else []:
            if f.is_file():
                with open(f, "rb") as fh:
                    fh.read(1)
        self.remount_s.append(time.monotonic() - t0)

    def start(self) -> None:
        self.disk.mount()
        self.broker = Broker(self.workdir, self.disk.mountpoint / "store")
        self.broker.start()

    def sample(self) -> None:
        """Peak RSS so far (VmHWM of the broker and its current plugin)."""
        assert self.broker is not None
        try:
            self.peak_broker_kib = max(self.peak_broker_kib, _status(self.broker.pid)["VmHWM"])
            plugin = _plugin_pid(self.broker.pid)
            self.peak_plugin_kib = max(self.peak_plugin_kib, _status(plugin)["VmHWM"])
        except (OSError, RuntimeError, KeyError):
            pass  # between a kill and a restart

    def kill_plugin(self) -> None:
        """SIGKILL the plugin with the broker stopped, power loss, remount, SIGCONT: the
        supervisor restarts the plugin on what the disk kept."""
        assert self.broker is not None
        self.sample()
        plugin = _plugin_pid(self.broker.pid)
        os.kill(self.broker.pid, signal.SIGSTOP)
        try:
            os.kill(plugin, signal.SIGKILL)
            _wait_gone(plugin)
            self.power_cycle()
        finally:
            os.kill(self.broker.pid, signal.SIGCONT)
        self.kills["plugin"] += 1
        # The next kill must find the restarted plugin.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if _plugin_pid(self.broker.pid) != plugin:
                    return
            except (OSError, RuntimeError):
                pass
            time.sleep(0.05)
        raise RuntimeError("the broker did not restart its queue plugin within 120 s")

    def kill_broker(self) -> None:
        """SIGKILL the broker (its plugin exits with it), power loss, remount, restart."""
        assert self.broker is not None
        self.sample()
        plugin = _plugin_pid(self.broker.pid)
        self.broker.kill()
        _wait_gone(plugin)
        self.power_cycle()
        self.broker.start()
        self.kills["broker"] += 1

    def close(self) -> None:
        if self.broker is not None:
            self.broker.stop()
        self.disk.power_loss()


async def fill(run: Run, target_bytes: int, size: int, history: Path) -> int:
    """Put ``size``-byte messages until ``target_bytes`` are acked; returns how many."""
    from msgq_trio import connect

    assert run.broker is not None
    h = History(history, "producer")
    n = target_bytes // size
    pad = b"x" * (size - 16)
    async with connect(run.broker.sock, "backlog-producer") as bus:
        q = bus.queue(QUEUE, producer=PRODUCER)
        await q.prepare()
        waits: collections.deque[tuple[Callable[[], Awaitable[Any]], list[tuple[int, str]]]]
        waits = collections.deque()

        async def settle_one() -> None:
            wait, ops = waits.popleft()
            await wait()
            for op, key in ops:
                h.complete(op, "ok", "send", key=key)

        for lo in range(1, n + 1, BATCH):
            if len(waits) == WINDOW:
                await settle_one()
            seqs = range(lo, min(n, lo + BATCH - 1) + 1)
            ops = [
                (
                    h.invoke("send", key=f"{PRODUCER}:{s}", producer=PRODUCER, seq=s),
                    f"{PRODUCER}:{s}",
                )
                for s in seqs
            ]
            bodies = [s.to_bytes(16, "big") + pad for s in seqs]
            waits.append((q.start_put_many(bodies, first_seq=lo), ops))
            if lo % (BATCH * 256) == 1:
                run.sample()
        while waits:
            await settle_one()
    h.close()
    return n


async def drain(run: Run, n: int, kills: int, history: Path) -> int:
    """Consume until all ``n`` messages were seen and the queue is empty (what a killed
    session had not acked comes again), killing after each ``n / (kills + 1)`` (plugin
    first, then broker, alternately); returns the deliveries."""
    from msgq_trio import connect

    assert run.broker is not None
    h = History(history, "consumer")
    seen: set[int] = set()
    deliveries = 0
    marks = [n * (k + 1) // (kills + 1) for k in range(kills)]
    # Fewer unacked deliveries than messages between two kills: each kill finds most of
    # its share still in the store (what the consumer holds, it has read already).
    window = max(1, min(CONSUMER_WINDOW, n // (kills + 1) // 4))
    connection = 0

    def quiet() -> float:
        """The deadline of the next delivery: IDLE once all were seen, else STALL."""
        return trio.current_time() + (IDLE if len(seen) >= n else STALL)

    while True:
        try:
            async with connect(run.broker.sock, "backlog-consumer") as bus:
                connection += 1
                with trio.CancelScope(deadline=quiet()) as idle:
                    async with bus.queue(QUEUE).consume(window=window) as msgs:
                        async for m in msgs:
                            seq = int.from_bytes(m.body[:16], "big")
                            deliveries += 1
                            h.event(
                                "deliver",
                                key=f"{PRODUCER}:{seq}",
                                producer=PRODUCER,
                                seq=seq,
                                value={"session": f"{connection}.{msgs.reattached}"},
                            )
                            seen.add(seq)
                            await m.ack()
                            if marks and len(seen) >= marks[0]:
                                marks.pop(0)
                                h.out.flush()
                                which = sum(run.kills.values()) % 2
                                kill = run.kill_plugin if which == 0 else run.kill_broker
                                await trio.to_thread.run_sync(kill)
                            idle.deadline = quiet()
                if idle.cancelled_caught and len(seen) < n:
                    break  # nothing more comes: the rest was lost
                if len(seen) >= n and not marks:
                    st = await bus.queue(QUEUE).stats()
                    if st["depth"] == 0:
                        break
        except (ConnectionLost, ConnectError, RpcError, OSError):
            await trio.sleep(0.1)
    h.close()
    return deliveries


async def depth(run: Run) -> int:
    from msgq_trio import connect

    assert run.broker is not None
    async with connect(run.broker.sock, "backlog-probe") as bus:
        return int((await bus.queue(QUEUE).stats())["depth"])


def run_longhaul(
    gib: float, size: int, kills: int, workdir: Path, *, keep: bool = False
) -> dict[str, Any]:
    """Run once; see the module docstring. Raises RuntimeError when FUSE cannot run.

    Resource handling: ``workdir`` is emptied first and removed at the end (unless
    ``keep``); the broker is stopped and the disk unmounted, also on an error."""
    why = fuse_missing()
    if why is not None:
        raise RuntimeError(f"the power-loss disk needs FUSE: {why}")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    history = workdir / "history"
    history.mkdir(exist_ok=True)
    run = Run(workdir)
    try:
        run.start()
        t0 = time.monotonic()
        n = trio.run(fill, run, int(gib * GiB), size, history / "producer.jsonl")
        fill_s = time.monotonic() - t0
        run.sample()
        store = run.disk.mountpoint / "store" / "data.mdb"
        store_bytes = store.stat().st_size
        t0 = time.monotonic()
        delivered = trio.run(drain, run, n, kills, history / "consumer.jsonl")
        drain_s = time.monotonic() - t0
        left = trio.run(depth, run)
        run.sample()
    finally:
        run.close()
    ops = merge(
        [parse(p.read_text().splitlines(), p.name) for p in sorted(history.glob("*.jsonl"))]
    )
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    violations = check(ops, lost=True, duplicates=True, duplicates_per="session")
    acked = sum(op.f == "send" and op.type == "ok" for op in ops)
    return {
        "gib": gib,
        "size": size,
        "acked": acked,
        "acked_gib": acked * size / GiB,
        "delivered": delivered,
        "redelivered": delivered - n,
        "left_in_queue": left,
        "kills": dict(run.kills),
        "power_losses": sum(run.kills.values()),
        "store_gib": store_bytes / GiB,
        "fill_s": fill_s,
        "drain_s": drain_s,
        "remount_s_max": max(run.remount_s, default=0.0),
        "plugin_peak_rss_mib": run.peak_plugin_kib / 1024,
        "broker_peak_rss_mib": run.peak_broker_kib / 1024,
        "history_ops": len(ops),
        "violations": [f"{v.check}: {v.message}" for v in violations][:20],
        "violation_count": len(violations),
        "passed": not violations and left == 0 and acked == n,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0, help="backlog to build, GiB (4)")
    p.add_argument("--size", type=int, default=256 * 1024, help="message size (256 KiB)")
    p.add_argument("--kills", type=int, default=10, help="plugin + broker kills (5 + 5)")
    p.add_argument(
        "--workdir", type=Path, default=Path(f"/tmp/msgq-longhaul-backlog-{os.getpid()}")
    )
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    res = run_longhaul(args.gib, args.size, args.kills, args.workdir, keep=args.keep)
    if args.json:
        print(json.dumps(res))
    else:
        print(
            f"backlog {res['acked_gib']:.2f} GiB ({res['acked']:,} x {res['size']} B acked, "
            f"store {res['store_gib']:.2f} GiB) filled in {res['fill_s']:.0f} s, drained in "
            f"{res['drain_s']:.0f} s through kills {res['kills']} each with a power loss: "
            f"{res['delivered']:,} deliveries ({res['redelivered']} again after a crash), "
            f"{res['left_in_queue']} left; plugin RSS peak {res['plugin_peak_rss_mib']:.0f} "
            f"MiB, broker {res['broker_peak_rss_mib']:.0f} MiB; history "
            f"{res['history_ops']:,} ops: "
            + ("0 lost, 0 duplicates within a session" if not res["violations"] else "")
            + "; ".join(res["violations"][:5])
        )
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
