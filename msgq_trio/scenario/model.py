"""Scenario files: load and validate a TOML scenario into frozen attrs classes.

A scenario (``scenarios/*.toml``) is data only. It names a summary, the broker's
configuration (``serve`` flags), the client processes and their behaviour, the faults and
when they strike, and the expected outcome as assertions. The format is documented in
docs/FAULTS.md; :func:`load_scenario` is its single source of truth: every key is checked
here, and an error names the file and the offending key (``clients[2].params.rate``).

Nothing in this module starts processes; see :mod:`msgq_trio.scenario.runner`.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..config import Limits
from .faultproxy import SettingError, parse_setting
from .faults import (
    BROKER_ACTIONS,
    CLIENT_ACTIONS,
    DISRUPTING_ACTIONS,
    NET_ACTIONS,
    PLUGIN_ACTIONS,
)

MiB = 1024 * 1024


class ScenarioError(ValueError):
    """A scenario file is missing, unreadable or invalid; the message names file and key."""


# -- role parameter schemas --------------------------------------------------------------------
#: Parameters every role built on the client library accepts.
LIBRARY_PARAMS: dict[str, object] = {
    # After ConnectionLost/ConnectError, connect again (for up to 10 s) and carry on.
    "reconnect": False,
    # The client's own bound on frames it receives (the library's default is 64 MiB).
    "max_frame_size": 64 * MiB,
}


@attrs.frozen
class RoleInfo:
    """What the runner needs to know about a client role.

    Attributes:
        active: the role has finite work and reports ``done``; the runner waits for every
            live active process before stopping the scenario.
        fault: the role injects a fault itself (its latency never counts as "healthy").
        library: built on :func:`msgq_trio.connect` (accepts :data:`LIBRARY_PARAMS`).
        params: parameter name -> default; the default's type is the parameter's type.
    """

    active: bool
    fault: bool
    library: bool
    params: dict[str, object]


ROLES: dict[str, RoleInfo] = {
    # Sends `count` messages (0: unlimited) of `size` payload bytes to `group` at `rate`
    # messages/s (0: as fast as backpressure allows) for at most `duration` seconds.
    "publisher": RoleInfo(
        True,
        False,
        True,
        {"group": "Feed", "rate": 0.0, "size": 100, "count": 0, "duration": 2.0},
    ),
    # Subscribes to `group`, counts messages, checks per-sender order, measures latency.
    "subscriber": RoleInfo(False, False, True, {"group": "Feed", "drain_idle": 0.3}),
    # Calls `command` on `target` from `concurrency` tasks; `size` bytes of params, asks for
    # `reply_size` bytes back; `timeout` 0 means the broker's deadline.
    "caller": RoleInfo(
        True,
        False,
        True,
        {
            "target": "Echo",
            "command": "echo",
            "rate": 0.0,
            "concurrency": 1,
            "size": 16,
            "reply_size": 0,
            "count": 0,
            "duration": 2.0,
            "timeout": 0.0,
        },
    ),
    # Joins `group` and answers `command` after `delay` s; answer=false black-holes requests.
    "responder": RoleInfo(
        False, False, True, {"group": "Echo", "command": "echo", "delay": 0.0, "answer": True}
    ),
    # `connections` library connections in one process, each in `group` answering `command`.
    "swarm": RoleInfo(False, False, True, {"connections": 100, "group": "All", "command": "echo"}),
    # Sends `count` messages with one `size`-byte attachment each to `target`.
    "big-sender": RoleInfo(
        True, False, True, {"target": "Big", "size": 64 * MiB, "count": 1, "interval": 0.0}
    ),
    # Subscribes to `groups` groups named `prefix`N (quota checks).
    "subscribe-flood": RoleInfo(True, True, True, {"groups": 100, "prefix": "G"}),
    # Raw socket: joins `groups`, sends `requests` requests to `request_target` (may contain
    # {i}) asking for `reply_size` bytes, reads until the stop-reading fault (SIGUSR1).
    "stalled-reader": RoleInfo(
        False,
        True,
        False,
        {
            "groups": ["Feed"],
            "requests": 0,
            "request_target": "Echo",
            "reply_size": 0,
            "reading": True,
        },
    ),
    # Raw socket, `count` connections: `pings` good requests, then the first `fraction` of a
    # `frame_size`-byte frame; waits `stall` s (0: until the broker drops it), disconnects.
    "half-frame": RoleInfo(
        True,
        True,
        False,
        {
            "count": 1,
            "frame_size": 1000,
            "fraction": 0.5,
            "pings": 1,
            "stall": 0.0,
            "wait_max": 30.0,
        },
    ),
    # Raw socket: malformed input of each kind in `kinds`, `repeat` times, one connection
    # each, `concurrency` at a time; every connection must be dropped (or still work).
    # Messages (bad-cbor-body, mutated) go to `target`.
    "garbage": RoleInfo(
        True,
        True,
        False,
        {
            "kinds": ["all"],
            "repeat": 1,
            "seed": 1,
            "concurrency": 8,
            "wait": 10.0,
            "max_frame_size": 64 * MiB,
            "target": "Void",
        },
    ),
    # `cycles` connect/disconnect cycles, `concurrency` at a time; mode clean (library,
    # GOODBYE), abrupt (HELLO then close), no-hello (connect, close), mixed (all three).
    "storm": RoleInfo(
        True,
        True,
        False,
        {"cycles": 1000, "concurrency": 8, "mode": "clean", "ping": False},
    ),
    # Raw socket: opens `connections` and holds them until `hold` s pass (0: until the
    # release fault, SIGUSR1), closes them, then checks a fresh connection is served.
    "hold": RoleInfo(
        True,
        True,
        False,
        {
            "connections": 100,
            "handshake_timeout": 2.0,
            "hold": 0.0,
            "verify": True,
            "verify_timeout": 10.0,
        },
    ),
}

# The user's own program (any language): ``command`` (argv; ``{python}`` is this Python,
# ``{socket}`` the broker's socket, ``{tmp}`` the run's directory, ``{name}`` the process's
# name), started with the broker's address in MSGQ_TRIO_SOCKET and a history file in
# MSGQ_TRIO_HISTORY. Ready when a stdout line contains ``ready = "line:TEXT"``, when it
# joined a group (``"member:GROUP"``: its pid among the members), or at once (""). An
# active one is done when it exits (with ``exit_status``); a ``service`` runs until the
# scenario stops it with SIGTERM. ``env``: extra ``NAME=value`` entries.
ROLES["exec"] = RoleInfo(
    True,
    False,
    False,
    {"command": [], "ready": "", "service": False, "exit_status": 0, "env": []},
)
#: The plugins a scenario's broker may run (``[broker] plugins``).
PLUGINS = ("queue", "pipe", "link")

GARBAGE_KINDS = (
    "random",
    "random-after-hello",
    "zero-length",
    "short-length",
    "huge-length",
    "max-plus-one",
    "huge-after-hello",
    "unknown-type",
    "reserved-nonzero",
    "bad-sections",
    "bad-utf8-target",
    "bad-cbor-header",
    "trailing-cbor",
    "no-hello",
    "double-hello",
    "after-goodbye",
    "request-no-id",
    "request-no-cmd",
    "notify-broker-group",
    "routed-from-client",
    "welcome-from-client",
    "bad-hello-name",
    "bad-cbor-body",
    "mutated",
)
STORM_MODES = ("clean", "abrupt", "no-hello", "mixed")
#: Garbage kinds the broker may answer only when one of its timeouts strikes, and which
#: (the ``serve`` flag): ``random`` may announce a frame that never comes before HELLO;
#: ``random-after-hello`` and ``mutated`` may leave a frame open after it.
GARBAGE_TIMED_KINDS = {
    "random": "handshake-timeout",
    "random-after-hello": "idle-in-frame-timeout",
    "mutated": "idle-in-frame-timeout",
}

#: ``serve`` flags a scenario may set (every Limits field), and their types.
BROKER_FLAGS: dict[str, type] = {
    f.name.replace("_", "-"): (int if f.type in (int, "int") else float)
    for f in attrs.fields(Limits)
}
_SIZE_FLAGS = {"max-frame-size", "out-soft-limit", "out-hard-limit"}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": 1024, "MiB": MiB, "GiB": 1024 * MiB}
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_OPS = ("==", "!=", "<=", ">=", "<", ">")
#: Metric namespaces that are not client names.
_NAMESPACES = ("broker", "latency", "fault", "scenario", "plugin", "history")
#: netem's words and values only: the setting goes on a command line (no shell)
_NETEM_RE = re.compile(r"^[a-z]+( [a-z0-9.%]+)*$")
#: ``[tcp]`` keys the runner fills in from ``listen`` (address, certificate, token)
_RUNNER_TCP_KEYS = {"listen", "certfile", "keyfile", "tokens", "insecure"}
#: The fault changing a broker's fault proxy (``[broker] proxy = true``).
PROXY_ACTION = "net-proxy"
#: Names given to the ``[soak]`` pool's faults while they are validated.
SOAK_POOL_PREFIX = "soak-pool-"


def parse_size(value: object, where: str) -> int:
    """An int, or a string like ``"64 MiB"``/``"512KiB"``, as a number of bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            return int(float(m.group(1)) * _UNITS[m.group(2)])
    raise ScenarioError(f"{where}: expected a size (int or e.g. '64 MiB'), got {value!r}")


