"""The systems under test and how to start (and always stop) their brokers.

* ``msgq_trio``: a real broker process (``python -m msgq_trio serve``, via
  :func:`msgq_trio.demo.start_broker`) on a Unix socket in the run's directory;
  Its responder answers through an ``async def`` handler, the form the README teaches
  (a task per request);
* ``msgq_trio-def-handler``: the same, the responder's handler a plain ``def`` (answered
  inline by the reader), on the request/reply workloads: the form that earlier
  records in BENCHMARKS.md measured as ``msgq_trio``;
* ``msgq_trio-asyncio`` and ``msgq_trio-asyncio-def-handler``: the same broker and roles
  with the asyncio client (``msgq_trio.aio.connect``, :mod:`benchmarks.worker_msgq_aio`);
* ``msgq_trio-direct``: the same broker, with the direct blocking client
  (:func:`msgq_trio.connect_direct`) on the request/reply workloads;
* ``msgq_trio-c``: the same broker, every client a C process on libmsgq (clients/c:
  :mod:`benchmarks.worker_msgq_c` execs ``msgq-bench``, built with meson on first use
  by :mod:`benchmarks.cbuild`);
* ``msgq_trio-no-busy-poll`` and ``msgq_trio-direct-no-busy-poll``: the same two clients
  on the request/reply workloads, the broker started with ``--busy-poll 0`` (it sleeps
  in ``epoll_wait`` after every read instead of polling while frames come back to back,
  which it does by default) and the trio clients with ``connect(busy_poll=0)`` (no
  polling for answers; the direct client never polls); the goal table shows them in
  rows of their own, beside the default configuration's;
* ``msgq_trio-no-splice``: the trio clients on the 4 MiB workload, the broker started
  with ``--splice-min-size 0``, so large frames are copied into the broker and out
  again instead of spliced through pipes (``limits.splice_min_size``, on by default);
* ``raw-unix`` (ceiling): no broker; clients talk process to process;
* ``py-relay`` (ceiling): the minimal Python relay of :mod:`benchmarks.relay`;
* ``nats``: ``nats-server`` on a free loopback port (NATS has no Unix socket listener),
  ``max_payload`` raised to 8 MiB for the 4 MiB messages, big ``max_pending`` so no
  subscriber is cut off as a slow consumer;
* ``redis``: ``redis-server`` on a Unix socket only, no persistence, no output-buffer
  limit for pub/sub clients; ``redis-asyncio``: the same server, redis.asyncio clients;
* ``zeromq``: a ``zmq.proxy`` process (XSUB/XPUB or ROUTER/DEALER) on ``ipc://``;
* ``rabbitmq`` (``--rabbitmq``): one rabbitmq-server for the whole benchmark (an Erlang
  node is slow to start), :data:`benchmarks.durable.SHARED_RABBIT`, on free loopback ports;
  each run uses its own exchange and queues, named after the run's directory.

A fresh broker is started for every run and stopped after it, except RabbitMQ.

The asyncio clients (``System.asyncio``: msgq_trio-asyncio, nats-py, redis.asyncio,
aiormq) also get a table of their own in the report, side by side.
"""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msgq_trio._procs import free_port

from .procs import Proc, Service, stop_popen, stop_proc, wait_all, wait_port, wait_unix

SUBJECT, CEILING, PEER = "subject", "ceiling", "peer"


@dataclass(frozen=True)
class System:
    name: str
    kind: str  # SUBJECT, CEILING or PEER
    module: str  # the worker module its clients run
    description: str
    start: Callable[[Path, str, float], Service]  # (run dir, pattern, deadline)
    #: Workloads this system runs (all when empty); the others show as ``n/a (not_run)``.
    only: tuple[str, ...] = ()
    not_run: str = ""
    #: Extra entries of every worker's spec (``{"handler": "plain"}``...).
    spec: dict[str, Any] = field(default_factory=dict)
    #: An asyncio client: the report's "asyncio clients" table puts it beside the others.
    asyncio: bool = False


def one_user_args(run_dir: Path, connections: int, subscriptions: int = 0) -> tuple[str, ...]:
    """``serve`` flags for a broker whose ``connections`` clients (and ``subscriptions``,
    0: the default) are all one user's: room for them, and that user's quotas raised to
    match (docs/SECURITY.md: by default one user may hold half of ``max_connections``), as
    such a deployment configures it."""
    config = run_dir / "one-user.toml"
    lines = ["[quotas]", f"connections = {connections}"]
    if subscriptions:
        lines.append(f"subscriptions = {subscriptions}")
    config.write_text("\n".join(lines) + "\n")
    return ("--max-connections", str(connections), "--config", str(config))


