"""``python -m benchmarks.scale`` (also ``python -m benchmarks --scale``): msgq_trio
beside NATS, Redis and ZeroMQ (a ``zmq.proxy``: XSUB/XPUB for the publish-subscribe
workloads, ROUTER/DEALER for calls) with thousands of clients, a fresh broker per run, the clients
many connections to a process (:mod:`benchmarks.worker_scale`; the machine has 2 cores).

Workloads (``--workloads``, sizes: :data:`FULL`, ``--quick``: :data:`QUICK`):

* ``calls``: ``clients`` connected, ``active`` of them calling an echo responder at
  ``rate`` calls/s in all for ``seconds``: round trip p50/p99/p999 and the broker's CPU
  (% of one core); then the same with ``idle`` bare sockets added (past the handshake).
* ``fan-out``: ``subs`` subscribers of one group, ``n`` messages published: deliveries/s
  and the lag of the slowest subscriber (its last message after the publisher's last).
* ``routing``: ``clients`` connections with ``per`` subscriptions each (a share ``wild``
  of them patterns ``w.I.J.*``), ``n`` messages to names cycling over every
  subscription: messages/s routed and the broker's memory per subscription (resident
  growth from subscribing, over the subscriptions). A system that refuses the pattern
  subscriptions is n/a.
* ``cost``: for each count in ``clients``, that many connections each subscribed to a
  name of its own, ``n`` messages cycling over the first ``active`` of them (the same
  traffic, so the same batching, whatever the count; the others are connected and
  subscribed, idle): the broker's CPU per delivered message (the cost curve), its
  memory per idle connection and per subscription.
* ``large-cold``: ``n`` messages of 4 MiB through a fresh msgq_trio broker: MB/s over
  the first ``cold`` messages beside the rest's, and the minor page faults per message
  of the broker and of the receiving client over the same two spans.

Output: a table per workload, ``--json`` the raw figures, ``--plot DIR`` PNG charts
(matplotlib). Figures on a loaded machine are indicative only.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msgq_trio._procs import cpu_seconds, raise_nofile, rss_kib

from .common import RESULT, percentiles
from .procs import Proc, RunTimeout, Service, WorkerFailed, wait_all
from .systems import _start_msgq, _start_nats, _start_redis, _start_zmq, one_user_args
from .worker_scale import CONNECTED, RECEIVED, UNSUPPORTED


def _scale_args(run_dir: Path) -> tuple[str, ...]:
    """``serve`` flags for a broker of 10,000 connections of one user."""
    return one_user_args(run_dir, 16384, 262144)


#: Each system's broker for a run directory and a pattern: ``pubsub`` or ``reqrep`` (for
#: ZeroMQ, whose proxy is XSUB/XPUB or ROUTER/DEALER; the others serve both).
SYSTEMS: dict[str, Callable[[Path, str], Service]] = {
    "msgq_trio": lambda d, _p: _start_msgq(d, "", 0.0, serve_args=_scale_args(d)),
    "nats": lambda d, _p: _start_nats(d, "", time.monotonic() + 30),
    "redis": lambda d, _p: _start_redis(d, "", time.monotonic() + 30),
    "zeromq": lambda d, p: _start_zmq(d, p, time.monotonic() + 30),
}
WORKLOADS = ("calls", "fan-out", "routing", "cost", "large-cold")
FULL: dict[str, dict[str, Any]] = {
    "calls": {"clients": 1000, "active": 100, "rate": 20_000, "seconds": 10, "idle": 10_000},
    "fan-out": {"subs": 1000, "n": 2000},
    "routing": {"clients": 1000, "per": 100, "wild": 0.01, "n": 100_000},
    "cost": {"clients": [1, 10, 100, 1000, 10_000], "active": 10, "n": 100_000},
    "large-cold": {"n": 100, "cold": 10},
}
QUICK: dict[str, dict[str, Any]] = {
    "calls": {"clients": 20, "active": 4, "rate": 400, "seconds": 1, "idle": 50},
    "fan-out": {"subs": 20, "n": 50},
    "routing": {"clients": 10, "per": 10, "wild": 0.1, "n": 500},
    "cost": {"clients": [1, 20], "active": 10, "n": 500},
    "large-cold": {"n": 12, "cold": 4},
}
SIZE = 100
#: Connections per client process, at most (setting up 10,000 in one takes long).
PER_PROCESS = 2500


def _split(total: int) -> list[tuple[int, int]]:
    """(base, count) per process for ``total`` connections."""
    if total <= 0:
        return []
    procs = -(-total // PER_PROCESS)
    each = -(-total // procs)
    return [(b, min(each, total - b)) for b in range(0, total, each)]


class Run:
    """One system's broker and the worker processes of one run; stops everything."""

    def __init__(self, system: str, timeout: float, pattern: str = "pubsub") -> None:
        self.system = system
        self.dir = Path(tempfile.mkdtemp(prefix=f"scale-{system}-"))
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.procs: list[Proc] = []
        self.svc = SYSTEMS[system](self.dir, pattern)

    def worker(self, name: str, **spec: Any) -> Proc:
        spec.update(system=self.system, addr=self.svc.addr, deadline=self.left())
        p = Proc.worker(name, "worker_scale", spec, self.dir)
        self.procs.append(p)
        return p

    def left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())

    @property
    def broker(self) -> int:
        return self.svc.pids[0]

    def cpu(self) -> float:
        return cpu_seconds(self.broker) or 0.0

    def rss(self) -> int:
        return (rss_kib(self.broker) or 0) * 1024

    def stop(self) -> None:
        """Stop every process, remove the run's directory (a failure's message already
        carries the tail of the failed process's stderr)."""
        try:
            for p in self.procs:
                p.kill()
            self.svc.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def _members(run: Run, total: int, expect_of: Callable[[int, int], int], **spec: Any) -> list[Proc]:
    """Members processes for ``total`` connections, connected (not yet subscribed);
    ``expect_of(base, count)``: the messages a process's connections are to receive."""
    procs = [
        run.worker(f"members{b}", role="members", base=b, conns=n, expect=expect_of(b, n), **spec)
        for b, n in _split(total)
    ]
    wait_all(procs, CONNECTED, run.deadline)
    return procs