# -- the model ---------------------------------------------------------------------------------
@attrs.frozen
class BrokerSpec:
    """How the broker is started: ``serve`` flags, RLIMIT_NOFILE, log level, plugins and
    their settings (``[plugins.NAME]`` of the broker's configuration file; the runner
    gives the queue plugin a store in the run's directory unless ``dir`` is set)."""

    flags: dict[str, int | float] = attrs.Factory(dict)
    nofile: int | None = None
    log_level: str = "INFO"
    plugins: dict[str, dict[str, Any]] = attrs.Factory(dict)
    #: bytes of a tmpfs mounted for the queue's store (root only), which the
    #: ``fill-disk`` / ``free-disk`` faults fill and free; None: the run's directory
    queue_disk: int | None = None
    #: "unix" (the socket only), "tcp" or "tls": the broker also listens on TCP (on
    #: 127.0.0.1, or on its namespace's address with ``netns``) and the clients are given
    #: that address, a token and, for TLS, the CA that signed its certificate
    listen: str = "unix"
    #: more ``[tcp]`` settings of the broker's configuration (heartbeat_interval, ...)
    tcp: dict[str, Any] = attrs.Factory(dict)
    #: run in a network namespace of its own, joined to the runner's by a veth pair, so
    #: the ``net-*`` faults can cut the network to it or add delay and loss (root only)
    netns: bool = False
    #: its clients and links reach its TCP/TLS listener through a fault proxy (any
    #: kernel, no root), which the ``net-proxy`` faults change (docs/FAULTS.md)
    proxy: bool = False

    def argv(self) -> list[str]:
        """The ``serve`` arguments for :attr:`flags` (``--out-soft-limit 1048576`` ...)."""
        out: list[str] = []
        for k, v in self.flags.items():
            out += ["--" + k, str(v)]
        return out