def _start_msgq(
    run_dir: Path,
    _pattern: str,
    _deadline: float,
    serve_args: tuple[str, ...] = (),
    client_busy_poll: float | None = None,
) -> Service:
    """A msgq_trio broker with ``serve_args``; ``client_busy_poll``: the trio clients'
    ``connect(busy_poll=...)`` (None: their default)."""
    from msgq_trio.demo import start_broker

    path = run_dir / "bus.sock"
    broker = start_broker(path, *serve_args)
    addr: dict[str, Any] = {"socket": str(path)}
    if client_busy_poll is not None:
        addr["busy_poll"] = client_busy_poll
    return Service(addr, [stop_popen(broker)], [broker.pid])


#: The token of the TCP variants' broker (a throwaway: the broker lives for one run).
BENCH_TOKEN = "msgq-trio-bench-token"


def _start_msgq_tcp(run_dir: Path, _pattern: str, _deadline: float, *, tls: bool) -> Service:
    """msgq_trio with its clients on TCP loopback (token auth, an allow-all rule), over
    TLS with a fresh self-signed certificate (openssl CLI, :func:`make_tls`) when ``tls``."""
    from msgq_trio.core.access import hash_token
    from msgq_trio.demo import start_broker
    from msgq_trio.scenario.network import make_tls

    port = free_port()
    lines = [
        "[tcp]",
        f'listen = ["127.0.0.1:{port}"]',
        f'tokens = {{ bench = "{hash_token(BENCH_TOKEN)}" }}',
    ]
    addr: dict[str, Any] = {
        "socket": f"{'tls' if tls else 'tcp'}://127.0.0.1:{port}",
        "token": BENCH_TOKEN,
    }
    if tls:
        cert, key = make_tls(run_dir, ["127.0.0.1"])
        lines += [f'certfile = "{cert}"', f'keyfile = "{key}"']
        addr["cafile"] = str(cert)
    else:
        lines.append("insecure = true")
    lines += [
        "[[access.rule]]",
        'who = ["tcp:bench"]',
        'send = ["*"]',
        'subscribe = ["*"]',
        'call = ["*"]',
    ]
    conf = run_dir / "broker.toml"
    conf.write_text("\n".join(lines) + "\n")
    path = run_dir / "bus.sock"
    # start_broker returns once it printed "listening", which comes after every listener
    # (TCP included) is bound: no port probe (a probe is a failed TLS handshake in the log).
    broker = start_broker(path, "--config", str(conf))
    return Service(addr, [stop_popen(broker)], [broker.pid])


def msgq_variant(name: str, description: str, *serve_args: str) -> System:
    """msgq_trio with extra ``msgq-trio serve`` flags (``--capture-dir DIR``...), for the
    msgq_trio-only figures; not one of :data:`SYSTEMS`, so not in the peer table."""
    return System(
        name,
        SUBJECT,
        "worker_msgq",
        description,
        functools.partial(_start_msgq, serve_args=serve_args),
    )


def _start_msgq_c(run_dir: Path, pattern: str, deadline: float) -> Service:
    """A msgq_trio broker, and in the address the C worker to exec (built if missing:
    a failed build is this run's error, reported as the row's cell)."""
    from .cbuild import c_worker

    binary = c_worker()
    svc = _start_msgq(run_dir, pattern, deadline)
    svc.addr["c_worker"] = binary
    return svc


def _start_raw(run_dir: Path, _pattern: str, _deadline: float) -> Service:
    return Service({"mode": "direct", "dir": str(run_dir)})


def _start_relay(run_dir: Path, _pattern: str, deadline: float) -> Service:
    path = run_dir / "relay.sock"
    addr = {"mode": "relay", "socket": str(path)}
    proc = Proc.worker(
        "relay",
        "relay",
        {
            "role": "relay",
            "addr": addr,
            "deadline": max(1.0, deadline - time.monotonic()),
        },
        run_dir,
    )
    svc = Service(addr, [stop_proc(proc)], [proc.popen.pid])
    try:
        wait_all([proc], "READY", deadline)
    except BaseException:
        svc.stop()
        raise
    return svc