def _go_members(run: Run, procs: list[Proc]) -> None:
    for p in procs:
        p.go()
    wait_all(procs, "READY", run.deadline)


def _publish(
    run: Run, members: list[Proc], n: int, subscribers: int, **where: Any
) -> tuple[Proc, float]:
    """Start a publisher of ``n`` messages to each name ``where`` gives it (``targets``,
    or a ``layout`` it lists the names from), let it go once ready, and wait until every
    member received its share and reported. Returns the publisher and the broker's CPU
    seconds from its go until the last member received."""
    pub = run.worker(
        "publisher", role="publisher", n=n, size=SIZE, subscribers=subscribers, **where
    )
    wait_all([pub], "READY", run.deadline)
    cpu0 = run.cpu()
    pub.go()
    wait_all(members, RECEIVED, run.deadline)
    cpu = run.cpu() - cpu0
    wait_all([pub, *members], RESULT, run.deadline)
    return pub, cpu


def _unsupported(procs: list[Proc]) -> str | None:
    """Why the broker refused the members' patterns (their UNSUPPORTED line, printed
    before READY), or None."""
    for p in procs:
        for line in p.lines:
            if line.startswith(UNSUPPORTED + " "):
                return line[len(UNSUPPORTED) + 1 :]
    return None


def calls(system: str, prm: dict[str, Any], timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for idle in (0, prm["idle"]):
        run = Run(system, timeout, "reqrep")
        try:
            responder = run.worker("responder", role="responder")
            wait_all([responder], "READY", run.deadline)
            idlers = [run.worker(f"idle{b}", role="idle", conns=n) for b, n in _split(idle)]
            wait_all(idlers, "READY", run.deadline)
            split = _split(prm["clients"])
            active = prm["active"]
            callers = []
            for b, n in split:
                share = round(active * n / prm["clients"])
                callers.append(
                    run.worker(
                        f"callers{b}",
                        role="callers",
                        base=b,
                        conns=n,
                        active=share,
                        rate=prm["rate"] * share / active,
                        seconds=prm["seconds"],
                        size=SIZE,
                    )
                )
            wait_all(callers, "READY", run.deadline)
            cpu0, t0 = run.cpu(), time.monotonic()
            for p in callers:
                p.go()
            wait_all(callers, RESULT, run.deadline)
            cpu, wall = run.cpu() - cpu0, time.monotonic() - t0
            lat = [x for p in callers for x in (p.result or {}).get("lat_ns", [])]
            pct = percentiles(lat)
            out[f"idle={idle}"] = {
                "p50_us": pct["p50"] / 1000,
                "p99_us": pct["p99"] / 1000,
                "p999_us": pct["p99.9"] / 1000,
                "calls_per_s": len(lat) / wall,
                "broker_cpu_pct": 100 * cpu / wall,
                "errors": sum((p.result or {}).get("errors", 0) for p in callers),
            }
        finally:
            run.stop()
    return out


def fan_out(system: str, prm: dict[str, Any], timeout: float) -> dict[str, Any]:
    run = Run(system, timeout)
    try:
        members = _members(run, prm["subs"], lambda _b, c: c * prm["n"], group="fan", per=1)
        _go_members(run, members)
        pub, cpu = _publish(run, members, prm["n"], prm["subs"], targets=["fan"])
        res = [p.result or {} for p in members]
        total = sum(r["total"] for r in res)
        last = max(t for r in res for t in r["last"])
        start, end = pub.result["start"], pub.result["end"]  # type: ignore[index]
        return {
            "deliveries_per_s": total / (last - start),
            "slowest_lag_ms": 1000 * max(0.0, last - end),
            "delivered": total,
            "expected": prm["subs"] * prm["n"],
            "broker_cpu_us_per_delivery": 1e6 * cpu / max(1, total),
        }
    finally:
        run.stop()


def routing(system: str, prm: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Literal names only, then with the share ``wild`` of patterns."""
    out: dict[str, Any] = {}
    for share in dict.fromkeys((0.0, prm["wild"])):
        wild = round(prm["per"] * share)
        out[f"wild={100 * share:g}%"] = _routing(system, prm, wild, timeout)
    return out


def _routing(system: str, prm: dict[str, Any], wild: int, timeout: float) -> dict[str, Any]:
    per, clients, n = prm["per"], prm["clients"], prm["n"]
    run = Run(system, timeout)
    try:
        rss0 = run.rss()
        procs = _members(
            run, clients, lambda b, c: _routed_to(b, c, clients, n), per=per, wild=wild
        )
        time.sleep(0.2)
        rss1 = run.rss()
        _go_members(run, procs)
        if (why := _unsupported(procs)) is not None:
            return {"status": "n/a", "why": why}
        time.sleep(0.2)
        rss2 = run.rss()
        # The publisher lists the names itself (100,000 would not fit in its argv).
        layout = {"clients": clients, "per": per, "wild": wild}
        pub, cpu = _publish(run, procs, n, clients, layout=layout)
        res = [p.result or {} for p in procs]
        last = max(t for r in res for t in r["last"])
        start = pub.result["start"]  # type: ignore[index]
        subs = clients * per
        return {
            "routed_per_s": sum(r["total"] for r in res) / (last - start),
            "bytes_per_subscription": (rss2 - rss1) / subs,
            "bytes_per_connection": (rss1 - rss0) / clients,
            "broker_cpu_us_per_message": 1e6 * cpu / n,
            "subscriptions": subs,
            "wildcards": clients * wild,
        }
    finally:
        run.stop()


def _routed_share(clients: int, n: int, base: int, cnt: int) -> int:
    """:func:`_routed_to` of the connections among the first ``clients`` only."""
    return _routed_to(base, max(0, min(cnt, clients - base)), clients, n)


def _routed_to(base: int, cnt: int, clients: int, n: int) -> int:
    """Messages that connections ``base .. base+cnt`` receive when message k goes to
    connection k % clients (the targets list name j of every client, then j + 1)."""
    return sum(len(range(i, n, clients)) for i in range(base, base + cnt))


def cost(system: str, prm: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Each size on its own broker; a size that times out is recorded as such (its
    ``status``) and the other sizes still run."""
    out: dict[str, Any] = {}
    for clients in prm["clients"]:
        try:
            out[str(clients)] = _cost(system, prm, clients, timeout)
        except RunTimeout as exc:
            out[str(clients)] = {"status": "timeout", "why": str(exc)}
    return out


def _cost(system: str, prm: dict[str, Any], clients: int, timeout: float) -> dict[str, Any]:
    """One size of :func:`cost`."""
    n = prm["n"]
    active = min(clients, prm["active"])
    run = Run(system, timeout)
    try:
        rss0 = run.rss()
        procs = _members(run, clients, functools.partial(_routed_share, active, n), per=1)
        time.sleep(0.2)
        rss1 = run.rss()
        _go_members(run, procs)
        time.sleep(0.2)
        rss2 = run.rss()
        targets = [f"s.{i}.0" for i in range(active)]
        _pub, cpu = _publish(run, procs, n, clients, targets=targets)
        delivered = sum((p.result or {}).get("total", 0) for p in procs)
        return {
            "broker_cpu_us_per_delivery": 1e6 * cpu / max(1, delivered),
            "bytes_per_connection": (rss1 - rss0) / clients,
            "bytes_per_subscription": (rss2 - rss1) / clients,
            "delivered": delivered,
        }
    finally:
        run.stop()


def large_cold(system: str, prm: dict[str, Any], timeout: float) -> dict[str, Any]:
    """MB/s of the first ``cold`` 4 MiB messages through a fresh broker and of the rest,
    from the subscriber's arrival times (the msgq_trio worker's ``sub`` role)."""
    if system != "msgq_trio":
        return {"status": "n/a", "why": "msgq_trio only"}
    size = 4 * 1024 * 1024
    run = Run(system, timeout)
    try:
        sub = run.worker(
            "arrivals", role="arrivals", group="big", expect=prm["n"], watch=run.broker
        )
        wait_all([sub], "READY", run.deadline)
        pub = run.worker("publisher", role="publisher", targets=["big"], n=prm["n"], size=size)
        wait_all([pub], "READY", run.deadline)
        pub.go()
        wait_all([sub, pub], RESULT, run.deadline)
        ts = (sub.result or {})["times"]
        # faults[0]: when the receiver was ready; faults[i]: at the i-th arrival.
        faults = (sub.result or {}).get("faults") or [(0, 0)] * (len(ts) + 1)
        cold = prm["cold"]

        def per_message(k: int, a: int, b: int) -> float:
            """Faults of process k (0: the receiver, 1: the broker) per message, over
            messages a+1 .. b."""
            return float(faults[b][k] - faults[a][k]) / max(1, b - a)

        last = len(ts)
        return {
            "cold_mb_s": (cold - 1) * size / (ts[cold - 1] - ts[0]) / 1e6,
            "warm_mb_s": (len(ts) - cold) * size / (ts[-1] - ts[cold - 1]) / 1e6,
            # Pages touched for the first time per message, cold (the first messages)
            # and warm (the rest): what a fresh process pays, whatever the load.
            "broker_faults_cold": per_message(1, 0, cold),
            "broker_faults_warm": per_message(1, cold, last),
            "receiver_faults_cold": per_message(0, 0, cold),
            "receiver_faults_warm": per_message(0, cold, last),
            "messages": len(ts),
        }
    finally:
        run.stop()


RUNNERS: dict[str, Callable[[str, dict[str, Any], float], dict[str, Any]]] = {
    "calls": calls,
    "fan-out": fan_out,
    "routing": routing,
    "cost": cost,
    "large-cold": large_cold,
}


def run_all(
    workloads: list[str],
    systems: list[str],
    params: dict[str, dict[str, Any]],
    timeout: float,
    say: Callable[[str], None] = print,
) -> dict[str, dict[str, Any]]:
    """Every workload on every system; a failed or timed-out run is recorded as such
    (``{"status": "error"/"timeout", "why": ...}``) and the others go on."""
    raise_nofile()
    results: dict[str, dict[str, Any]] = {}
    for w in workloads:
        results[w] = {}
        for s in systems:
            t = time.monotonic()
            try:
                r = RUNNERS[w](s, params[w], timeout)
                r.setdefault("status", "ok")
            except RunTimeout as exc:
                r = {"status": "timeout", "why": str(exc)}
            except (WorkerFailed, RuntimeError, OSError, KeyError, ZeroDivisionError) as exc:
                r = {"status": "error", "why": f"{type(exc).__name__}: {exc}"}
            r["seconds"] = round(time.monotonic() - t, 1)
            results[w][s] = r
            say(f"{w} / {s}: {json.dumps(r, default=str)[:300]}")
    return results


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.1f}" if v < 1e5 else f"{v:,.0f}"
    return str(v)[:70]


def tables(results: dict[str, dict[str, Any]]) -> str:
    """Markdown tables: one row per system (and per sub-run), the figures as columns."""
    lines: list[str] = []
    for w, by_system in results.items():
        rows: list[tuple[str, dict[str, Any]]] = []
        for s, r in by_system.items():
            if r.get("status") != "ok":
                rows.append((s, {"status": f"{r.get('status')}: {str(r.get('why', ''))[:80]}"}))
                continue
            subs = {k: v for k, v in r.items() if isinstance(v, dict)}
            if subs:
                rows += [(f"{s} {k}", v) for k, v in subs.items()]
            else:
                rows.append((s, {k: v for k, v in r.items() if k not in ("status", "seconds")}))
        cols = sorted({k for _, r in rows for k in r}, key=lambda k: (k == "status", k))
        lines += [f"### {w}", "", "| system | " + " | ".join(cols) + " |"]
        lines.append("|---" * (len(cols) + 1) + "|")
        for name, r in rows:
            lines.append(f"| {name} | " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """PNG charts into ``out_dir``: the cost curve (broker CPU per delivery against
    clients, log-log) and the round-trip percentiles of ``calls``; [] without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed; no plots written")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    curve = results.get("cost", {})
    if any(r.get("status") == "ok" for r in curve.values()):
        fig, ax = plt.subplots(figsize=(7, 4))
        for s, r in curve.items():
            if r.get("status") != "ok":
                continue
            pts = sorted(
                (int(k), v["broker_cpu_us_per_delivery"])
                for k, v in r.items()
                if isinstance(v, dict) and "broker_cpu_us_per_delivery" in v
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        ax.set_xscale("log")
        ax.set_xlabel("connected clients")
        ax.set_ylabel("broker CPU per delivered message (µs)")
        ax.set_title("Cost curve: broker CPU per delivery")
        ax.legend()
        path = out_dir / "scale-cost.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    rt = results.get("calls", {})
    bars = [
        (f"{s}\n{k}", v)
        for s, r in rt.items()
        if r.get("status") == "ok"
        for k, v in r.items()
        if isinstance(v, dict)
    ]
    if bars:
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.27
        for off, key in ((-width, "p50_us"), (0.0, "p99_us"), (width, "p999_us")):
            ax.bar(
                [i + off for i in range(len(bars))],
                [v[key] for _, v in bars],
                width,
                label=key.removesuffix("_us"),
            )
        ax.set_xticks(range(len(bars)), [n for n, _ in bars], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("round trip (µs)")
        ax.set_title("Calls at a fixed rate among many clients")
        ax.legend()
        path = out_dir / "scale-calls.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scale", description=__doc__.split("\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that all runs")
    p.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}"
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run")
    p.add_argument(
        "--sizes",
        type=json.loads,
        default={},
        help='JSON over the sizes, per workload, e.g. \'{"cost": {"clients": [2000]}}\'',
    )
    p.add_argument("--json", type=Path, help="write the raw figures here")
    p.add_argument("--plot", type=Path, help="write PNG charts into this directory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    systems = [s for s in args.systems.split(",") if s]
    bad = [x for x in workloads if x not in WORKLOADS] + [x for x in systems if x not in SYSTEMS]
    if bad:
        print(f"unknown workload or system: {', '.join(bad)}", file=sys.stderr)
        return 2
    params = {w: {**p, **args.sizes.get(w, {})} for w, p in (QUICK if args.quick else FULL).items()}
    bad = [w for w in args.sizes if w not in WORKLOADS]
    if bad:
        print(f"--sizes: unknown workload: {', '.join(bad)}", file=sys.stderr)
        return 2
    timeout = args.timeout or (60.0 if args.quick else 300.0)
    results = run_all(workloads, systems, params, timeout)
    print(tables(results))
    if args.json:
        args.json.write_text(json.dumps({"params": params, "results": results}, indent=1))
    if args.plot:
        for path in plot(results, args.plot):
            print(f"wrote {path}")
    failed = [
        w
        for w, r in results.items()
        if r.get("msgq_trio", {}).get("status") not in ("ok", "n/a", None)
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