@attrs.frozen
class ClientSpec:
    """``procs`` identical client processes running ``role`` with resolved ``params``."""

    name: str
    role: str
    procs: int
    params: dict[str, Any]
    healthy: bool

    @property
    def info(self) -> RoleInfo:
        return ROLES[self.role]

    @property
    def active(self) -> bool:
        """Has finite work: the scenario waits for it (an exec ``service`` has none)."""
        return self.info.active and not (self.role == "exec" and self.params["service"])


@attrs.frozen
class FaultSpec:
    """``action`` at ``at`` seconds after the start of traffic, on ``target`` (a client
    name, or ``name#i`` for its i-th process; None for broker actions); with ``when``,
    not before that event either (:func:`parse_when`)."""

    name: str
    at: float
    action: str
    target: str | None
    index: int | None
    when: tuple[str, str, int] | None = None
    #: ``net-netem``: the netem settings (``"delay 200ms 50ms loss 5%"``)
    netem: str | None = None
    #: ``net-proxy``: the fault proxy's setting (``"delay 50ms 20ms loss 5%"``,
    #: ``"blackhole"``, ``"cut 100"``, ``"clear"``: msgq_trio/scenario/faultproxy.py)
    proxy: str | None = None


def parse_when(text: str, clients: set[str], where: str) -> tuple[str, str, int]:
    """A fault's trigger: ``member:GROUP`` or ``member:GROUP>=N`` (the group has N
    members, default 1), ``line:CLIENT:TEXT`` (a stdout line of a program of CLIENT
    contains TEXT), ``ops:N`` (the programs recorded N operations in their histories),
    ``done:CLIENT`` (every process of CLIENT reported its work done, or ended).
    Returns (kind, argument, count)."""
    kind, _, rest = text.partition(":")
    if kind == "member" and rest:
        group, _, n = rest.partition(">=")
        if group and (not n or n.strip().isdigit()):
            return ("member", group.strip(), int(n) if n else 1)
    elif kind == "line":
        client, sep, needle = rest.partition(":")
        if sep and needle and client in clients:
            return ("line", f"{client}:{needle}", 1)
        if client not in clients:
            raise ScenarioError(f"{where}: no client named {client!r}")
    elif kind == "ops" and rest.strip().isdigit():
        return ("ops", "", int(rest))
    elif kind == "done" and rest:
        if rest not in clients:
            raise ScenarioError(f"{where}: no client named {rest!r}")
        return ("done", rest, 1)
    raise ScenarioError(
        f"{where}: expected member:GROUP[>=N], line:CLIENT:TEXT, ops:N or done:CLIENT, got {text!r}"
    )


@attrs.frozen
class Check:
    """One count assertion: ``metric OP expression`` (e.g. ``sub.received == pub.sent * 2``).

    The expression is numbers and metric names joined by ``+ - * /`` with spaces around
    the operators; it is evaluated by the runner once every figure is known.
    """

    metric: str
    op: str
    expr: str

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.expr}"


@attrs.frozen
class Expectations:
    """The expected outcome. ``None`` bounds are not checked."""

    broker_alive: bool = True
    rss_max_mib: float | None = None
    fds_baseline: bool = True
    tasks_baseline: bool = True
    latency_p99_ms: float | None = None
    latency_max_ms: float | None = None
    log: tuple[str, ...] = ()
    log_absent: tuple[str, ...] = ()
    counts: tuple[Check, ...] = ()
    settle_timeout: float = 10.0
    history: HistoryExpect | None = None


@attrs.frozen
class HistoryExpect:
    """Invariants checked on the merged history the processes recorded
    (``[expect.history]``, :mod:`msgq_trio.scenario.history`)."""

    lost: bool = True
    duplicates: bool = True
    #: "all" (a queue: nobody gets a message twice), "process" (a group: each member
    #: once), "session" (once per consumer session: a redelivery after a crash is
    #: at-least-once, not a duplicate)
    duplicates_per: str = "all"
    order: bool = False
    answered_once: bool = True
    allowed_errors: tuple[str, ...] = ()
    #: seconds a process may go without recording an operation (None: not checked)
    silence: float | None = None
    #: client names whose every running process must receive every acked message (a
    #: broadcast to a group's members)
    reaches_each: tuple[str, ...] = ()


@attrs.frozen
class SoakSpec:
    """A long run (``[soak]``): traffic for ``duration`` seconds with a fault every
    ``fault_every`` seconds drawn (seeded) from ``pool``, the broker's RSS and fds sampled
    every ``sample_every`` seconds and compared at the end with the start
    (:mod:`msgq_trio.scenario.soak`)."""

    duration: float
    fault_every: float = 30.0
    #: the fault set a fault is drawn from (validated as ``[[faults]]``; ``at`` unused)
    pool: tuple[FaultSpec, ...] = ()
    #: the undoing fault of a stopping one (sigcont, cont-broker, a proxy ``clear``)
    #: comes this many seconds later
    undo_after: float = 5.0
    sample_every: float = 5.0
    #: seconds of traffic before the reference window (the broker warms up)
    warmup: float = 300.0
    #: length of the reference window (just after ``warmup``) and of the end window
    window: float = 300.0
    #: samples of a broker younger than this are not compared (a restarted broker has
    #: not reached its working size yet: like is compared with like)
    settled: float = 20.0
    #: the largest growth of the end window's median over the reference's, in percent
    max_growth_pct: float = 10.0