def _start_nats(run_dir: Path, _pattern: str, deadline: float) -> Service:
    binary = shutil.which("nats-server")
    if binary is None:
        raise RuntimeError("nats-server is not installed")
    port = free_port()
    conf = run_dir / "nats.conf"
    conf.write_text(
        f"host: 127.0.0.1\nport: {port}\n"
        'max_payload: 8MB\nmax_pending: 2GB\nwrite_deadline: "60s"\n'
    )
    proc = Proc("nats-server", [binary, "-c", str(conf)], run_dir, stdin=False)
    svc = Service({"url": f"nats://127.0.0.1:{port}"}, [stop_proc(proc)], [proc.popen.pid])
    try:
        wait_port("127.0.0.1", port, min(deadline, time.monotonic() + 15), proc)
    except BaseException:
        svc.stop()
        raise
    return svc


def _start_redis(run_dir: Path, _pattern: str, deadline: float) -> Service:
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
            "no",
            "--daemonize",
            "no",
            "--client-output-buffer-limit",
            "pubsub 0 0 0",
            # Past its default of 10,000 (the scale workloads hold more); Redis lowers
            # it to what its descriptor limit allows.
            "--maxclients",
            "60000",
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


def _start_zmq(run_dir: Path, pattern: str, deadline: float) -> Service:
    addr = {"dir": str(run_dir)}
    proc = Proc.worker(
        "zmq-proxy",
        "worker_zmq",
        {
            "role": "proxy",
            "mode": pattern,
            "addr": addr,
            "deadline": max(1.0, deadline - time.monotonic()),
        },
        run_dir,
    )
    svc = Service(addr, [stop_proc(proc)], [proc.popen.pid])
    try:
        wait_all([proc], "READY", deadline)
    except BaseException:
        svc.stop()
        raise
    return svc


def _start_rabbit(run_dir: Path, _pattern: str, _deadline: float) -> Service:
    from .durable import SHARED_RABBIT

    svc = SHARED_RABBIT.get()
    if svc is None:
        raise RuntimeError(SHARED_RABBIT.error)
    # No stop action: run_bench stops the shared server when the benchmark ends.
    return Service({**svc.addr, "ns": run_dir.name}, [], list(svc.pids))


