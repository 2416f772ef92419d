"""Run one fault scenario: a real broker process, real client processes, faults on a
schedule, every figure measured, the expectations checked.

:func:`run_scenario` is the library entry point shared by pytest (tests/test_scenarios.py)
and the command line (``msgq-trio scenario run``). The phases of a run:

1. build the network (network namespaces, a TCP port per TCP/TLS broker, a TLS
   certificate, the token: :mod:`msgq_trio.scenario.network`), start the brokers of
   ``[brokers]``, then ``msgq-trio serve`` with the scenario's flags (optionally a lower
   RLIMIT_NOFILE) on a socket in a fresh directory under /tmp, wait until each listens;
2. baseline: the broker's ``stats`` (fds, tasks, connections, RSS) through a probe
   connection;
3. start every client process at once and wait until each reports ``ready``;
4. traffic: ``go`` to every client (except those a ``start`` fault releases later), faults
   on schedule, until every live active client reports ``done`` and every fault struck;
5. settle, then ``stop`` every client (stopped ones get SIGCONT first) and collect their
   JSON reports;
6. leak check: poll ``stats`` until fds, tasks and connections are back to the baseline
   (bounded by ``expect.settle_timeout``);
7. SIGTERM the broker: exit status and socket removal are figures too.

Every process runs in its own session and is SIGKILLed (process group) in ``finally``;
every wait is bounded, and the whole run is bounded by the scenario's ``timeout``.
"""

from __future__ import annotations

import datetime
import errno
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO, cast

import attrs
import trio

from .. import __version__
from .._procs import free_port
from ..client.bus import connect
from ..config import ACCESS_VERBS
from ..core.access import hash_token
from ..errors import MsgqError
from .faultproxy import FaultProxy
from .faults import CLIENT_SIGNALS, NET_ACTIONS
from .history import HistoryError, check, merge, parse
from .model import (
    PROXY_ACTION,
    BrokerSpec,
    ClientSpec,
    FaultSpec,
    Scenario,
    ScenarioError,
    load_scenario,
    with_latency_scale,
    with_params,
)
from .network import (
    NETNS_PORT,
    Namespace,
    NetworkError,
    make_tls,
    missing_tools,
    new_token,
)
from .report import machine_info
from .soak import expand, faults_by_kind, flatness

#: Bounds of the phases that do not depend on the scenario.
BROKER_START_TIMEOUT = 20.0
CLIENT_READY_TIMEOUT = 60.0
CLIENT_STOP_TIMEOUT = 20.0
BROKER_STOP_TIMEOUT = 15.0
#: Bound on everything after traffic (settle, stop, leak check, broker stop).
FINISH_TIMEOUT = 90.0
RSS_SAMPLE_INTERVAL = 0.05
#: Seconds between the broker samples of a run with a checkpoint file that is no soak.
CHECKPOINT_INTERVAL = 5.0
SCHEMA = "msgq_trio.scenario/1"
_MIB = 1024 * 1024


@attrs.frozen
class CheckResult:
    """One evaluated assertion: what was checked, the bound, the measured value, verdict."""

    check: str
    expected: str
    actual: float | None
    ok: bool