@attrs.frozen
class Scenario:
    """One validated scenario file."""

    name: str
    path: Path
    summary: str
    fault: str
    broker_does: str
    slow: bool
    timeout: float
    settle: float
    key_figures: tuple[str, ...]
    broker: BrokerSpec
    clients: tuple[ClientSpec, ...]
    faults: tuple[FaultSpec, ...]
    expect: Expectations
    #: more brokers (``[brokers.NAME]``), started before the scenario's own broker
    brokers: dict[str, BrokerSpec] = attrs.Factory(dict)
    #: a long run with random faults (``[soak]``), expanded by the runner
    soak: SoakSpec | None = None
    #: a long-haul run (an hour, a million frames, gigabytes): run by name, not in
    #: pytest's scenario matrix (its own test runs it small: ``--duration``, ``--param``)
    long_haul: bool = False

    @property
    def needs_root(self) -> str | None:
        """Why the scenario can only run as root (None: it runs as anyone)."""
        ns = [n for n, b in self.brokers.items() if b.netns]
        if ns:
            return f"broker {ns[0]!r} runs in a network namespace"
        if self.broker.queue_disk is not None:
            return "broker.queue_disk mounts a tmpfs"
        return None

    def client(self, name: str) -> ClientSpec:
        for c in self.clients:
            if c.name == name:
                return c
        raise KeyError(name)


