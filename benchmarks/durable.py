"""The durable acked publish workload: ``n`` x ``size`` B published to a durable store by
one producer process with a window of unacknowledged messages.

Systems (a fresh server and store directory per run, except RabbitMQ, whose slow start
(an Erlang node) is paid once per benchmark: one server, a fresh durable queue per run):

* ``nats``: nats-server with JetStream, file store in the run's directory;
* ``redis``: redis-server with ``appendonly yes`` and ``appendfsync everysec``, XADD;
* ``rabbitmq``: rabbitmq-server (Debian's, started directly, not as a system service, on a
  free loopback port with its own epmd port and node directory; :data:`SHARED_RABBIT`,
  the same server as the main table's), durable classic queue, persistent messages,
  publisher confirms;
* ``msgq_trio``, ``msgq_trio x16``, ``msgq_trio +consumer``: the queue plugin's harness
  :func:`benchmarks.durable_msgq.run_durable` with 1 producer, 16 producers, and 1
  producer with a consumer online; ``n/a (queue plugin not available)`` when it cannot be
  imported or raises.

The store directories are on the same disk as the rest (``tempfile``'s directory); the
figure is msgs/s from first publish to last ack, and ack latency p50/p99 (µs).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msgq_trio._procs import free_port

from .common import READY, RESULT
from .procs import (
    Proc,
    RunTimeout,
    Service,
    WorkerFailed,
    stop_proc,
    wait_all,
    wait_port,
    wait_unix,
)

#: Full and quick sizes. ``window``: unacknowledged messages a producer keeps in flight.
#: 200,000 messages: a run must last long against the start-up transients of its four
#: processes, or its repetitions spread widely.
DURABLE_FULL = {"n": 200_000, "size": 100, "window": 1000}
DURABLE_QUICK = {"n": 500, "size": 100, "window": 100}
#: (label, producers, consumer online) of the msgq_trio rows.
MSGQ_ROWS = {
    "msgq_trio": (1, False),
    "msgq_trio x16": (16, False),
    "msgq_trio +consumer": (1, True),
}
PEER_ROWS = ["nats", "redis", "rabbitmq"]
#: Hard timeout of one durable run: well above the slowest row (RabbitMQ's 200,000
#: publisher confirms); a row that hangs costs no more than this, once.
DURABLE_TIMEOUT = 60.0
RABBIT_BIN = "/usr/lib/rabbitmq/bin/rabbitmq-server"
RABBIT_START_TIMEOUT = 60.0


def _start_nats_js(run_dir: Path, deadline: float) -> Service:
    binary = shutil.which("nats-server")
    if binary is None:
        raise RuntimeError("nats-server is not installed")
    port = free_port()
    conf = run_dir / "nats.conf"
    conf.write_text(
        f'host: 127.0.0.1\nport: {port}\njetstream {{\n  store_dir: "{run_dir / "js"}"\n}}\n'
    )
    proc = Proc("nats-server", [binary, "-c", str(conf)], run_dir, stdin=False)
    svc = Service({"url": f"nats://127.0.0.1:{port}"}, [stop_proc(proc)], [proc.popen.pid])
    try:
        wait_port("127.0.0.1", port, min(deadline, time.monotonic() + 15), proc)
    except BaseException:
        svc.stop()
        raise
    return svc


def _start_redis_aof(run_dir: Path, deadline: float) -> Service:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed")
    path = run_dir / "redis.sock"
    proc = Proc(
        "redis-server",
        [
            binary,
            "--port",
            "0",
            "--unixsocket",
            str(path),
            "--unixsocketperm",
            "700",
            "--dir",
            str(run_dir),
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ],
        run_dir,
        stdin=False,
    )
    svc = Service({"socket": str(path)}, [stop_proc(proc)], [proc.popen.pid])
    try:
        wait_unix(path, min(deadline, time.monotonic() + 15), proc)
    except BaseException:
        svc.stop()
        raise
    return svc


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc), so none outlives the benchmark."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        found += kids
        todo += kids
    return found


def start_rabbitmq(run_dir: Path) -> Service:
    """Start rabbitmq-server (and its own epmd) in ``run_dir``; returns when AMQP accepts.

    Raises:
        RuntimeError: not installed, or it exits at start-up.
        RunTimeout: not accepting within :data:`RABBIT_START_TIMEOUT` seconds.
    """
    epmd_bin = shutil.which("epmd") or next(
        iter(sorted(Path("/usr/lib/erlang").glob("erts-*/bin/epmd"))), None
    )
    if not os.path.exists(RABBIT_BIN) or epmd_bin is None:
        raise RuntimeError("rabbitmq-server is not installed")
    port, dist, epmd_port = free_port(), free_port(), free_port()
    (run_dir / "enabled_plugins").write_text("[].\n")  # no management plugin: faster start
    env = dict(
        os.environ,
        HOME=str(run_dir),
        ERL_EPMD_PORT=str(epmd_port),
        RABBITMQ_NODENAME=f"mqbench{port}@localhost",
        RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
        RABBITMQ_NODE_PORT=str(port),
        RABBITMQ_DIST_PORT=str(dist),
        RABBITMQ_MNESIA_BASE=str(run_dir / "mnesia"),
        RABBITMQ_LOG_BASE=str(run_dir / "log"),
        RABBITMQ_ENABLED_PLUGINS_FILE=str(run_dir / "enabled_plugins"),
        RABBITMQ_PID_FILE=str(run_dir / "rabbit.pid"),
        RABBITMQ_CONFIG_FILE=str(run_dir / "rabbitmq"),
        RABBITMQ_ADVANCED_CONFIG_FILE=str(run_dir / "advanced.config"),
        # No scheduler busy-waiting: on 2 shared cores, spinning Erlang schedulers
        # would take the CPU the clients need (RabbitMQ's own advice for shared
        # hosts).
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="+sbwt none +sbwtdcpu none +sbwtdio none",
    )
    # Our own epmd in the foreground: the one erl would start daemonizes and outlives us.
    epmd = Proc("epmd", [str(epmd_bin), "-port", str(epmd_port)], run_dir, stdin=False)
    rabbit = Proc("rabbitmq-server", [RABBIT_BIN], run_dir, stdin=False, env=env)

    def stop() -> None:
        kids = _children(rabbit.popen.pid)
        rabbit.kill(signal.SIGTERM, wait=20.0)
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        epmd.kill(signal.SIGTERM)

    svc = Service({"url": f"amqp://guest:guest@127.0.0.1:{port}/"}, [stop], [rabbit.popen.pid])
    try:
        wait_port("127.0.0.1", port, time.monotonic() + RABBIT_START_TIMEOUT, rabbit)
    except BaseException:
        svc.stop()
        raise
    return svc


class SharedRabbit:
    """The benchmark's one RabbitMQ server: started at its first use, so its slow start is
    paid once per benchmark, and stopped by :meth:`close` (call it in a ``finally``)."""

    def __init__(self) -> None:
        self.service: Service | None = None
        self.error = ""
        self.start_seconds: float | None = None
        self._dir: Path | None = None

    def get(self) -> Service | None:
        """The running server, or None (then :attr:`error` says why); starts it once."""
        if self.service is None and not self.error:
            self._dir = Path(tempfile.mkdtemp(prefix="mqr-"))
            t0 = time.monotonic()
            try:
                self.service = start_rabbitmq(self._dir)
                # The Erlang VM runs as a child of the start script: count its CPU too.
                self.service.pids += _children(self.service.pids[0])
            except Exception as exc:  # any start failure makes the row n/a, not the run
                self.error = f"rabbitmq-server did not start: {exc}"
            self.start_seconds = round(time.monotonic() - t0, 1)
        return self.service

    def close(self) -> None:
        if self.service is not None:
            self.service.stop()
            self.service = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.error = ""
        self.start_seconds = None


#: The benchmark's RabbitMQ (main table and durable workload alike); ``run_bench`` closes
#: it when it ends, whatever happened.
SHARED_RABBIT = SharedRabbit()
# A last resort for other users of SYSTEMS["rabbitmq"] (a script, the profiler): never leave
# a server behind when the interpreter exits normally.
atexit.register(SHARED_RABBIT.close)


def run_durable_one(
    name: str, params: dict[str, int], timeout: float, seed: int, rabbit: Service | None = None
) -> dict[str, Any]:
    """One run of the durable workload on ``name`` (a peer or a :data:`MSGQ_ROWS` label).

    Never raises for a failed run: returns ``status`` (``ok``, ``timeout``, ``error`` or
    ``n/a``), ``value`` (msgs/s), ``p50_us``/``p99_us`` (ack latency) and ``detail``.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    run_dir = Path(tempfile.mkdtemp(prefix="mqd-"))
    procs: list[Proc] = []
    service: Service | None = None
    out: dict[str, Any]
    try:
        spec: dict[str, Any] = {"seed": seed, **params}
        if name in MSGQ_ROWS:
            producers, consumer = MSGQ_ROWS[name]
            role = "msgq-durable"
            spec.update(
                addr={},
                producers=producers,
                consumer=consumer,
                workdir=str(run_dir / "work"),
                timeout=max(1.0, timeout - 5),
            )
        elif name == "rabbitmq":
            if rabbit is None:
                raise RuntimeError("rabbitmq-server did not start")
            role, spec["addr"] = "rabbitmq", rabbit.addr
        else:
            starts: dict[str, tuple[str, Callable[[Path, float], Service]]] = {
                "nats": ("nats-js", _start_nats_js),
                "redis": ("redis-streams", _start_redis_aof),
            }
            role, start = starts[name]
            service = start(run_dir, deadline)
            spec["addr"] = service.addr
        spec.update(role=role, deadline=max(1.0, deadline - time.monotonic()))
        producer = Proc.worker("producer", "worker_durable", spec, run_dir)
        procs.append(producer)
        wait_all([producer], READY, deadline)
        producer.go()
        wait_all([producer], RESULT, deadline + 3)
        out = _figures(producer.result or {}, params["n"])
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


