"""The five workloads, their sizes (full and quick), and one measured run of a system.

A run starts a fresh broker, then the receivers (subscribers or the responder) and waits
until each printed READY, then the senders (publisher or requesters), waits for their
READY, sends every sender GO at once, and collects the RESULT lines. Everything has one
hard deadline; whatever happens, every process is killed and the directory removed.

Figures:

* one-way / large: at the subscriber, ``(count - 1) / (last - first)`` messages/s, or that
  many bytes/s for large (MB = 10^6 bytes);
* fan-out: all deliveries to all subscribers over ``max(last) - min(first)``;
* req-reply: percentiles of the round-trip latency of sequential calls (µs);
* concurrent: answered calls over ``max(end) - min(start)`` of the requester processes.

Timestamps are ``time.monotonic()``, one clock for all processes on Linux.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from msgq_trio._procs import cpu_seconds

from .common import READY, RESULT, percentiles
from .procs import Proc, RunTimeout, WorkerFailed, wait_all
from .systems import System

MIB = 1024 * 1024
PUBSUB, REQREP = "pubsub", "reqrep"


@dataclass(frozen=True)
class Workload:
    key: str
    title: str  # table column header
    unit: str
    higher_is_better: bool
    pattern: str  # PUBSUB or REQREP


WORKLOADS: dict[str, Workload] = {
    w.key: w
    for w in (
        Workload("one-way", "one-way", "msgs/s", True, PUBSUB),
        Workload("fan-out", "fan-out x4", "deliveries/s", True, PUBSUB),
        Workload("req-reply", "req/reply p50", "µs", False, REQREP),
        Workload("concurrent", "16 requesters", "calls/s", True, REQREP),
        Workload("large", "large one-way", "MB/s", True, PUBSUB),
    )
}

#: Sizes of the full run: each workload runs long enough to stand far above the
#: processes' start-up noise; fan-out (100,000 x 4 = 400,000 deliveries) and concurrent
#: (8,000 calls) are half the others' counts so three repetitions of everything fit in
#: the run's time budget.
FULL: dict[str, dict[str, int]] = {
    "one-way": {"n": 200_000, "size": 100, "subs": 1},
    "fan-out": {"n": 100_000, "size": 100, "subs": 4},
    "req-reply": {"calls": 5_000, "size": 100, "conc": 1, "procs": 1, "warmup": 200},
    "concurrent": {"calls": 500, "size": 100, "conc": 4, "procs": 4, "warmup": 20},
    "large": {"n": 200, "size": 4 * MIB, "subs": 1},
}
#: ``--quick``: tiny counts, for tests (every path runs, nothing is worth quoting).
QUICK: dict[str, dict[str, int]] = {
    "one-way": {"n": 2_000, "size": 100, "subs": 1},
    "fan-out": {"n": 2_000, "size": 100, "subs": 4},
    "req-reply": {"calls": 200, "size": 100, "conc": 1, "procs": 1, "warmup": 10},
    "concurrent": {"calls": 25, "size": 100, "conc": 4, "procs": 4, "warmup": 2},
    "large": {"n": 4, "size": 256 * 1024, "subs": 1},
}
FULL_TIMEOUT = 60.0
QUICK_TIMEOUT = 20.0
#: Seconds the parent waits for RESULT lines past the workers' own deadline.
_REPORT_GRACE = 3.0


def describe(key: str, p: dict[str, int]) -> str:
    """Human description of a workload's parameters, for reports."""
    size = (
        f"{p['size'] // MIB} MiB"
        if p["size"] >= MIB
        else (f"{p['size'] // 1024} KiB" if p["size"] >= 1024 else f"{p['size']} B")
    )
    if key in ("one-way", "fan-out", "large"):
        subs = p["subs"]
        return f"{p['n']:,} x {size}, 1 publisher -> {subs} subscriber{'s' * (subs > 1)}"
    if key == "req-reply":
        return f"{p['calls']:,} sequential round trips of {size} (after {p['warmup']} warm-up)"
    total = p["calls"] * p["conc"] * p["procs"]
    return (
        f"{p['procs']} processes x {p['conc']} concurrent requesters x {p['calls']:,} "
        f"calls of {size} = {total:,} calls"
    )