@attrs.frozen
class ScenarioResult:
    """Everything one run measured. ``passed`` is true iff every check passed and the
    runner met no problem (a client crashed, a phase timed out...)."""

    scenario: Scenario
    passed: bool
    started_at: str
    duration_s: float
    metrics: dict[str, float]
    checks: tuple[CheckResult, ...]
    problems: tuple[str, ...]
    clients: tuple[dict[str, Any], ...]
    faults: tuple[dict[str, Any], ...]
    broker_log_tail: str
    #: given to the user programs as MSGQ_TRIO_SEED: the same seed replays their choices
    seed: int = 0
    #: why the scenario did not run on this machine (not root, no openssl...); a skipped
    #: run has not passed either
    skipped: str | None = None

    @property
    def failures(self) -> list[str]:
        """Failed checks and problems, one human-readable line each."""
        out = [
            f"check failed: {c.check} (expected {c.expected}, got {_fmt(c.actual)})"
            for c in self.checks
            if not c.ok
        ]
        return out + list(self.problems)

    def key_figures(self) -> dict[str, float | None]:
        """The figures the scenario names in ``key_figures`` (None if not measured; a
        count a client never reported is 0, as in the checks)."""
        names = {c.name for c in self.scenario.clients}
        out: dict[str, float | None] = {}
        for k in self.scenario.key_figures:
            try:
                out[k] = _lookup(k, self.metrics, names)
            except KeyError:
                out[k] = None
        return out

    def line(self) -> str:
        """One progress line: verdict, name, duration and the key figures."""
        if self.skipped is not None:
            return f"SKIP  {self.scenario.name:<34} {self.skipped}"
        m = self.metrics
        verdict = "PASS" if self.passed else "FAIL"
        parts = [
            f"{verdict}  {self.scenario.name:<34} {self.duration_s:6.1f}s",
            f"rss {_fmt(m.get('broker.rss_peak_mib'))} MiB",
        ]
        if "latency.p99_ms" in m:
            parts.append(
                f"p99 {_fmt(m['latency.p99_ms'])} ms max {_fmt(m.get('latency.max_ms'))} ms"
            )
        parts += [f"{k}={_fmt(v)}" for k, v in self.key_figures().items()]
        parts.append(f"seed {self.seed}")
        return "  ".join(parts)

    def explain(self) -> str:
        """The failures and the broker log tail (for assertion messages)."""
        lines = [self.line(), *("  " + f for f in self.failures)]
        if not self.passed and self.broker_log_tail:
            lines += ["--- broker log (tail) ---", self.broker_log_tail]
        return "\n".join(lines)

    def record(self, machine: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON Lines record of this run (format: docs/FAULTS.md)."""
        sc = self.scenario
        return {
            "schema": SCHEMA,
            "scenario": sc.name,
            "file": _display_path(sc.path),
            "summary": sc.summary,
            "fault": sc.fault,
            "broker_does": sc.broker_does,
            "slow": sc.slow,
            "passed": self.passed,
            "skipped": self.skipped,
            "started_at": self.started_at,
            "duration_s": round(self.duration_s, 3),
            "msgq_trio_version": __version__,
            "machine": machine or machine_info(),
            "broker": {"flags": dict(sc.broker.flags), "nofile": sc.broker.nofile},
            "clients": list(self.clients),
            "faults": list(self.faults),
            "key_figures": self.key_figures(),
            "metrics": dict(sorted(self.metrics.items())),
            "checks": [attrs.asdict(c) for c in self.checks],
            "problems": list(self.problems),
            "seed": self.seed,
        }


def _fmt(v: float | None) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(int(v))


def _display_path(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(p)


class Interrupted(Exception):
    """The run was stopped by SIGINT (Ctrl-C), SIGTERM or SIGHUP, after cleaning up
    everything it started; ``signum`` is the signal."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


def run_scenario(
    path: str | Path,
    *,
    keep_tmp: bool = False,
    seed: int | None = None,
    duration: float | None = None,
    checkpoint: Path | None = None,
    params: Sequence[str] = (),
    latency_scale: float = 1.0,
) -> ScenarioResult:
    """Load and run one scenario file; never raises for a failing scenario (the result
    says why; a scenario this machine cannot run is returned unrun, ``skipped`` saying
    why), only :class:`~msgq_trio.scenario.model.ScenarioError` for an invalid file
    and :class:`Interrupted` when SIGTERM/SIGHUP stopped the run.

    Resource handling: every process started is killed and reaped, the temporary
    directory is removed (unless ``keep_tmp``) before this returns, also on SIGTERM,
    SIGHUP and Ctrl-C (KeyboardInterrupt is re-raised after the cleanup).

    A soak (``[soak]``) runs for ``duration`` seconds (default its own), its faults
    drawn with ``seed``; with ``checkpoint``, the broker is sampled through the traffic
    (a soak's ``sample_every``, else :data:`CHECKPOINT_INTERVAL`) and every sample
    appended to that file as a JSON line as it is taken, so that an interrupted run
    leaves its figures.
    ``params`` replace client parameters (``CLIENT.KEY=VALUE``, :func:`with_params`).
    ``latency_scale`` multiplies the latency bounds (:func:`with_latency_scale`).
    """
    scenario = with_latency_scale(with_params(load_scenario(path), params), latency_scale)
    seed = seed if seed is not None else int.from_bytes(os.urandom(4), "big") >> 1
    if duration is not None and scenario.soak is None:
        raise ScenarioError(f"{scenario.name}: a duration is for a soak ([soak] table)")
    scenario = expand(scenario, seed, duration)
    all_brokers = [scenario.broker, *scenario.brokers.values()]
    why = missing_tools(
        tls=any(b.listen == "tls" for b in all_brokers), netns=any(b.netns for b in all_brokers)
    )
    if why is not None:
        return ScenarioResult(
            scenario=scenario,
            passed=False,
            started_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            duration_s=0.0,
            metrics={},
            checks=(),
            problems=(),
            clients=(),
            faults=(),
            broker_log_tail="",
            seed=seed,
            skipped=why,
        )
    run = _Run(scenario, keep_tmp=keep_tmp, seed=seed)
    run.checkpoint = checkpoint
    # KeyboardInterrupt (before the signal receiver opens) only at checkpoints: raised
    # elsewhere, it can leave a nursery half updated and the run hung (ops/interrupt.py).
    result = trio.run(run.run, restrict_keyboard_interrupt_to_checkpoints=True)
    if run.interrupted is not None:
        raise Interrupted(
            f"{signal.Signals(run.interrupted).name} during {scenario.name}", run.interrupted
        )
    return result


# -- processes ----------------------------------------------------------------------------------
class _Client:
    """One client process and what it told us over stdout."""

    def __init__(self, spec: ClientSpec, index: int, proc: trio.Process, log_path: Path) -> None:
        self.spec = spec
        self.index = index
        self.proc = proc
        self.log_path = log_path
        self.ready = False
        self.done = False
        self.exited = False
        self.report: dict[str, Any] | None = None
        self.lnames: list[str] = []
        self.killed = False
        self.stopped = False
        self.held = False
        self.other_output: list[str] = []
        #: a user program (role exec): no control protocol, stdout kept in a file
        self.is_exec = spec.role == "exec"
        #: its process name in the history (MSGQ_TRIO_CLIENT)
        self.history_name = f"{spec.name}-{index}"
        self.generation = 0
        #: a ``restart`` started a new process in its place: later faults strike that one
        self.replaced = False

    @property
    def label(self) -> str:
        return f"{self.spec.name}#{self.index}"

    async def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            await self.proc.stdin.send_all(line.encode() + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the process is gone; its exit is accounted for elsewhere

    def stderr_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class _Broker:
    """One broker process (a restart makes a new one on the same socket and log)."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.hwm_bytes = 0
        self.started = time.monotonic()


class _Node:
    """One broker of the scenario: its own (``name`` None) or one of ``[brokers.NAME]``:
    where it listens, its files in the run's directory, its processes (one per start)."""

    def __init__(self, name: str | None, spec: BrokerSpec, tmp: Path) -> None:
        self.name = name
        self.spec = spec
        stem = "broker" if name is None else f"broker-{name}"
        self.sock = tmp / ("bus.sock" if name is None else f"{name}.sock")
        self.log = tmp / f"{stem}.log"
        self.config = tmp / f"{stem}.toml"
        self.store = tmp / ("queue-store" if name is None else f"queue-store-{name}")
        self.procs: list[_Broker] = []
        #: its TCP/TLS listener (chosen before the first start, kept across restarts)
        self.host = "127.0.0.1"
        self.port = 0
        self.ns: Namespace | None = None
        #: with ``proxy = true``: the fault proxy in front of its TCP/TLS listener
        self.proxy: FaultProxy | None = None

    @property
    def address(self) -> str:
        """What clients are given: the TCP/TLS URL where it listens (its fault proxy's,
        if it has one), else the socket."""
        if self.spec.listen == "unix":
            return str(self.sock)
        if self.proxy is not None:
            return f"{self.spec.listen}://127.0.0.1:{self.proxy.port}"
        return f"{self.spec.listen}://{self.host}:{self.port}"

    @property
    def metric(self) -> str:
        """The prefix of its figures: ``broker`` or ``broker.NAME``."""
        return "broker" if self.name is None else f"broker.{self.name}"

    @property
    def label(self) -> str:
        return "the broker" if self.name is None else f"broker {self.name!r}"


def _signal_group(proc: trio.Process, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _log_file(path: Path, mode: str) -> BinaryIO:
    """A log file for a child's stderr (the child keeps its own descriptor)."""
    return cast(BinaryIO, open(path, mode))  # closed by the caller's with


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


def _proc_status(pid: int) -> dict[str, int]:
    """VmRSS/VmHWM of a process in bytes (empty if it is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, val = line.split(":", 1)
                    out[key] = int(val.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


# -- one run -------------------------------------------------------------------------------------
class _Run:
    def __init__(self, scenario: Scenario, *, keep_tmp: bool, seed: int = 0) -> None:
        self.sc = scenario
        self.seed = seed
        self.keep_tmp = keep_tmp
        self.tmp = Path(tempfile.mkdtemp(prefix="mqs-", dir="/tmp"))
        self.main = _Node(None, scenario.broker, self.tmp)
        self.nodes = [_Node(n, b, self.tmp) for n, b in scenario.brokers.items()] + [self.main]
        self.sock = self.main.sock
        self.broker_log = self.main.log
        self.brokers: list[_Broker] = self.main.procs
        #: the token TCP clients and links present, the CA file they trust (TLS)
        self.token = new_token()
        self.tls_ca: Path | None = None
        self.clients: list[_Client] = []
        self.metrics: dict[str, float] = {}
        self.problems: list[str] = []
        self.fault_log: list[dict[str, Any]] = []
        self.phase = "init"
        self.t0 = 0.0
        self.rss_peak = 0
        self.baseline: dict[str, Any] | None = None
        self.final_stats: dict[str, Any] | None = None
        self.faults_done = False
        self._changed = trio.lowlevel.ParkingLot()
        #: the tmpfs of the queue's store, while mounted
        self.mounted: Path | None = None
        self._nursery: trio.Nursery | None = None
        self.interrupted: int | None = None
        #: why this machine cannot run the scenario, found while building it
        self.skipped: str | None = None
        #: a soak's broker samples, and the file they are appended to as taken
        self.samples: list[dict[str, Any]] = []
        self.checkpoint: Path | None = None

    def _notify(self) -> None:
        self._changed.unpark_all()

    async def _wait_until(self, pred: Callable[[], bool], timeout: float, what: str) -> bool:
        """Wait until ``pred()`` (re-checked on every change and every 0.2 s)."""
        with trio.move_on_after(timeout):
            while not pred():
                with trio.move_on_after(0.2):
                    await self._changed.park()
            return True
        self.problems.append(f"timed out after {timeout:.0f} s waiting for {what}")
        return False

    @property
    def broker(self) -> _Broker | None:
        return self.brokers[-1] if self.brokers else None

    # -- top level ----------------------------------------------------------------------------
    async def run(self) -> ScenarioResult:
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        t_start = time.monotonic()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                main_scope = trio.CancelScope()
                # A runner killed by SIGTERM would leave its broker running: turn the
                # signal into a cancellation so that the cleanup below always runs.
                nursery.start_soon(self._watch_signals, main_scope)
                try:
                    ok = False
                    with main_scope, trio.move_on_after(self.sc.timeout) as cs:
                        try:
                            ok = await self._setup_and_traffic()
                        except _Skip as exc:
                            self.skipped = str(exc)
                        except _Abort as exc:
                            self.problems.append(f"phase {self.phase!r}: {exc}")
                    if cs.cancelled_caught:
                        late = sorted(
                            {c.label for c in self.clients if c.spec.active and not c.done}
                        )
                        self.problems.append(
                            f"scenario timed out after {self.sc.timeout:.0f} s in phase "
                            f"{self.phase!r}" + (f"; not done: {', '.join(late)}" if late else "")
                        )
                    if self.interrupted is None and (
                        ok or (cs.cancelled_caught and self.baseline is not None)
                    ):
                        # Even after a timeout: collect the reports and the broker's state,
                        # each step bounded on its own.
                        with trio.move_on_after(FINISH_TIMEOUT) as cs2:
                            try:
                                await self._finish(settle=not cs.cancelled_caught)
                            except _Abort as exc:
                                self.problems.append(f"phase {self.phase!r}: {exc}")
                        if cs2.cancelled_caught:
                            self.problems.append(f"timed out in phase {self.phase!r}")
                finally:
                    with trio.CancelScope(shield=True):
                        await self._cleanup()
                    nursery.cancel_scope.cancel()
            log_text = self._read_broker_log()
            self._log_metrics(log_text)
            checks = [] if self.skipped is not None else self._evaluate(log_text)
        finally:
            if not self.keep_tmp:
                shutil.rmtree(self.tmp, ignore_errors=True)
        duration = time.monotonic() - t_start
        self.metrics["scenario.duration_s"] = round(duration, 3)
        passed = all(c.ok for c in checks) and not self.problems and self.skipped is None
        return ScenarioResult(
            scenario=self.sc,
            passed=passed,
            started_at=started,
            duration_s=duration,
            metrics=self.metrics,
            checks=tuple(checks),
            problems=tuple(self.problems),
            clients=tuple(self._client_records()),
            faults=tuple(self.fault_log),
            broker_log_tail="\n".join(log_text.splitlines()[-40:]),
            seed=self.seed,
            skipped=self.skipped,
        )

    async def _watch_signals(self, scope: trio.CancelScope) -> None:
        # SIGINT too: Ctrl-C stops the run as SIGTERM does, killing what it started.
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async for sig in signals:
                self.interrupted = sig
                self.problems.append(f"interrupted by {signal.Signals(sig).name}")
                scope.cancel()
                return

    async def _setup_and_traffic(self) -> bool:
        """Broker, baseline, clients, traffic and faults; False if setup failed."""
        sc = self.sc
        self.phase = "network"
        try:
            await trio.to_thread.run_sync(self._build_network)
        except NetworkError as exc:
            raise _Abort(str(exc)) from None
        assert self._nursery is not None
        for node in self.nodes:
            if node.spec.proxy:
                # Before any broker starts: a link's address to it is the proxy's.
                node.proxy = FaultProxy(node.host, node.port, seed=self.seed)
                await self._nursery.start(node.proxy.serve)
        for node in self.nodes[:-1]:
            self.phase = f"start broker {node.name}"
            await self._start_broker(node)
        self.phase = "start broker"
        await self._start_broker()
        assert self._nursery is not None
        self._nursery.start_soon(self._sample_rss)
        self.phase = "baseline"
        self.baseline = await self._stats()
        if self.baseline is None:
            self.problems.append("the broker did not answer 'stats' at the start")
            return False
        b = self.baseline
        self.metrics.update(
            {
                "broker.fds_baseline": b["fds"],
                "broker.tasks_baseline": b["tasks"],
                "broker.connections_baseline": b["connections"],
                "broker.rss_baseline_mib": round(b["rss_bytes"] / _MIB, 2),
            }
        )

        self.phase = "start clients"
        held = {f.target for f in sc.faults if f.action == "start"}
        for spec in sc.clients:
            for i in range(spec.procs):
                c = await self._start_client(spec, i)
                c.held = spec.name in held
        if not await self._wait_until(
            lambda: all(c.ready or c.exited for c in self.clients),
            CLIENT_READY_TIMEOUT,
            "every client to be ready",
        ):
            return False
        failed = [c for c in self.clients if not c.ready]
        if failed:
            for c in failed:
                self.problems.append(
                    f"client {c.label} exited before it was ready:\n{c.stderr_tail()}"
                )
            return False

        self.phase = "traffic"
        self.t0 = time.monotonic()
        for c in self.clients:
            if not c.held and not c.is_exec:
                await c.send("go")
        self._nursery.start_soon(self._run_faults)
        if sc.soak is not None or self.checkpoint is not None:
            every = sc.soak.sample_every if sc.soak is not None else CHECKPOINT_INTERVAL
            self._nursery.start_soon(self._soak_sample, every)
        await self._wait_until(
            lambda: (
                self.faults_done
                and all(c.done or c.exited or c.killed for c in self.clients if c.spec.active)
            ),
            sc.timeout,
            "the active clients to finish",
        )
        self.metrics["scenario.traffic_s"] = round(time.monotonic() - self.t0, 3)
        for node in self.nodes:
            if node.proxy is not None:
                p = node.proxy
                self.metrics[f"{node.metric}.proxy.accepted"] = p.accepted
                self.metrics[f"{node.metric}.proxy.cuts"] = p.cuts
                self.metrics[f"{node.metric}.proxy.stalls"] = p.stalls
        return True

    async def _finish(self, *, settle: bool) -> None:
        """Stop the clients (collecting their reports), check for leaks, stop the broker."""
        if settle:
            self.phase = "settle"
            await trio.sleep(self.sc.settle)

        self.phase = "stop clients"
        for c in self.clients:
            if c.stopped and not c.exited:
                _signal_group(c.proc, signal.SIGCONT)
                c.stopped = False
        for c in self.clients:
            if not c.exited:
                if c.is_exec:
                    _signal_group(c.proc, signal.SIGTERM)  # a user program stops on SIGTERM
                    continue
                if c.held:  # never released: release it now so it can report
                    await c.send("go")
                await c.send("stop")
        await self._wait_until(
            lambda: all(c.exited for c in self.clients),
            CLIENT_STOP_TIMEOUT,
            "the clients to exit after 'stop'",
        )

        self.phase = "leak check"
        await self._leak_check()

        self.phase = "stop broker"
        await self._stop_broker()
        for node in self.nodes[:-1]:
            await self._stop_broker(node)

    # -- broker -----------------------------------------------------------------------------------
    def _build_network(self) -> None:
        """Before any broker starts: the namespaces of the brokers that run in one, the
        TCP ports, the TLS certificate (for every address a TLS broker listens on) and
        the token file (runs in a thread: blocking commands)."""
        for node in self.nodes:
            if node.spec.netns:
                node.ns = Namespace(f"{os.getpid() % 100000}{node.name}"[:10])
                node.ns.create()
                node.host, node.port = node.ns.inner_ip, NETNS_PORT
            elif node.spec.listen != "unix":
                node.port = free_port()  # the address is 127.0.0.1
        if any(f.action == "net-netem" for f in self.sc.faults):
            ns = next(n.ns for n in self.nodes if n.ns is not None)
            if not ns.has_netem():
                raise _Skip("the kernel has no netem queueing discipline (sch_netem)")
        tls_ips = sorted({n.host for n in self.nodes if n.spec.listen == "tls"})
        if tls_ips:
            self.tls_ca, _ = make_tls(self.tmp, tls_ips)
        (self.tmp / "token").write_text(self.token + "\n")

    def _fill(self, node: _Node | None = None) -> dict[str, str]:
        """The placeholders of a scenario's strings (docs/FAULTS.md): ``{python}``,
        ``{tmp}``, ``{socket}`` (``node``'s Unix socket, default the scenario broker's),
        ``{address}`` (what clients of it are given), ``{broker.NAME}`` (the address of
        broker NAME), ``{socket.NAME}``, ``{token_file}`` and ``{tls_ca}``."""
        node = node or self.main
        fill = {
            "python": sys.executable,
            "tmp": str(self.tmp),
            "socket": str(node.sock),
            "address": node.address,
            "token_file": str(self.tmp / "token"),
            "tls_ca": str(self.tls_ca or ""),
        }
        for n in self.nodes:
            if n.name is not None:
                fill[f"broker.{n.name}"] = n.address
                fill[f"socket.{n.name}"] = str(n.sock)
        return fill

    def _client_env(self) -> dict[str, str]:
        """What a client process needs to reach the scenario broker where it listens."""
        env = {"MSGQ_TRIO_SOCKET": self.main.address, "MSGQ_TRIO_TOKEN": self.token}
        if self.tls_ca is not None:
            env["MSGQ_TRIO_TLS_CA"] = str(self.tls_ca)
        return env

    async def _start_broker(self, node: _Node | None = None) -> float:
        """Start ``node`` (default the scenario's broker) on its socket, and its TCP
        listener if it has one; returns how long it took to listen."""
        node = node or self.main
        spec = node.spec
        argv = [
            *(node.ns.exec_prefix() if node.ns is not None else []),
            sys.executable,
            "-m",
            "msgq_trio",
            "--log-level",
            spec.log_level,
            "serve",
            "--socket",
            str(node.sock),
            *spec.argv(),
        ]
        if spec.plugins or spec.listen != "unix":
            argv += ["--config", str(self._broker_config(node))]
        t = time.monotonic()
        with _log_file(node.log, "ab") as err:
            proc = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
            )
        if spec.nofile is not None:
            # Lowering the limit of a running process is allowed; it applies to new fds.
            resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (spec.nofile, spec.nofile))
        b = _Broker(proc)
        node.procs.append(b)
        assert proc.stdout is not None
        # "listening on <socket>" comes first, then one line per TCP listener.
        want = 1 + (spec.listen != "unix")
        buf = b""
        with trio.move_on_after(BROKER_START_TIMEOUT):
            while buf.count(b"listening") < want:
                chunk = await proc.stdout.receive_some(4096)
                if not chunk:
                    break
                buf += chunk
        if buf.count(b"listening") < want:
            log = node.log.read_text(errors="replace")[-3000:] if node.log.exists() else ""
            raise _Abort(f"{node.label} did not start (stdout {buf!r}):\n{log}")
        return time.monotonic() - t

    def _broker_config(self, node: _Node) -> Path:
        """``node``'s configuration file (the same file for a restarted broker: the
        queue's store outlives it): ``[plugins.NAME]`` tables with the placeholders
        filled, the queue's store in the run's directory unless the scenario names one;
        for a TCP/TLS listener the ``[tcp]`` table (address, certificate, the run's token
        as identity ``tcp:scenario``, the scenario's own ``tcp`` settings) and an access
        rule granting that identity every verb (TCP clients get nothing by default)."""
        path = node.config
        if not path.exists():
            lines: list[str] = []
            fill = self._fill(node)
            for name, settings in node.spec.plugins.items():
                table = _fill_strings(dict(settings), fill)
                if name == "queue":
                    table.setdefault("dir", str(node.store))
                    if node.spec.queue_disk is not None:
                        self._mount_queue_disk(node.spec.queue_disk)
                lines += _toml_table(f"plugins.{name}", table)
            if node.spec.listen != "unix":
                tcp: dict[str, Any] = {
                    "listen": [f"{node.host}:{node.port}"],
                    **node.spec.tcp,
                    "tokens": {"scenario": hash_token(self.token)},
                }
                if node.spec.listen == "tls":
                    assert self.tls_ca is not None
                    tcp["certfile"] = str(self.tls_ca)
                    tcp["keyfile"] = str(self.tmp / "tls-key.pem")
                else:
                    tcp["insecure"] = True
                lines += _toml_table("tcp", tcp)
                lines += ["[[access.rule]]", 'who = ["tcp:scenario"]']
                lines += [f'{verb} = ["*"]' for verb in ACCESS_VERBS]
            path.write_text("\n".join(lines) + "\n")
        return path

    def _mount_queue_disk(self, size: int) -> None:
        """A tmpfs of ``size`` bytes for the queue's store (unmounted in ``_cleanup``).

        Raises:
            _Abort: it cannot be mounted (not root, no mount(8)): the scenario fails
                saying so, it never runs on the normal disk instead.
        """
        path = self.tmp / "queue-store"
        path.mkdir(exist_ok=True)
        try:
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                check=True,
                capture_output=True,
                text=True,
                timeout=20,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            raise _Abort(
                f"cannot mount a {size}-byte tmpfs for the queue store (needs "
                f"root): {str(detail).strip()}"
            ) from None
        self.mounted = path

    async def _stats(self, timeout: float = 5.0) -> dict[str, Any] | None:
        """The broker's ``stats`` through a short-lived probe connection (None if it does
        not answer). The probe itself is one connection in every measurement."""
        try:
            with trio.fail_after(timeout):
                async with connect(self.sock, name="scenario-probe") as bus:
                    st = await bus.call("msgq", "stats")
        except (MsgqError, trio.TooSlowError, OSError):
            return None
        return st if isinstance(st, dict) else None

    async def _sample_rss(self) -> None:
        while True:
            b = self.broker
            if b is not None and b.proc.returncode is None:
                st = _proc_status(b.pid)
                self.rss_peak = max(self.rss_peak, st.get("VmRSS", 0))
                b.hwm_bytes = max(b.hwm_bytes, st.get("VmHWM", 0))
            await trio.sleep(RSS_SAMPLE_INTERVAL)

    async def _soak_sample(self, every: float) -> None:
        """Sample the broker's ``stats`` every ``every`` seconds through the traffic (a
        broker that is down, restarting or stopped gives no sample); with a checkpoint
        file, append each sample (with the faults so far, and every minute the number
        of operations recorded in the histories) as a JSON line at once."""
        last_ops = -math.inf
        while self.phase == "traffic":
            b = self.broker
            st = await self._stats(timeout=min(5.0, every * 4))
            if st is not None and b is not None and self.phase == "traffic":
                now = time.monotonic()
                sample: dict[str, Any] = {
                    "t": round(now - self.t0, 2),
                    "pid": b.pid,
                    "age": round(now - b.started, 2),
                    "rss_bytes": st["rss_bytes"],
                    "fds": st["fds"],
                    "connections": st["connections"],
                    "tasks": st["tasks"],
                }
                self.samples.append(sample)
                if self.checkpoint is not None:
                    line = dict(sample, faults=len(self.fault_log))
                    if now - last_ops >= 60:
                        last_ops = now
                        line["faults_by_kind"] = faults_by_kind(self.fault_log)
                        line["history_ops"] = sum(
                            _count_lines(p) for p in (self.tmp / "history").glob("*.jsonl")
                        )
                    # A small append: not worth a thread (the sample's own wait dwarfs it).
                    with open(self.checkpoint, "a") as out:  # noqa: ASYNC230
                        out.write(json.dumps(line) + "\n")
            await trio.sleep(every)

    async def _leak_check(self) -> None:
        base = self.baseline
        assert base is not None
        deadline = time.monotonic() + self.sc.expect.settle_timeout
        st: dict[str, Any] | None = None
        while True:
            st = await self._stats()
            if st is not None and all(st[k] == base[k] for k in ("fds", "tasks", "connections")):
                break
            if time.monotonic() > deadline:
                break
            await trio.sleep(0.1)
        self.final_stats = st
        if st is None:
            self.problems.append("the broker did not answer 'stats' at the end")
            return
        self.metrics.update(
            {
                "broker.fds_end": st["fds"],
                "broker.tasks_end": st["tasks"],
                "broker.connections_end": st["connections"],
                "broker.pending_requests_end": st["pending_requests"],
                "broker.queued_bytes_end": st["queued_bytes"],
                "broker.groups_end": st["groups"],
                "broker.rss_end_mib": round(st["rss_bytes"] / _MIB, 2),
                "broker.rss_growth_mib": round((st["rss_bytes"] - base["rss_bytes"]) / _MIB, 2),
            }
        )
        for k, v in st.get("counters", {}).items():
            if isinstance(v, (int, float)):
                self.metrics[f"broker.counters.{k}"] = v

    async def _stop_broker(self, node: _Node | None = None) -> None:
        """SIGTERM ``node`` (default the scenario's broker; SIGCONT first, should a fault
        have left it stopped): its exit status is a figure, and for the scenario's broker
        also whether it was alive and removed its socket. The brokers of ``[brokers]``
        are not leak-checked: the scenario's own broker is the one measured."""
        node = node or self.main
        b = node.procs[-1]
        alive = b.proc.returncode is None
        if node is self.main:
            self.metrics["broker.alive"] = int(alive)
        if not alive:
            self.metrics[f"{node.metric}.exit_status"] = float(b.proc.returncode or 0)
            return
        b.hwm_bytes = max(b.hwm_bytes, _proc_status(b.pid).get("VmHWM", 0))
        _signal_group(b.proc, signal.SIGCONT)
        b.proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(BROKER_STOP_TIMEOUT):
            await b.proc.wait()
        if b.proc.returncode is None:
            self.problems.append(f"{node.label} ignored SIGTERM for {BROKER_STOP_TIMEOUT:.0f} s")
            return
        self.metrics[f"{node.metric}.exit_status"] = b.proc.returncode
        if node is self.main:
            self.metrics["broker.socket_removed"] = int(not _exists(self.sock))

    # -- clients ----------------------------------------------------------------------------------
    async def _start_client(self, spec: ClientSpec, index: int, generation: int = 0) -> _Client:
        if spec.role == "exec":
            return await self._start_exec(spec, index, generation)
        argv = [
            sys.executable,
            "-m",
            "msgq_trio.scenario.clients",
            spec.role,
            "--socket",
            # Raw-socket roles speak to the Unix socket (the broker always serves it).
            self.main.address if spec.info.library else str(self.sock),
            "--name",
            f"{spec.name}-{index}",
            "--index",
            str(index),
            "--params",
            json.dumps(spec.params),
        ]
        log_path = self.tmp / f"{spec.name}-{index}.log"
        with _log_file(log_path, "wb") as err:
            proc = await trio.lowlevel.open_process(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=dict(os.environ, **self._client_env()),
                start_new_session=True,
            )
        c = _Client(spec, index, proc, log_path)
        self.clients.append(c)
        assert self._nursery is not None
        self._nursery.start_soon(self._read_client, c)
        return c

    async def _start_exec(self, spec: ClientSpec, index: int, generation: int = 0) -> _Client:
        """Start a user program: its argv with the placeholders filled in, the broker's
        address and its history file in the environment, stdout read by the runner (and
        kept in ``NAME-I.stdout``), stderr in ``NAME-I.log``. A restarted program is a new
        process in the history (``NAME-I.G``, G its restarts): its operation ids start
        again, and what the killed one left open stays open."""
        name = f"{spec.name}-{index}" + (f".{generation}" if generation else "")
        history = self.tmp / "history" / f"{name}.jsonl"
        history.parent.mkdir(exist_ok=True)
        fill = {**self._fill(), "name": name}

        # Only these placeholders: any other brace (JSON in an argument) stays.
        argv: list[str] = _fill_strings(list(spec.params["command"]), fill)
        env = dict(
            os.environ,
            **self._client_env(),
            MSGQ_TRIO_HISTORY=str(history),
            MSGQ_TRIO_CLIENT=name,
            MSGQ_TRIO_SEED=str(self.seed),
        )
        for entry in spec.params["env"]:
            k, _, v = entry.partition("=")
            env[k] = _fill_strings(v, fill)
        log_path = self.tmp / f"{name}.log"
        try:
            with _log_file(log_path, "ab") as err:
                proc = await trio.lowlevel.open_process(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    env=env,
                    start_new_session=True,
                )
        except OSError as exc:
            raise _Abort(f"cannot start {name}: {argv!r}: {exc}") from None
        c = _Client(spec, index, proc, log_path)
        c.history_name = name
        ready = spec.params["ready"]
        c.ready = not ready
        self.clients.append(c)
        assert self._nursery is not None
        self._nursery.start_soon(self._read_client, c)
        if ready.startswith("member:"):
            self._nursery.start_soon(self._watch_member, c, ready.partition(":")[2])
        return c

    async def _watch_member(self, c: _Client, group: str) -> None:
        """Mark ``c`` ready once its process (or a child of it: a shell wrapper) is a
        member of ``group``."""
        while not c.ready and not c.exited:
            try:
                with trio.fail_after(5):
                    async with connect(self.sock, name="scenario-probe") as bus:
                        pids = {m.pid for m in await bus.members(group)}
            except (MsgqError, trio.TooSlowError, OSError):
                pids = set()
            if pids & _family(c.proc.pid):
                c.ready = True
                self._notify()
                return
            await trio.sleep(0.1)

    async def _read_client(self, c: _Client) -> None:
        """Parse the client's stdout lines until EOF, then reap it."""
        stream = c.proc.stdout
        assert stream is not None
        buf = b""
        while True:
            try:
                chunk = await stream.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self._client_line(c, line.decode(errors="replace"))
        await c.proc.wait()
        c.exited = True
        self._notify()

    def _client_line(self, c: _Client, line: str) -> None:
        if c.is_exec:
            with open(self.tmp / f"{c.spec.name}-{c.index}.stdout", "a") as out:
                out.write(line + "\n")
            if len(c.other_output) < 10_000:  # for line: triggers; the file has them all
                c.other_output.append(line)
            ready = c.spec.params["ready"]
            if not c.ready and ready.startswith("line:") and ready[5:] in line:
                c.ready = True
                self._notify()
            return
        try:
            msg = json.loads(line)
        except ValueError:
            c.other_output.append(line)
            return
        if not isinstance(msg, dict):
            return
        ev = msg.get("event")
        if ev == "ready":
            c.ready = True
            c.lnames = list(msg.get("lnames", []))
        elif ev == "done":
            c.done = True
        elif ev == "report":
            c.report = msg
        self._notify()

    # -- faults -----------------------------------------------------------------------------------
    async def _run_faults(self) -> None:
        try:
            for f in self.sc.faults:
                delay = self.t0 + f.at - time.monotonic()
                if delay > 0:
                    await trio.sleep(delay)
                if f.when is not None:
                    await self._when(f.when)
                at_ms = (time.monotonic() - self.t0) * 1000
                self.metrics[f"fault.{f.name}.at_ms"] = round(at_ms, 1)
                entry: dict[str, Any] = {
                    "name": f.name,
                    "action": f.action,
                    "target": f.target if f.index is None else f"{f.target}#{f.index}",
                    "at_s": f.at,
                    "done_ms": round(at_ms, 1),
                    "pids": [],
                }
                self.fault_log.append(entry)
                await self._apply(f, entry)
        except _Abort as exc:
            self.problems.append(f"fault {self.fault_log[-1]['name']!r}: {exc}")
        finally:
            self.faults_done = True
            self._notify()

    async def _when(self, when: tuple[str, str, int]) -> None:
        """Wait for a fault's trigger (bounded by the scenario's timeout); polled every
        50 ms, since the events happen in other processes."""
        kind, arg, n = when
        while True:
            if kind == "member":
                try:
                    with trio.fail_after(5):
                        async with connect(self.sock, name="scenario-probe") as bus:
                            if len(await bus.members(arg)) >= n:
                                return
                except (MsgqError, trio.TooSlowError, OSError):
                    pass
            elif kind == "done":
                procs = [c for c in self.clients if c.spec.name == arg]
                if procs and all(c.done or c.exited for c in procs):
                    return
            elif kind == "line":
                client, _, needle = arg.partition(":")
                if any(
                    needle in line
                    for c in self.clients
                    if c.spec.name == client
                    for line in c.other_output
                ):
                    return
            elif sum(_count_lines(p) for p in (self.tmp / "history").glob("*.jsonl")) >= n:
                return
            await trio.sleep(0.05)

    async def _apply(self, f: FaultSpec, entry: dict[str, Any]) -> None:
        if f.action == "kill-plugin":
            await self._kill_plugin(str(f.target), entry)
            return
        if f.action in ("fill-disk", "free-disk"):
            self._disk(f.action == "fill-disk")
            return
        if f.action == PROXY_ACTION:
            proxy = self._node(f.target).proxy
            assert proxy is not None and f.proxy is not None  # the model checked both
            proxy.apply(f.proxy)
            return
        if f.action in NET_ACTIONS:
            ns = self._node(f.target).ns
            assert ns is not None
            try:
                if f.action in ("net-cut", "net-heal"):
                    await trio.to_thread.run_sync(ns.cut, f.action == "net-cut")
                else:
                    await trio.to_thread.run_sync(ns.netem, f.netem)
            except NetworkError as exc:
                raise _Abort(str(exc)) from None
            return
        if f.action in ("kill-broker", "stop-broker", "cont-broker", "restart-broker"):
            node = self._node(f.target)
            b = node.procs[-1]
            entry["pids"] = [b.pid]
            if f.action == "kill-broker":
                b.hwm_bytes = max(b.hwm_bytes, _proc_status(b.pid).get("VmHWM", 0))
                _signal_group(b.proc, signal.SIGKILL)
                await b.proc.wait()
            elif f.action == "stop-broker":
                _signal_group(b.proc, signal.SIGSTOP)
            elif f.action == "cont-broker":
                _signal_group(b.proc, signal.SIGCONT)
            else:
                if b.proc.returncode is None:
                    _signal_group(b.proc, signal.SIGKILL)
                    await b.proc.wait()
                took = await self._start_broker(node)
                self.metrics[f"{node.metric}.restart_ms"] = round(took * 1000, 1)
                key = f"{node.metric}.restarts"
                self.metrics[key] = self.metrics.get(key, 0) + 1
                entry["pids"] = [node.procs[-1].pid]
            return
        targets = [
            c
            for c in self.clients
            if c.spec.name == f.target
            and (f.index is None or c.index == f.index)
            and not c.replaced
        ]
        entry["pids"] = [c.proc.pid for c in targets]
        for c in targets:
            if f.action == "restart":
                await self._restart_client(c)
                continue
            if c.exited:
                continue
            if f.action == "start":
                c.held = False
                await c.send("go")
                continue
            sig = CLIENT_SIGNALS[f.action]
            # Only the client process itself: it is its own process group leader.
            c.proc.send_signal(sig)
            if f.action == "sigkill":
                c.killed = True
            elif f.action == "sigstop":
                c.stopped = True
            elif f.action == "sigcont":
                c.stopped = False
        self._notify()

    def _node(self, name: str | None) -> _Node:
        """The broker a fault names (None: the scenario's own)."""
        return next(n for n in self.nodes if n.name == name)

    async def _restart_client(self, c: _Client) -> None:
        """SIGKILL ``c`` (if it still runs) and start the same process again; a built-in
        role gets ``go`` once it is ready."""
        if not c.exited:
            _signal_group(c.proc, signal.SIGKILL)
            await c.proc.wait()
        c.killed = True
        c.replaced = True
        new = await self._start_client(c.spec, c.index, c.generation + 1)
        new.generation = c.generation + 1
        if not await self._wait_until(
            lambda: new.ready or new.exited,
            CLIENT_READY_TIMEOUT,
            f"{new.label} to be ready after its restart",
        ):
            raise _Abort(f"{new.label} was not ready after its restart")
        if not new.is_exec:
            await new.send("go")
        n = f"{c.spec.name}.restarts"
        self.metrics[n] = self.metrics.get(n, 0) + 1

    def _disk(self, fill: bool) -> None:
        """Fill the queue store's tmpfs to its last byte with a filler file, or delete
        it; ``plugin.queue.disk_filled_mib`` says how much the filler took."""
        assert self.mounted is not None
        filler = self.mounted / "filler"
        if not fill:
            filler.unlink(missing_ok=True)
            return
        written = 0
        with open(filler, "ab", buffering=0) as f:
            for chunk in (1 << 20, 1 << 12):
                block = bytes(chunk)
                while True:
                    try:
                        written += f.write(block) or 0
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise _Abort(f"fill-disk: {exc}") from None
                        break
        self.metrics["plugin.queue.disk_filled_mib"] = round(written / _MIB, 2)

    async def _kill_plugin(self, name: str, entry: dict[str, Any]) -> None:
        """SIGKILL the broker's ``name`` plugin process and wait until its supervisor
        reports a new one ready (``plugin NAME ready (pid N)`` in the broker's log)."""
        pattern = re.compile(rf"plugin {re.escape(name)} ready \(pid (\d+)\)")
        before = pattern.findall(self._read_broker_log())
        if not before:
            raise _Abort(f"plugin {name!r} never became ready (nothing to kill)")
        pid = int(before[-1])
        entry["pids"] = [pid]
        t = time.monotonic()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not await self._wait_until(
            lambda: len(pattern.findall(self._read_broker_log())) > len(before),
            BROKER_START_TIMEOUT,
            f"the {name} plugin to be restarted",
        ):
            raise _Abort(f"the broker did not restart plugin {name!r}")
        key = f"plugin.{name}"
        self.metrics[f"{key}.restart_ms"] = round((time.monotonic() - t) * 1000, 1)
        self.metrics[f"{key}.kills"] = self.metrics.get(f"{key}.kills", 0) + 1

    # -- cleanup ----------------------------------------------------------------------------------
    async def _cleanup(self) -> None:
        """Kill and reap every process we started (whole process groups), close pipes."""
        procs = [c.proc for c in self.clients] + [b.proc for n in self.nodes for b in n.procs]
        for p in procs:
            if p.returncode is None:
                _signal_group(p, signal.SIGCONT)
                _signal_group(p, signal.SIGKILL)
        for p in procs:
            with trio.move_on_after(10):
                await p.wait()
            for stream in (p.stdin, p.stdout, p.stderr):
                if stream is not None:
                    await stream.aclose()
        for c in self.clients:
            c.exited = True
        if self.mounted is not None:
            with trio.move_on_after(20):
                await trio.run_process(
                    ["umount", "-l", str(self.mounted)],
                    check=False,
                    capture_stdout=True,
                    capture_stderr=True,
                )
            self.mounted = None
        for node in self.nodes:
            if node.ns is not None:
                await trio.to_thread.run_sync(node.ns.delete)

    # -- figures and verdict ----------------------------------------------------------------------
    def _read_broker_log(self) -> str:
        try:
            return self.broker_log.read_text(errors="replace")
        except OSError:
            return ""

    def _log_metrics(self, log_text: str) -> None:
        m = self.metrics
        lines = log_text.splitlines()
        m["broker.log_lines"] = len(lines)
        m["broker.log_warnings"] = sum(" WARNING " in ln for ln in lines)
        m["broker.log_errors"] = sum(" ERROR " in ln for ln in lines)
        m["broker.log_tracebacks"] = sum(ln.startswith("Traceback") for ln in lines)
        m["broker.rss_peak_mib"] = round(
            max([self.rss_peak] + [b.hwm_bytes for b in self.brokers]) / _MIB, 2
        )
        m.setdefault("broker.restarts", 0)
        self._client_metrics()
        if self.sc.soak is not None:
            m.update(flatness(self.samples, self.sc.soak))
            m.update(faults_by_kind(self.fault_log))

    def _client_metrics(self) -> None:
        m = self.metrics
        healthy_samples: list[float] = []
        healthy_max = 0.0
        healthy_n = 0
        failures = 0
        for spec in self.sc.clients:
            procs = [c for c in self.clients if c.spec is spec]
            n = spec.name
            m[f"{n}.procs"] = len(procs)
            m[f"{n}.killed"] = sum(c.killed for c in procs)
            reports = [c.report for c in procs if c.report is not None]
            m[f"{n}.reports"] = len(reports)
            for c in procs:
                if c.killed:
                    continue
                rc = c.proc.returncode
                if c.is_exec:
                    if not self._exec_ended_well(c):
                        failures += 1
                    continue
                err = c.report.get("error") if c.report else None
                if c.report is None or rc != 0 or err:
                    failures += 1
                    self.problems.append(
                        f"client {c.label} (pid {c.proc.pid}) ended badly: exit status {rc}, "
                        f"report {'missing' if c.report is None else 'error ' + str(err)}\n"
                        f"{c.stderr_tail()}"
                    )
            counts: dict[str, float] = {}
            times: dict[str, float] = {}
            samples: list[float] = []
            lat_n = 0
            lat_max = 0.0
            for r in reports:
                for k, v in r.get("counts", {}).items():
                    counts[k] = counts.get(k, 0) + v
                for k, v in r.get("times", {}).items():
                    rel = round((v - self.t0) * 1000, 1)
                    pick = min if k.startswith("first.") else max
                    times[k] = pick(times.get(k, rel), rel)
                for k, v in r.get("max", {}).items():
                    m[f"{n}.max.{k}"] = round(max(m.get(f"{n}.max.{k}", v), v), 3)
                for k, v in r.get("min", {}).items():
                    m[f"{n}.min.{k}"] = round(min(m.get(f"{n}.min.{k}", v), v), 3)
                lat = r.get("latency", {})
                lat_n += lat.get("n", 0)
                lat_max = max(lat_max, lat.get("max_ms", 0.0))
                samples += lat.get("samples", [])
            for k, v in counts.items():
                m[f"{n}.{k}"] = v
            for k, v in times.items():
                m[f"{n}.{k}"] = v
            if lat_n:
                m.update(_latency_metrics(f"{n}.latency", samples, lat_n, lat_max))
                if spec.healthy:
                    healthy_samples += samples
                    healthy_n += lat_n
                    healthy_max = max(healthy_max, lat_max)
        m["scenario.client_failures"] = failures
        if healthy_n:
            m.update(_latency_metrics("latency", healthy_samples, healthy_n, healthy_max))

    def _exec_ended_well(self, c: _Client) -> bool:
        """A user program ended as its spec says: an active one with ``exit_status``, a
        service by the scenario's SIGTERM (or 0); otherwise a problem naming it."""
        rc = c.proc.returncode
        if c.spec.active:
            ok = bool(rc == c.spec.params["exit_status"])
            want = f"exit status {c.spec.params['exit_status']}"
        else:
            ok = rc in (0, -signal.SIGTERM, 128 + signal.SIGTERM)
            want = "to stop on SIGTERM"
        if not ok:
            self.problems.append(
                f"program {c.label} (pid {c.proc.pid}) ended with {rc}, expected {want}\n"
                f"{c.stderr_tail()}"
            )
        return ok

    def _history(self) -> list[CheckResult]:
        """Check the merged history of every process (``expect.history``); each
        violation is a problem naming its operations."""
        e = self.sc.expect.history
        if e is None:
            return []
        histories = []
        for path in sorted((self.tmp / "history").glob("*.jsonl")):
            try:
                histories.append(parse(path.read_text().splitlines(), path.name))
            except (OSError, HistoryError) as exc:
                self.problems.append(f"history {path.name}: {exc}")
        ops = merge(histories)
        self.metrics["history.ops"] = len(ops)
        for op in ops:
            # history.ok.send, history.fail.send, history.error.queue-full, ...
            for k in (
                f"history.{op.type}.{op.f}",
                *([f"history.error.{op.error}"] if op.error else []),
            ):
                self.metrics[k] = self.metrics.get(k, 0) + 1
        ended = {c.history_name for c in self.clients if c.killed}
        found = check(
            ops,
            lost=e.lost,
            duplicates=e.duplicates,
            duplicates_per=e.duplicates_per,
            order=e.order,
            answered_once=e.answered_once,
            allowed_errors=e.allowed_errors,
            silence=e.silence,
            until=ops[-1].time if ops else None,
            ended=ended,
            reaches_each=[f"{name}-" for name in e.reaches_each],
        )
        for v in found:
            self.problems.append(f"history check {v.check}: {v.message}")
        out = []
        for name, on in (
            ("lost", e.lost),
            ("reaches-each", bool(e.reaches_each)),
            ("duplicates", e.duplicates),
            ("order", e.order),
            ("answered-once", e.answered_once),
            ("silence", e.silence is not None),
        ):
            if on:
                n = sum(v.check == name for v in found)
                out.append(CheckResult(f"history: {name}", "0 violations", n, n == 0))
        out.append(CheckResult("history: operations recorded", "> 0", len(ops), bool(ops)))
        return out

    def _client_records(self) -> list[dict[str, Any]]:
        out = []
        for spec in self.sc.clients:
            procs = [c for c in self.clients if c.spec is spec]
            out.append(
                {
                    "name": spec.name,
                    "role": spec.role,
                    "procs": spec.procs,
                    "healthy": spec.healthy,
                    "params": spec.params,
                    "pids": [c.proc.pid for c in procs],
                    "exit_status": [c.proc.returncode for c in procs],
                    "killed": [c.index for c in procs if c.killed],
                }
            )
        return out

    def _evaluate(self, log_text: str) -> list[CheckResult]:
        sc, e, m = self.sc, self.sc.expect, self.metrics
        checks: list[CheckResult] = []
        history = self._history()  # first: its figures (history.*) may be counted below

        def add(check: str, expected: str, actual: float | None, ok: bool) -> None:
            checks.append(CheckResult(check, expected, actual, ok))

        def bound(metric: str, op: str, value: float) -> None:
            actual = m.get(metric)
            add(
                f"{metric} {op} {_fmt(value)}",
                f"{op} {_fmt(value)}",
                actual,
                actual is not None and _compare(actual, op, value),
            )

        bound("scenario.client_failures", "==", 0)
        bound("broker.log_tracebacks", "==", 0)
        if e.broker_alive:
            bound("broker.alive", "==", 1)
            bound("broker.exit_status", "==", 0)
            bound("broker.socket_removed", "==", 1)
        base = self.baseline
        if base is not None:
            if e.fds_baseline:
                bound("broker.fds_end", "==", base["fds"])
                bound("broker.connections_end", "==", base["connections"])
            if e.tasks_baseline:
                bound("broker.tasks_end", "==", base["tasks"])
        if e.rss_max_mib is not None:
            bound("broker.rss_peak_mib", "<=", e.rss_max_mib)
        if sc.soak is not None:
            # Flat: the end window's median within max_growth_pct of the reference's.
            bound("soak.rss_growth_pct", "<", sc.soak.max_growth_pct)
            bound("soak.fds_growth_pct", "<", sc.soak.max_growth_pct)
        if e.latency_p99_ms is not None:
            bound("latency.p99_ms", "<=", e.latency_p99_ms)
        if e.latency_max_ms is not None:
            bound("latency.max_ms", "<=", e.latency_max_ms)
        for pat in e.log:
            n = len(re.findall(pat, log_text, re.MULTILINE))
            add(f"broker log matches /{pat}/", ">= 1 line", n, n >= 1)
        for pat in e.log_absent:
            n = len(re.findall(pat, log_text, re.MULTILINE))
            add(f"broker log does not match /{pat}/", "0 lines", n, n == 0)
        names = {c.name for c in sc.clients}
        for chk in e.counts:
            try:
                actual = _lookup(chk.metric, m, names)
                rhs = _evaluate_expr(chk.expr, m, names)
            except KeyError as exc:
                add(str(chk), f"{chk.op} {chk.expr}", None, False)
                self.problems.append(f"check {chk}: unknown metric {exc.args[0]!r}")
                continue
            add(str(chk), f"{chk.op} {_fmt(rhs)}", actual, _compare(actual, chk.op, rhs))
        checks += history
        return checks


def _fill_strings(value: Any, fill: dict[str, str]) -> Any:
    """``value`` with the placeholders named in ``fill`` (``{python}``, ``{socket}``,
    ``{tmp}``, ``{name}``) filled in every string it holds: a program's argv and
    environment, a link's ``address`` to a second broker in the run's directory; nothing
    else in braces is touched."""
    if isinstance(value, str):
        for key, v in fill.items():
            value = value.replace("{" + key + "}", v)
        return value
    if isinstance(value, dict):
        return {k: _fill_strings(v, fill) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_strings(v, fill) for v in value]
    return value


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 16), b""))
    except OSError:
        return 0