# -- validation helpers ------------------------------------------------------------------------
class _Table:
    """A TOML table being validated: typed getters that name the key, and a check that no
    unknown key is left over (typos fail loudly instead of being ignored)."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, Mapping):
            raise ScenarioError(f"{where}: expected a table, got {type(data).__name__}")
        self.data: Mapping[str, Any] = data
        self.where = where
        self.used: set[str] = set()

    def key(self, k: str) -> str:
        return f"{self.where}.{k}" if self.where else k

    def get(
        self, k: str, types: type | tuple[type, ...], default: Any = ..., *, required: bool = False
    ) -> Any:
        self.used.add(k)
        if k not in self.data:
            if required or default is ...:
                raise ScenarioError(f"{self.key(k)}: required key is missing")
            return default
        v = self.data[k]
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in _tuple(types))
        if not ok:
            names = "/".join(t.__name__ for t in _tuple(types))
            raise ScenarioError(f"{self.key(k)}: expected {names}, got {v!r}")
        return v

    def number(self, k: str, default: Any = ..., *, minimum: float = 0.0) -> Any:
        """A float (ints accepted), or ``default`` when absent (``...``: required)."""
        v = self.get(k, (int, float), default)
        if v is None:
            return None
        if v < minimum:
            raise ScenarioError(f"{self.key(k)}: must be >= {minimum}, got {v!r}")
        return float(v)

    def finish(self) -> None:
        extra = sorted(set(self.data) - self.used)
        if extra:
            raise ScenarioError(f"{self.key(extra[0])}: unknown key")


def _tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


def _resolve_params(role: str, raw: object, where: str) -> dict[str, Any]:
    info = ROLES[role]
    schema = dict(info.params)
    if info.library:
        schema.update(LIBRARY_PARAMS)
    t = _Table(raw if raw is not None else {}, where)
    out: dict[str, Any] = {}
    for k, default in schema.items():
        if k not in t.data:
            out[k] = default
            t.used.add(k)
            continue
        kw = t.key(k)
        if k in ("size", "frame_size", "max_frame_size", "reply_size"):
            t.used.add(k)
            out[k] = parse_size(t.data[k], kw)
        elif isinstance(default, bool):
            out[k] = t.get(k, bool)
        elif isinstance(default, float):
            out[k] = float(t.get(k, (int, float)))
        elif isinstance(default, int):
            out[k] = t.get(k, int)
        elif isinstance(default, str):
            out[k] = t.get(k, str)
        else:  # lists of strings
            v = t.get(k, list)
            if not all(isinstance(x, str) for x in v):
                raise ScenarioError(f"{kw}: expected a list of strings, got {v!r}")
            out[k] = list(v)
        v = out[k]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            raise ScenarioError(f"{kw}: must be >= 0, got {v!r}")
    t.finish()
    if role == "garbage":
        bad = [k for k in out["kinds"] if k != "all" and k not in GARBAGE_KINDS]
        if bad:
            raise ScenarioError(
                f"{where}.kinds: unknown kind {bad[0]!r} (known: all, {', '.join(GARBAGE_KINDS)})"
            )
    if role == "exec":
        if not out["command"]:
            raise ScenarioError(f"{where}.command: required: the program's argv")
        ready = out["ready"]
        if (ready and not ready.startswith(("line:", "member:"))) or ready in ("line:", "member:"):
            raise ScenarioError(
                f'{where}.ready: expected "", "line:TEXT" or "member:GROUP", got {ready!r}'
            )
        for e in out["env"]:
            if "=" not in e or not e.split("=", 1)[0]:
                raise ScenarioError(f"{where}.env: expected NAME=value, got {e!r}")
        if out["service"] and out["exit_status"]:
            raise ScenarioError(
                f"{where}.exit_status: a service is stopped by the "
                "scenario; it has no expected exit status"
            )
    if role == "storm" and out["mode"] not in STORM_MODES:
        raise ScenarioError(f"{where}.mode: must be one of {', '.join(STORM_MODES)}")
    if role == "half-frame" and not 0 < out["fraction"] < 1:
        raise ScenarioError(f"{where}.fraction: must be between 0 and 1 (exclusive)")
    for k in ("concurrency", "connections", "cycles"):
        if k in out and out[k] < 1:
            raise ScenarioError(f"{where}.{k}: must be >= 1")
    return out


def _parse_check(metric: str, value: object, where: str) -> Check:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Check(metric, "==", repr(value))
    if not isinstance(value, str):
        raise ScenarioError(f"{where}: expected a number or 'OP EXPRESSION', got {value!r}")
    s = value.strip()
    for op in sorted(_OPS, key=len, reverse=True):
        if s.startswith(op):
            expr = s[len(op) :].strip()
            if not expr:
                break
            tokens = expr.split()
            # Terms and operators alternate; operators need spaces (names contain '-').
            for i, tok in enumerate(tokens):
                if i % 2 == 1:
                    if tok not in ("+", "-", "*", "/"):
                        raise ScenarioError(
                            f"{where}: expected an operator (+ - * /) at {tok!r} in {value!r}"
                        )
                elif not (_is_number(tok) or re.match(r"^[A-Za-z][\w.\-#]*$", tok)):
                    raise ScenarioError(f"{where}: {tok!r} is neither a number nor a metric")
            if len(tokens) % 2 == 0:
                raise ScenarioError(f"{where}: expression {expr!r} ends with an operator")
            return Check(metric, op, expr)
    raise ScenarioError(
        f"{where}: expected 'OP EXPRESSION' with OP one of {' '.join(_OPS)}, got {value!r}"
    )


def _is_number(tok: str) -> bool:
    try:
        float(tok)
    except ValueError:
        return False
    return True


# -- loading -----------------------------------------------------------------------------------
def load_scenario(path: str | Path) -> Scenario:
    """Read and validate one scenario file.

    Raises:
        ScenarioError: the file cannot be read or parsed, a key is missing, unknown or of
            the wrong type, or names an unknown client/role/action; the message says which.
    """
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as exc:
        raise ScenarioError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{p}: not valid TOML: {exc}") from exc
    try:
        return _build(p, data)
    except ScenarioError as exc:
        raise ScenarioError(f"{p}: {exc}") from None


def _broker_spec(raw: object, where: str, *, main: bool) -> BrokerSpec:
    """One broker's table (``[broker]`` or ``[brokers.NAME]``)."""
    bt = _Table(raw, where)
    flags_t = _Table(bt.get("flags", dict, {}), f"{where}.flags")
    flags: dict[str, int | float] = {}
    for k in flags_t.data:
        if k not in BROKER_FLAGS:
            raise ScenarioError(
                f"{where}.flags.{k}: unknown serve flag (known: {', '.join(sorted(BROKER_FLAGS))})"
            )
        if k in _SIZE_FLAGS:
            flags_t.used.add(k)
            flags[k] = parse_size(flags_t.data[k], f"{where}.flags.{k}")
        elif BROKER_FLAGS[k] is int:
            flags[k] = flags_t.get(k, int)
        else:
            flags[k] = float(flags_t.get(k, (int, float)))
        if flags[k] <= 0:
            raise ScenarioError(f"{where}.flags.{k}: must be positive")
    flags_t.finish()
    try:
        Limits(**{k.replace("-", "_"): v for k, v in flags.items()})  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{where}.flags: the broker would refuse them: {exc}") from None
    nofile = bt.get("nofile", int, None)
    if nofile is not None and nofile < 16:
        raise ScenarioError(f"{where}.nofile: must be >= 16 (the broker needs a few fds to run)")
    log_level = bt.get("log_level", str, "INFO")
    if log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ScenarioError(f"{where}.log_level: must be DEBUG, INFO, WARNING or ERROR")
    plugin_names = bt.get("plugins", list, [])
    settings_t = _Table(bt.get("plugin", dict, {}), f"{where}.plugin")
    plugins: dict[str, dict[str, Any]] = {}
    for name in plugin_names:
        if name not in PLUGINS:
            raise ScenarioError(
                f"{where}.plugins: unknown plugin {name!r} (known: {', '.join(PLUGINS)})"
            )
        # The plugin validates its own settings when the broker starts (a bad one stops
        # the start, named in the broker's log); here only their shape.
        plugins[name] = dict(settings_t.get(name, dict, {}))
    settings_t.finish()
    queue_disk = None
    if "queue_disk" in bt.data:
        bt.used.add("queue_disk")
        queue_disk = parse_size(bt.data["queue_disk"], f"{where}.queue_disk")
        if "queue" not in plugins:
            raise ScenarioError(f"{where}.queue_disk: needs the queue plugin (broker.plugins)")
        if "dir" in plugins["queue"]:
            raise ScenarioError(
                f"{where}.queue_disk: the runner mounts the store's disk; "
                f"{where}.plugin.queue.dir cannot be set with it"
            )
        if queue_disk < 4 * MiB:
            raise ScenarioError(f"{where}.queue_disk: at least 4 MiB (LMDB needs room to start)")
    if queue_disk is not None and not main:
        raise ScenarioError(f"{where}.queue_disk: only the scenario's own broker has one")
    listen = bt.get("listen", str, "unix")
    if listen not in ("unix", "tcp", "tls"):
        raise ScenarioError(f"{where}.listen: must be unix, tcp or tls, got {listen!r}")
    tcp = dict(bt.get("tcp", dict, {}))
    reserved = sorted(set(tcp) & _RUNNER_TCP_KEYS)
    if reserved:
        raise ScenarioError(f"{where}.tcp.{reserved[0]}: the runner sets it (see listen)")
    if tcp and listen == "unix":
        raise ScenarioError(f'{where}.tcp: needs listen = "tcp" or "tls"')
    netns = bt.get("netns", bool, False)
    if netns and main:
        raise ScenarioError(f"{where}.netns: only the brokers of [brokers.NAME] run in a namespace")
    if netns and listen != "tls":
        # The broker refuses plain TCP beyond loopback (tokens would cross in clear).
        raise ScenarioError(f'{where}.netns: needs listen = "tls"')
    proxy = bt.get("proxy", bool, False)
    if proxy and (listen == "unix" or netns):
        raise ScenarioError(f'{where}.proxy: needs listen = "tcp" or "tls" and no netns')
    bt.finish()
    return BrokerSpec(flags, nofile, log_level, plugins, queue_disk, listen, tcp, netns, proxy)


