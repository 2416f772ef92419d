"""Figures only msgq_trio has: how fast a caller learns that its callee died, what traffic
capture costs, and what an idle client costs the broker.

* ``kill``: a caller process calls a callee process that never answers; once the callee
  printed that it holds the request, the harness SIGKILLs it and the caller prints when
  its call failed. Figure: µs from ``kill()`` to the caller's ``recipient-gone`` (both
  ``time.monotonic()``), p50/p99/max over ``kills`` kills (200 a repetition in the full
  run: enough for a p99). A fresh callee per kill, forked by a pool process
  (:mod:`benchmarks.worker_msgq_extra` ``callee-pool``) in batches of
  :data:`KILL_BATCH`, so a kill costs milliseconds, not an interpreter start-up; one
  broker and one caller for all of them. Also measured: µs from ``kill()`` to EOF on a
  socket the callee held and never used (``kernel_eof_p50_us``), the part no broker can
  avoid: the kernel frees the process's memory before it closes its descriptors.
* ``capture``: the one-way workload with the broker serving ``--capture-dir`` (every
  frame recorded, bodies not written: the capture default), against the same workload
  without it, run back to back. Figure: msgs/s on and off; the records written are
  counted from the files.
* ``idle``: a broker with ``clients`` idle connected clients (full handshakes), spread
  over processes of at most 2,500 connections. Figure: (broker RSS with them - broker RSS
  before them) / clients, in KiB. The harness raises RLIMIT_NOFILE (soft to hard) before
  it starts the broker, which inherits it; client processes raise their own.

Each function runs one repetition, never raises for a failed run, and returns a dict with
``status`` (``ok``, ``timeout``, ``error``), ``value`` (the headline figure) and
``detail``, like :func:`benchmarks.workloads.run_one`.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from msgq_trio._procs import raise_nofile, rss_kib

from .common import READY, percentiles
from .procs import Proc, RunTimeout, WorkerFailed, wait_all
from .systems import msgq_variant, one_user_args
from .workloads import WORKLOADS, run_one

#: Callees the pool forks at once (they connect concurrently, then are killed one by one).
KILL_BATCH = 25
#: Connections per idle-client process.
IDLE_PER_PROC = 2500
#: Seconds the broker gets to settle before and after the clients connect, so RSS is read
#: after its allocations, not during them.
_SETTLE = 1.0


def _fail(exc: BaseException, timeout: float) -> dict[str, Any]:
    if isinstance(exc, RunTimeout):
        return {
            "status": "timeout",
            "value": None,
            "detail": f"hard timeout {timeout:.0f} s: {exc}",
        }
    return {"status": "error", "value": None, "detail": f"{type(exc).__name__}: {exc}"}


def run_kill(kills: int, timeout: float, pool_batch: int = KILL_BATCH) -> dict[str, Any]:
    """One repetition of ``kills`` SIGKILLs of a callee with a pending call."""
    from msgq_trio.demo import start_broker

    t0 = time.monotonic()
    deadline = t0 + timeout
    run_dir = Path(tempfile.mkdtemp(prefix="mqk-"))
    procs: list[Proc] = []
    broker = None
    lat_ns: list[int] = []
    eof_ns: list[int] = []  # SIGKILL to EOF on a socket the callee held: the kernel's part
    codes: dict[str, int] = {}
    out: dict[str, Any]
    try:
        addr = {"socket": str(run_dir / "bus.sock")}
        broker = start_broker(run_dir / "bus.sock")

        def spawn(name: str, role: str, **extra: Any) -> Proc:
            spec = {
                "role": role,
                "addr": addr,
                "deadline": max(1.0, deadline - time.monotonic()),
                **extra,
            }
            p = Proc.worker(name, "worker_msgq_extra", spec, run_dir)
            procs.append(p)
            return p

        caller = spawn("caller", "caller", max_calls=kills)
        pool = spawn("pool", "callee-pool", max_callees=kills)
        wait_all([caller, pool], READY, deadline)
        while len(lat_ns) < kills and time.monotonic() < deadline:
            # A batch of callees connects at once; then each is called and killed alone,
            # so nothing else is going on in the broker while it notices a death.
            k = min(pool_batch, kills - len(lat_ns))
            pool.send(f"SPAWN {k}")
            pids = [int(pool.wait_line("CALLEE ", deadline).split()[1]) for _ in range(k)]
            for pid in pids:
                caller.send(f"CALL bench.victim{pid}")
                got = pool.wait_line("GOT ", deadline).split()
                if int(got[1]) != pid:
                    raise RuntimeError(f"callee {got[1]} got the call meant for {pid}")
                pool.send(f"KILL {pid}")
                words = pool.wait_line(f"KILLED {pid} ", deadline).split()
                killed_at, eof_at = float(words[2]), float(words[3])
                if eof_at:
                    eof_ns.append(int((eof_at - killed_at) * 1e9))
                gone = caller.wait_line("GONE", deadline).split()
                lat_ns.append(int((float(gone[1]) - killed_at) * 1e9))
                codes[gone[2]] = codes.get(gone[2], 0) + 1
        caller.send("STOP")
        pool.send("STOP")
        us = {k: v / 1000 for k, v in percentiles(lat_ns).items()}
        out = {"kills": len(lat_ns), "codes": codes}
        if len(lat_ns) < kills:
            out.update(
                status="timeout",
                value=None,
                detail=f"{len(lat_ns)} of {kills} kills in {timeout:.0f} s",
            )
        elif set(codes) != {"recipient-gone"}:
            out.update(status="error", value=None, detail=f"callers saw {codes}")
        else:
            out.update(
                status="ok",
                value=us["p50"],
                detail="",
                p50_us=us["p50"],
                p99_us=us["p99"],
                max_us=us["p100"],
                mean_us=statistics.fmean(lat_ns) / 1000,
                percentiles_us=us,
                kernel_eof_p50_us=(statistics.median(eof_ns) / 1000 if eof_ns else None),
            )
    except (RunTimeout, WorkerFailed, RuntimeError, OSError, IndexError, ValueError) as exc:
        out = _fail(exc, timeout)
    finally:
        for p in procs:
            p.kill()
        if broker is not None and broker.poll() is None:
            broker.terminate()
            try:
                broker.wait(5)
            except Exception:
                broker.kill()
                broker.wait(5)
        shutil.rmtree(run_dir, ignore_errors=True)
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def _count_capture(cap_dir: Path) -> tuple[int, int]:
    """(frame records, records reported dropped) in a capture directory."""
    records = dropped = 0
    for path in sorted(cap_dir.glob("*.jsonl")):
        with open(path, "rb") as f:
            for line in f:
                if b'"capture-dropped"' in line:
                    try:
                        dropped += int(json.loads(line).get("dropped", 0))
                    except ValueError:
                        pass
                else:
                    records += 1
    return records, dropped


def run_capture(params: dict[str, int], timeout: float, seed: int) -> dict[str, Any]:
    """One repetition of one-way with capture off, then on; ``value`` is on/off."""
    workload = WORKLOADS["one-way"]
    off = run_one(msgq_variant("msgq_trio", "capture off"), workload, params, timeout, seed)
    cap_dir = Path(tempfile.mkdtemp(prefix="mqc-"))
    try:
        system = msgq_variant(
            "msgq_trio+capture", "capture on", "--capture-dir", str(cap_dir / "cap")
        )
        on = run_one(system, workload, params, timeout, seed)
        records, dropped = _count_capture(cap_dir / "cap")
    finally:
        shutil.rmtree(cap_dir, ignore_errors=True)
    out: dict[str, Any] = {
        "off": off.get("value"),
        "on": on.get("value"),
        "records_written": records,
        "records_dropped": dropped,
        "seconds": round(off["seconds"] + on["seconds"], 3),
    }
    if off["status"] != "ok" or on["status"] != "ok":
        bad = off if off["status"] != "ok" else on
        which = "off" if bad is off else "on"
        return {
            **out,
            "status": bad["status"],
            "value": None,
            "detail": f"capture {which}: {bad['detail']}",
        }
    return {**out, "status": "ok", "value": on["value"] / off["value"], "detail": ""}


def run_idle(clients: int, timeout: float) -> dict[str, Any]:
    """One repetition: broker RSS per idle client with ``clients`` connected."""
    from msgq_trio.demo import start_broker

    t0 = time.monotonic()
    deadline = t0 + timeout
    soft, _hard = raise_nofile()  # the broker inherits it
    if soft < clients + 64:
        return {
            "status": "n/a",
            "value": None,
            "seconds": 0.0,
            "detail": f"RLIMIT_NOFILE hard limit {soft} < {clients} clients",
        }
    run_dir = Path(tempfile.mkdtemp(prefix="mqi-"))
    procs: list[Proc] = []
    broker = None
    out: dict[str, Any]
    try:
        sock = run_dir / "bus.sock"
        broker = start_broker(sock, *one_user_args(run_dir, clients + 64))
        time.sleep(_SETTLE)
        before = rss_kib(broker.pid)
        nprocs = -(-clients // IDLE_PER_PROC)
        for i in range(nprocs):
            share = clients // nprocs + (1 if i < clients % nprocs else 0)
            procs.append(
                Proc.worker(
                    f"idle{i}",
                    "worker_msgq_extra",
                    {
                        "role": "idle",
                        "addr": {"socket": str(sock)},
                        "clients": share,
                        "index": i,
                        "parallel": 64,
                        "deadline": max(1.0, deadline - time.monotonic()),
                    },
                    run_dir,
                )
            )
        connect_s = max(float(p.wait_line(READY, deadline).split()[1]) for p in procs)
        time.sleep(_SETTLE)
        after = rss_kib(broker.pid)
        client_rss = sum(rss_kib(p.popen.pid) or 0 for p in procs)
        if before is None or after is None:
            raise RuntimeError("broker exited")
        out = {
            "status": "ok",
            "value": (after - before) / clients,
            "detail": "",
            "broker_rss_before_kib": before,
            "broker_rss_after_kib": after,
            "client_rss_per_connection_kib": client_rss / clients,
            "connect_seconds": connect_s,
            "client_processes": nprocs,
        }
    except (RunTimeout, WorkerFailed, RuntimeError, OSError, IndexError, ValueError) as exc:
        out = _fail(exc, timeout)
    finally:
        for p in procs:
            p.kill()
        if broker is not None and broker.poll() is None:
            broker.kill()  # 10,000 GOODBYEs are not what is measured
            broker.wait(5)
        shutil.rmtree(run_dir, ignore_errors=True)
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out