def _family(pid: int) -> set[int]:
    """``pid`` and its descendants (a program started through a shell is its child)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo += children.get(p, [])
    return out


def _toml_table(name: str, table: dict[str, Any]) -> list[str]:
    """``[name]`` and its keys in TOML (nested tables as ``[name.key]``): the values a
    scenario's ``broker.plugin`` tables hold (strings, numbers, booleans, lists)."""
    lines = [f"[{name}]"]
    nested = []
    for k, v in table.items():
        if isinstance(v, dict):
            nested.append((k, v))
        else:
            lines.append(f"{json.dumps(k)} = {json.dumps(v)}")
    for k, v in nested:
        lines += _toml_table(f"{name}.{json.dumps(k)}", v)
    return lines


class _Abort(Exception):
    """A phase cannot continue (reported as a problem by the caller)."""


class _Skip(Exception):
    """This machine cannot run the scenario (the result says why; nothing ran)."""


def _compare(a: float, op: str, b: float) -> bool:
    if op == "==":
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if op == "!=":
        return not math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]


def _lookup(name: str, metrics: dict[str, float], clients: set[str]) -> float:
    """A metric's value. Counts a client never reported are 0 (no error of that kind);
    any other unknown name raises KeyError (a typo must not pass silently)."""
    if name in metrics:
        return float(metrics[name])
    base = name.split(".", 1)[0]
    if base in clients and not re.search(r"\.(latency|max|min|first|last)\.", "." + name):
        return 0.0
    raise KeyError(name)


def _evaluate_expr(expr: str, metrics: dict[str, float], clients: set[str]) -> float:
    """Numbers and metric names joined by ``+ - * /`` (usual precedence, left to right)."""
    tokens = expr.split()
    values: list[float] = []
    ops: list[str] = []
    for i, tok in enumerate(tokens):
        if i % 2:
            ops.append(tok)
            continue
        try:
            v = float(tok)
        except ValueError:
            v = _lookup(tok, metrics, clients)
        if ops and ops[-1] in ("*", "/"):
            op = ops.pop()
            prev = values.pop()
            v = prev * v if op == "*" else (prev / v if v else math.inf)
        values.append(v)
    total = values[0]
    for op, v in zip(ops, values[1:], strict=True):
        total = total + v if op == "+" else total - v
    return total


def _latency_metrics(prefix: str, samples: list[float], n: int, max_ms: float) -> dict[str, float]:
    s = sorted(samples)

    def pct(q: float) -> float:
        if not s:
            return 0.0
        return round(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))], 3)

    return {
        f"{prefix}.n": n,
        f"{prefix}.p50_ms": pct(0.50),
        f"{prefix}.p99_ms": pct(0.99),
        f"{prefix}.max_ms": round(max_ms, 3),
    }