def _build(p: Path, data: dict[str, Any]) -> Scenario:
    top = _Table(data, "")
    summary = top.get("summary", str, required=True)
    fault = top.get("fault", str, required=True)
    broker_does = top.get("broker_does", str, required=True)
    slow = top.get("slow", bool, False)
    long_haul = top.get("long_haul", bool, False)
    timeout = top.number("timeout", 60.0, minimum=1.0)
    settle = top.number("settle", 0.5)
    key_figures = top.get("key_figures", list, [])
    if not all(isinstance(k, str) for k in key_figures):
        raise ScenarioError("key_figures: expected a list of metric names")

    broker = _broker_spec(top.get("broker", dict, {}), "broker", main=True)
    brokers: dict[str, BrokerSpec] = {}
    bs_t = _Table(top.get("brokers", dict, {}), "brokers")
    for bname in bs_t.data:
        if not _NAME_RE.match(bname):
            raise ScenarioError(f"brokers.{bname}: the name must match {_NAME_RE.pattern}")
        brokers[bname] = _broker_spec(bs_t.get(bname, dict), f"brokers.{bname}", main=False)
    bs_t.finish()

    raw_clients = top.get("clients", list, required=True)
    if not raw_clients:
        raise ScenarioError("clients: at least one client is required")
    pending: list[tuple[str, str, int, dict[str, Any], bool | None]] = []
    names: set[str] = set()
    for i, rc in enumerate(raw_clients):
        ct = _Table(rc, f"clients[{i}]")
        name = ct.get("name", str, required=True)
        if not _NAME_RE.match(name) or name in _NAMESPACES:
            raise ScenarioError(
                f"clients[{i}].name: {name!r} must match {_NAME_RE.pattern} and not be "
                f"{'/'.join(_NAMESPACES)}"
            )
        if name in names:
            raise ScenarioError(f"clients[{i}].name: duplicate client name {name!r}")
        names.add(name)
        role = ct.get("role", str, required=True)
        if role not in ROLES:
            raise ScenarioError(
                f"clients[{i}].role: unknown role {role!r} (known: {', '.join(ROLES)})"
            )
        procs = ct.get("procs", int, 1)
        if not 1 <= procs <= 64:
            raise ScenarioError(f"clients[{i}].procs: must be 1..64")
        params = _resolve_params(role, ct.get("params", dict, {}), f"clients[{i}].params")
        healthy = ct.get("healthy", bool, None)
        ct.finish()
        pending.append((name, role, procs, params, healthy))

    faults: list[FaultSpec] = []
    fault_names: set[str] = set()
    disrupted: set[str] = set()
    raw_faults = list(top.get("faults", list, []))
    soak_t = _Table(top.get("soak", dict, {}), "soak") if "soak" in data else None
    n_plain = len(raw_faults)
    if soak_t is not None:
        # The pool's entries are validated exactly as scheduled faults are.
        pool_raw = soak_t.get("faults", list, required=True)
        if not pool_raw:
            raise ScenarioError("soak.faults: at least one fault to draw from")
        for j, rf in enumerate(pool_raw):
            if not isinstance(rf, Mapping) or "at" in rf or "name" in rf:
                raise ScenarioError(f"soak.faults[{j}]: a table without at and name")
            raw_faults.append({**rf, "at": 0.0, "name": f"{SOAK_POOL_PREFIX}{j}"})
    for i, rf in enumerate(raw_faults):
        try:
            ft = _Table(rf, f"faults[{i}]" if i < n_plain else f"soak.faults[{i - n_plain}]")
            at = ft.number("at")
            action = ft.get("action", str, required=True)
            fname = ft.get("name", str, f"f{i}")
            if not _NAME_RE.match(fname) or fname in fault_names:
                raise ScenarioError(f"faults[{i}].name: {fname!r} is invalid or a duplicate")
            fault_names.add(fname)
            target = ft.get("target", str, None)
            when_text = ft.get("when", str, None)
            netem = ft.get("netem", str, None)
            if (netem is not None) != (action == "net-netem"):
                raise ScenarioError(
                    f"faults[{i}].netem: net-netem needs it, other actions take none"
                )
            if netem is not None and not _NETEM_RE.match(netem):
                raise ScenarioError(
                    f"faults[{i}].netem: {netem!r} is not a netem setting "
                    "(e.g. 'delay 200ms loss 5%')"
                )
            proxy_setting = ft.get("proxy", str, None)
            if (proxy_setting is not None) != (action == PROXY_ACTION):
                raise ScenarioError(
                    f"faults[{i}].proxy: {PROXY_ACTION} needs it, other actions take none"
                )
            if proxy_setting is not None:
                try:
                    parse_setting(proxy_setting)
                except SettingError as exc:
                    raise ScenarioError(f"faults[{i}].proxy: {exc}") from None
            ft.finish()
            when = parse_when(when_text, names, f"faults[{i}].when") if when_text else None
            index: int | None = None
            if action in CLIENT_ACTIONS:
                if target is None:
                    raise ScenarioError(f"faults[{i}].target: action {action!r} needs a client")
                base, sep, idx = target.partition("#")
                if base not in names:
                    raise ScenarioError(f"faults[{i}].target: no client named {base!r}")
                if sep:
                    if not idx.isdigit():
                        raise ScenarioError(f"faults[{i}].target: expected name#N, got {target!r}")
                    index = int(idx)
                    procs = next(c[2] for c in pending if c[0] == base)
                    if index >= procs:
                        raise ScenarioError(
                            f"faults[{i}].target: {base!r} has only {procs} process(es)"
                        )
                target = base
                if action in DISRUPTING_ACTIONS:
                    disrupted.add(base)
            elif action in PLUGIN_ACTIONS:
                if target not in broker.plugins:
                    raise ScenarioError(
                        f"faults[{i}].target: {action!r} needs a plugin the "
                        f"broker runs (broker.plugins: {sorted(broker.plugins)})"
                    )
                disk = broker.queue_disk is not None
                if action in ("fill-disk", "free-disk") and (target != "queue" or not disk):
                    raise ScenarioError(
                        f'faults[{i}]: {action!r} needs target = "queue" and broker.queue_disk'
                    )
            elif action in BROKER_ACTIONS:
                if target is not None and target not in brokers:
                    raise ScenarioError(
                        f"faults[{i}].target: no broker {target!r} in [brokers] (none: the "
                        "scenario's own broker)"
                    )
            elif action in NET_ACTIONS:
                if target not in brokers or not brokers[target].netns:
                    raise ScenarioError(
                        f"faults[{i}].target: {action!r} needs a broker of [brokers] "
                        "with netns = true"
                    )
            elif action == PROXY_ACTION:
                spec = broker if target is None else brokers.get(target)
                if spec is None or not spec.proxy:
                    raise ScenarioError(
                        f"faults[{i}].target: {action!r} needs a broker with proxy = true "
                        "(none: the scenario's own broker)"
                    )
            else:
                known = CLIENT_ACTIONS + BROKER_ACTIONS + PLUGIN_ACTIONS + NET_ACTIONS
                known += (PROXY_ACTION,)
                raise ScenarioError(
                    f"faults[{i}].action: unknown action {action!r} (known: {', '.join(known)})"
                )
            faults.append(FaultSpec(fname, at, action, target, index, when, netem, proxy_setting))
        except ScenarioError as exc:
            if i < n_plain:
                raise
            # A pool entry: name it as the file does.
            where = f"soak.faults[{i - n_plain}]"
            raise ScenarioError(str(exc).replace(f"faults[{i}]", where, 1)) from None
    pool = tuple(f for f in faults if f.name.startswith(SOAK_POOL_PREFIX))
    faults = [f for f in faults if not f.name.startswith(SOAK_POOL_PREFIX)]
    faults.sort(key=lambda f: f.at)
    soak = _soak_spec(soak_t, pool) if soak_t is not None else None

    clients = tuple(
        ClientSpec(
            name,
            role,
            procs,
            params,
            healthy if healthy is not None else (not ROLES[role].fault and name not in disrupted),
        )
        for name, role, procs, params, healthy in pending
    )
    _check_garbage_wait(clients, broker)

    et = _Table(top.get("expect", dict, {}), "expect")
    log = et.get("log", list, [])
    log_absent = et.get("log_absent", list, [])
    for key, pats in (("log", log), ("log_absent", log_absent)):
        for pat in pats:
            if not isinstance(pat, str):
                raise ScenarioError(f"expect.{key}: expected regular expressions (strings)")
            try:
                re.compile(pat)
            except re.error as exc:
                raise ScenarioError(
                    f"expect.{key}: bad regular expression {pat!r}: {exc}"
                ) from None
    ct2 = _Table(et.get("counts", dict, {}), "expect.counts")
    checks = []
    for metric, value in ct2.data.items():
        ct2.used.add(metric)
        base = metric.split(".", 1)[0]
        if base not in names and base not in _NAMESPACES:
            raise ScenarioError(
                f"expect.counts.{metric!r}: unknown metric namespace {base!r} "
                f"(a client name or one of {', '.join(_NAMESPACES)})"
            )
        # A list states several bounds on one metric (TOML forbids repeating the key).
        for v in value if isinstance(value, list) else [value]:
            checks.append(_parse_check(metric, v, f"expect.counts.{metric!r}"))
    expect = Expectations(
        broker_alive=et.get("broker_alive", bool, True),
        rss_max_mib=et.number("rss_max_mib", None),
        fds_baseline=et.get("fds_baseline", bool, True),
        tasks_baseline=et.get("tasks_baseline", bool, True),
        latency_p99_ms=et.number("latency_p99_ms", None),
        latency_max_ms=et.number("latency_max_ms", None),
        log=tuple(log),
        log_absent=tuple(log_absent),
        counts=tuple(checks),
        settle_timeout=et.number("settle_timeout", 10.0),
        history=_history_expect(et.get("history", dict, None), names),
    )
    et.finish()
    top.finish()
    return Scenario(
        name=p.stem,
        path=p,
        summary=summary,
        fault=fault,
        broker_does=broker_does,
        slow=slow,
        timeout=timeout,
        settle=settle,
        key_figures=tuple(key_figures),
        broker=broker,
        clients=clients,
        faults=tuple(faults),
        expect=expect,
        brokers=brokers,
        soak=soak,
        long_haul=long_haul,
    )