_CALLS_ONLY = ("req-reply", "concurrent")
#: The plain-``def`` responder rows: the handler form matters for calls only.
_PLAIN = {"handler": "plain"}
_PLAIN_NOT_RUN = "a handler row: calls only"

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System(
            "msgq_trio",
            SUBJECT,
            "worker_msgq",
            "msgq_trio broker process; trio clients (group send, bus.call, async def handler)",
            _start_msgq,
        ),
        System(
            "msgq_trio-def-handler",
            SUBJECT,
            "worker_msgq",
            "msgq_trio broker process; trio clients, the handler a plain def (inline)",
            _start_msgq,
            only=_CALLS_ONLY,
            not_run=_PLAIN_NOT_RUN,
            spec=_PLAIN,
        ),
        System(
            "msgq_trio-asyncio",
            SUBJECT,
            "worker_msgq_aio",
            "msgq_trio broker process; asyncio clients (msgq_trio.aio, async def handler)",
            _start_msgq,
            asyncio=True,
        ),
        System(
            "msgq_trio-asyncio-def-handler",
            SUBJECT,
            "worker_msgq_aio",
            "msgq_trio broker process; asyncio clients, the handler a plain def (inline)",
            _start_msgq,
            only=_CALLS_ONLY,
            not_run=_PLAIN_NOT_RUN,
            spec=_PLAIN,
            asyncio=True,
        ),
        # The direct client is for calls (a blocking thread per connection, a syscall per
        # send): the two request/reply columns.
        System(
            "msgq_trio-direct",
            SUBJECT,
            "worker_msgq_direct",
            "msgq_trio broker process; direct blocking clients (connect_direct, bus.call)",
            _start_msgq,
            only=_CALLS_ONLY,
            not_run="not run: the direct client is for calls",
        ),
        System(
            "msgq_trio-c",
            SUBJECT,
            "worker_msgq_c",
            "msgq_trio broker process; C clients (libmsgq: msgq_send_raw, msgq_call_async)",
            _start_msgq_c,
        ),
        # limits.busy_poll off: the call columns only, beside the default (on).
        System(
            "msgq_trio-no-busy-poll",
            SUBJECT,
            "worker_msgq",
            "msgq_trio broker with --busy-poll 0; trio clients with busy_poll=0",
            functools.partial(_start_msgq, serve_args=("--busy-poll", "0"), client_busy_poll=0.0),
            only=_CALLS_ONLY,
            not_run="not run: busy polling matters for calls",
        ),
        System(
            "msgq_trio-direct-no-busy-poll",
            SUBJECT,
            "worker_msgq_direct",
            "msgq_trio broker with --busy-poll 0; direct blocking clients",
            functools.partial(_start_msgq, serve_args=("--busy-poll", "0")),
            only=_CALLS_ONLY,
            not_run="not run: busy polling matters for calls",
        ),
        # limits.splice_min_size off: the 4 MiB column only, beside the default (on).
        System(
            "msgq_trio-no-splice",
            SUBJECT,
            "worker_msgq",
            "msgq_trio broker with --splice-min-size 0 (large frames copied through)",
            functools.partial(_start_msgq, serve_args=("--splice-min-size", "0")),
            only=("large",),
            not_run="not run: splicing matters for large messages",
        ),
        # Over TCP the small-message columns only, where a remote client's cost shows
        # (one-way and round trip); 4 MiB messages over TLS measure the cipher, not msgq.
        System(
            "msgq_trio-tcp",
            SUBJECT,
            "worker_msgq",
            "msgq_trio broker, clients over TCP loopback (token, no TLS)",
            functools.partial(_start_msgq_tcp, tls=False),
            only=("one-way", "fan-out", "req-reply", "concurrent"),
            not_run="not run over TCP (time budget)",
        ),
        System(
            "msgq_trio-tls",
            SUBJECT,
            "worker_msgq",
            "msgq_trio broker, clients over TLS 1.3 on TCP loopback (token)",
            functools.partial(_start_msgq_tcp, tls=True),
            only=("one-way", "fan-out", "req-reply", "concurrent"),
            not_run="not run over TCP (time budget)",
        ),
        System(
            "raw-unix",
            CEILING,
            "worker_raw",
            "no broker: AF_UNIX process to process, 4-byte length-prefixed frames",
            _start_raw,
        ),
        System(
            "py-relay",
            CEILING,
            "worker_raw",
            "minimal Python relay process forwarding length-prefixed frames",
            _start_relay,
        ),
        System(
            "nats",
            PEER,
            "worker_nats",
            "nats-server (TCP loopback), nats-py asyncio",
            _start_nats,
            asyncio=True,
        ),
        System(
            "redis",
            PEER,
            "worker_redis",
            "redis-server pub/sub (Unix socket), redis-py sync + hiredis",
            _start_redis,
        ),
        System(
            "redis-asyncio",
            PEER,
            "worker_redis_aio",
            "redis-server pub/sub (Unix socket), redis.asyncio + hiredis",
            _start_redis,
            asyncio=True,
        ),
        System(
            "zeromq",
            PEER,
            "worker_zmq",
            "zmq.proxy process (XSUB/XPUB, ROUTER/DEALER) over ipc://, pyzmq",
            _start_zmq,
        ),
        System(
            "rabbitmq",
            PEER,
            "worker_rabbitmq",
            "rabbitmq-server (TCP loopback), aiormq (aio-pika's AMQP layer) asyncio",
            _start_rabbit,
            only=("req-reply", "concurrent", "large"),
            # The Python AMQP client frames every message in Python (pamqp): its CPU per
            # message, not the broker, would bound the streaming figures, and the full
            # one-way count would outlast the run's time budget.
            not_run="not run: the Python AMQP client's CPU per message bounds the figure",
            asyncio=True,
        ),
    )
}
DEFAULT_SYSTEMS = [
    "msgq_trio",
    "msgq_trio-def-handler",
    "msgq_trio-asyncio",
    "msgq_trio-asyncio-def-handler",
    "msgq_trio-direct",
    "msgq_trio-c",
    "msgq_trio-no-busy-poll",
    "msgq_trio-direct-no-busy-poll",
    "msgq_trio-no-splice",
    "raw-unix",
    "py-relay",
]
PEER_SYSTEMS = ["nats", "redis", "redis-asyncio", "zeromq"]
#: msgq_trio over TCP and TLS (``--peers`` runs them too: NATS is measured over TCP).
TCP_SYSTEMS = ["msgq_trio-tcp", "msgq_trio-tls"]