def _figures(res: dict[str, Any], n: int) -> dict[str, Any]:
    if "na" in res:
        return {"status": "n/a", "value": None, "detail": str(res["na"]), "why": res.get("why", "")}
    if "result" in res:  # msgq_trio: run_durable's dict
        r = res["result"]
        return {
            "status": "ok",
            "value": float(r["msgs_per_s"]),
            "detail": "",
            "p50_us": r.get("ack_p50_us"),
            "p99_us": r.get("ack_p99_us"),
            "writes_skipped_share": r.get("writes_skipped_share"),
            "fsyncs": r.get("fsyncs"),
        }
    pct = res.get("percentiles_us", {})
    out = {
        "acked": res.get("acked"),
        "p50_us": pct.get("p50"),
        "p99_us": pct.get("p99"),
        "max_us": pct.get("p100"),
        "percentiles_us": pct,
        # The producer's CPU per acked message: whether the client bounds the figure.
        "producer_cpu_us": float(res.get("cpu", 0.0)) / max(1, int(res.get("acked", 0))) * 1e6,
    }
    if res.get("timeout") or int(res.get("acked", 0)) < n:
        return {
            **out,
            "status": "timeout",
            "value": None,
            "detail": f"{res.get('acked', 0):,} of {n:,} acked in time",
        }
    return {**out, "status": "ok", "value": float(res["msgs_per_s"]), "detail": ""}