def _check_garbage_wait(clients: Sequence[ClientSpec], broker: BrokerSpec) -> None:
    """A garbage client judges a connection hung when neither an answer nor a close came
    within its ``wait``: that must outlast the broker timeout its kinds may legitimately
    need (:data:`GARBAGE_TIMED_KINDS`, from the broker's flags or their defaults), or a
    broker keeping its promise is reported hung. What ``wait`` exceeds it by is the
    allowance for a loaded machine.

    Raises:
        ScenarioError: a ``wait`` not above such a timeout.
    """
    defaults = {
        f.name.replace("_", "-"): float(f.default)
        for f in attrs.fields(Limits)
        if isinstance(f.default, (int, float))
    }
    for c in clients:
        if c.role != "garbage":
            continue
        kinds = GARBAGE_KINDS if "all" in c.params["kinds"] else c.params["kinds"]
        for kind in kinds:
            flag = GARBAGE_TIMED_KINDS.get(kind)
            if flag is None:
                continue
            limit = float(broker.flags.get(flag, defaults[flag]))
            if c.params["wait"] <= limit:
                raise ScenarioError(
                    f"clients {c.name!r}: wait ({c.params['wait']} s) must exceed the "
                    f"broker's {flag} ({limit} s): the broker may answer {kind!r} garbage "
                    "only when that timeout strikes"
                )