def run_one(
    system: System, workload: Workload, params: dict[str, int], timeout: float, seed: int = 0
) -> dict[str, Any]:
    """Measure ``workload`` once on ``system``; never raises for a failed run.

    Returns a dict with ``status`` (``ok``, ``timeout`` or ``error``), ``value`` (the
    figure, or None), ``detail`` and workload-specific figures.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    run_dir = Path(tempfile.mkdtemp(prefix="mqb-"))  # short: AF_UNIX paths max 107 bytes
    procs: list[Proc] = []
    service = None
    out: dict[str, Any]
    try:
        service = system.start(run_dir, workload.pattern, deadline)
        addr = service.addr

        def spawn(name: str, role: str, **extra: Any) -> Proc:
            spec = {
                "role": role,
                "addr": addr,
                "seed": seed,
                "deadline": max(1.0, deadline - time.monotonic()),
                **params,
                **system.spec,
                **extra,
            }
            p = Proc.worker(name, system.module, spec, run_dir)
            procs.append(p)
            return p

        if workload.pattern == PUBSUB:
            subs = [spawn(f"sub{i}", "sub", index=i) for i in range(params["subs"])]
            wait_all(subs, READY, deadline)
            pub = spawn("pub", "pub")
            wait_all([pub], READY, deadline)
            cpu0 = _cpu(service.pids)
            pub.go()
            wait_all([*subs, pub], RESULT, deadline + _REPORT_GRACE)
            out = _pubsub_figures(
                workload, params, [s.result or {} for s in subs], pub.result or {}
            )
            units = params["n"] * (params["subs"] if workload.key == "fan-out" else 1)
            _add_cpu(
                out,
                units,
                _cpu(service.pids) - cpu0 if service.pids else None,
                sum(float((p.result or {}).get("cpu", 0.0)) for p in [*subs, pub]),
            )
        else:
            responder = spawn("responder", "responder", clients=params["procs"])
            wait_all([responder], READY, deadline)
            reqs = [
                spawn(f"req{i}", "requester", index=i, latencies=workload.key == "req-reply")
                for i in range(params["procs"])
            ]
            wait_all(reqs, READY, deadline)
            cpu0, resp0 = _cpu(service.pids), _cpu([responder.popen.pid])
            for r in reqs:
                r.go()
            wait_all(reqs, RESULT, deadline + _REPORT_GRACE)
            out = _reqrep_figures(workload, params, [r.result or {} for r in reqs])
            _add_cpu(
                out,
                params["calls"] * params["conc"] * params["procs"],
                _cpu(service.pids) - cpu0 if service.pids else None,
                _cpu([responder.popen.pid])
                - resp0
                + sum(float((r.result or {}).get("cpu", 0.0)) for r in reqs),
            )
    except RunTimeout as exc:
        out = {"status": "timeout", "value": None, "detail": f"hard timeout {timeout:.0f} s: {exc}"}
    except (WorkerFailed, RuntimeError, OSError) as exc:
        out = {"status": "error", "value": None, "detail": str(exc)}
    finally:
        for p in procs:
            p.kill()
        if service is not None:
            service.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def _cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) or 0.0 for pid in pids)


def _add_cpu(out: dict[str, Any], units: int, broker: float | None, clients: float) -> None:
    """CPU µs per message (delivery, call) spent in the broker and in all clients.

    Clients report their own CPU time (from READY or GO to the end); the broker's and a
    responder's come from /proc (clock ticks, so +-10 ms per process and run).
    """
    if out.get("status") == "ok" and units:
        out["cpu_us_per_unit"] = {
            "broker": None if broker is None else broker / units * 1e6,
            "clients": clients / units * 1e6,
        }


def _pubsub_figures(
    workload: Workload, params: dict[str, int], subs: list[dict[str, Any]], pub: dict[str, Any]
) -> dict[str, Any]:
    n, size = params["n"], params["size"]
    counts = [int(s.get("count", 0)) for s in subs]
    bad = sum(int(s.get("bad", 0)) for s in subs)
    total = sum(counts)
    out: dict[str, Any] = {"received": counts, "expected_each": n}
    if pub.get("end") and pub.get("start"):
        out["publish_seconds"] = pub["end"] - pub["start"]
    if bad:
        return {
            **out,
            "status": "error",
            "value": None,
            "detail": f"{bad} messages had the wrong size",
        }
    if any(s.get("timeout") for s in subs) or total < n * len(subs):
        return {
            **out,
            "status": "timeout",
            "value": None,
            "detail": f"received {total:,} of {n * len(subs):,} in time",
        }
    span = max(s["last"] for s in subs) - min(s["first"] for s in subs)
    if span <= 0:
        return {**out, "status": "error", "value": None, "detail": "zero time span"}
    out["span_seconds"] = span
    # MB/s (10^6 bytes) for large messages, messages or deliveries per second otherwise.
    value = (n - 1) * size / span / 1e6 if workload.key == "large" else (total - 1) / span
    return {**out, "status": "ok", "value": value, "detail": ""}


def _reqrep_figures(
    workload: Workload, params: dict[str, int], reqs: list[dict[str, Any]]
) -> dict[str, Any]:
    expected = params["calls"] * params["conc"]
    calls = sum(int(r.get("calls", 0)) for r in reqs)
    bad = sum(int(r.get("bad", 0)) for r in reqs)
    out: dict[str, Any] = {"calls": calls}
    if bad:
        return {
            **out,
            "status": "error",
            "value": None,
            "detail": f"{bad} replies differed from their request",
        }
    if any(r.get("timeout") for r in reqs) or calls < expected * len(reqs):
        return {
            **out,
            "status": "timeout",
            "value": None,
            "detail": f"{calls:,} of {expected * len(reqs):,} calls answered in time",
        }
    if workload.key == "req-reply":
        lat = [int(x) for r in reqs for x in r.get("lat_ns", [])]
        pct = percentiles(lat)
        us = {k: v / 1000 for k, v in pct.items()}
        out.update(
            {
                "p50_us": us["p50"],
                "p99_us": us["p99"],
                "max_us": us["p100"],
                "mean_us": statistics.fmean(lat) / 1000,
                "percentiles_us": us,
            }
        )
        return {**out, "status": "ok", "value": us["p50"], "detail": ""}
    span = max(r["end"] for r in reqs) - min(r["start"] for r in reqs)
    out["span_seconds"] = span
    return {**out, "status": "ok", "value": calls / span, "detail": ""}