def with_params(sc: Scenario, pairs: Sequence[str]) -> Scenario:
    """``sc`` with client parameters replaced: each pair ``CLIENT.KEY=VALUE`` (VALUE a
    TOML value; a bare word is a string), validated as in the file (a long-haul
    scenario's size: ``--param garbage.repeat=10``).

    Raises:
        ScenarioError: a malformed pair, an unknown client or key, a bad value.
    """
    clients = {c.name: c for c in sc.clients}
    for pair in pairs:
        lhs, eq, text = pair.partition("=")
        name, dot, key = lhs.strip().partition(".")
        if not (eq and dot and key):
            raise ScenarioError(f"--param {pair!r}: expected CLIENT.KEY=VALUE")
        if name not in clients:
            raise ScenarioError(f"--param {pair!r}: no client named {name!r}")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        c = clients[name]
        if key not in c.params:
            raise ScenarioError(f"--param {pair!r}: {c.role} takes no parameter {key!r}")
        params = _resolve_params(c.role, {**c.params, key: value}, f"--param {lhs.strip()}")
        clients[name] = attrs.evolve(c, params=params)
    _check_garbage_wait(list(clients.values()), sc.broker)
    return attrs.evolve(sc, clients=tuple(clients[c.name] for c in sc.clients))


def with_latency_scale(sc: Scenario, scale: float) -> Scenario:
    """``sc`` with its latency bounds (``latency_p99_ms``, ``latency_max_ms``) multiplied
    by ``scale``: for a machine busy with other work, where a healthy client's latency
    grows with the load, not with the fault (the README's test command runs every
    scenario beside the rest of the suite). The other checks (nothing lost, the
    offender dropped, resources back to their baseline) keep their bounds.

    Raises:
        ScenarioError: ``scale`` below 1 (it would make the file's promise stricter).
    """
    if not scale >= 1.0:
        raise ScenarioError(f"latency scale {scale!r}: must be at least 1")
    e = sc.expect
    return attrs.evolve(
        sc,
        expect=attrs.evolve(
            e,
            latency_p99_ms=None if e.latency_p99_ms is None else e.latency_p99_ms * scale,
            latency_max_ms=None if e.latency_max_ms is None else e.latency_max_ms * scale,
        ),
    )


def _soak_spec(t: _Table, pool: tuple[FaultSpec, ...]) -> SoakSpec:
    duration = t.number("duration", minimum=1.0)
    out = SoakSpec(
        duration=duration,
        fault_every=t.number("fault_every", 30.0, minimum=0.5),
        pool=pool,
        undo_after=t.number("undo_after", 5.0, minimum=0.1),
        sample_every=t.number("sample_every", 5.0, minimum=0.1),
        warmup=t.number("warmup", 300.0),
        window=t.number("window", 300.0, minimum=0.1),
        settled=t.number("settled", 20.0),
        max_growth_pct=t.number("max_growth_pct", 10.0),
    )
    if out.undo_after >= out.fault_every:
        raise ScenarioError("soak.undo_after: must be shorter than soak.fault_every")
    t.finish()
    return out


def _history_expect(raw: object, clients: set[str]) -> HistoryExpect | None:
    if raw is None:
        return None
    t = _Table(raw, "expect.history")
    per = t.get("duplicates_per", str, "all")
    if per not in ("all", "process", "session"):
        raise ScenarioError("expect.history.duplicates_per: must be all, process or session")
    errors = t.get("allowed_errors", list, [])
    if not all(isinstance(e, str) for e in errors):
        raise ScenarioError("expect.history.allowed_errors: expected a list of error codes")
    out = HistoryExpect(
        lost=t.get("lost", bool, True),
        duplicates=t.get("duplicates", bool, True),
        duplicates_per=per,
        order=t.get("order", bool, False),
        answered_once=t.get("answered_once", bool, True),
        allowed_errors=tuple(errors),
        silence=t.number("silence", None),
        reaches_each=tuple(t.get("reaches_each", list, [])),
    )
    unknown = [c for c in out.reaches_each if c not in clients]
    if unknown:
        raise ScenarioError(f"expect.history.reaches_each: no client named {unknown[0]!r}")
    t.finish()
    return out


def is_slow(path: str | Path) -> bool:
    """Whether a scenario file says ``slow = true`` (cheap: for pytest collection; an
    unreadable file counts as fast so that the test itself reports the error)."""
    try:
        return bool(tomllib.loads(Path(path).read_text()).get("slow", False))
    except (OSError, tomllib.TOMLDecodeError):
        return False
