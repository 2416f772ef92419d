"""Control commands: the broker answers operators as a member of its own bus.

A control command is a REQUEST to ``msgq`` like the open commands (subscribe, members,
ping...), but only callers whose SO_PEERCRED uid is allowed may use it: by default the
uid the broker runs as, else exactly ``control.allow_uids``. A refusal is the error
``forbidden`` and a WARNING naming the caller.

| command | params | result |
|---|---|---|
| ``clients`` | (below) | one row per client (identity, traffic, queue, pending, since) |
| ``drop`` | ``{"lname", "reason"?}`` | the dropped client's row |
| ``shutdown`` | ``{"reason"?}`` | ``{"shutting_down": true}``; GOODBYE to all follows |
| ``config-get`` | ``{"key"?}`` | the running configuration, or one key's value |
| ``config-set`` | ``{"key", "value"}`` | ``{"changed": [...], "restart_required": [...]}`` |
| ``config-reload`` | - | same as SIGHUP: re-read the file, apply or refuse as a whole |
| ``stats`` | (below) | the server's figures plus traffic, disconnects, capture, config |
| ``command-stats`` | ``{"top"?: N}`` | per (group, command) counts and latency (core/cmdstats.py) |
| ``users`` | - | one row per connected user: use and limit of each quota, refusals |
| ``capture-start`` | capture settings to override | the capture's status |
| ``capture-stop`` / ``capture-status`` | - | the capture's status |
| ``dump-start`` | ``{"kinds", "senders", "targets", "body"}`` | records stream to the caller |
| ``dump-stop`` | - | ``true`` if a dump was running |
| ``audit`` | ``{"actor", "action", "detail"?}`` | ``true``; an INFO line: actor, caller, action |

``clients`` with ``since`` (the ``generation`` of the caller's previous such answer, 0
the first time) answers ``{"generation", "full", "now", "rows", "gone"}``: only the rows
that changed and the lnames gone since then (``Operations.clients_since``), so a caller
that polls a bus of idle clients gets an empty list; the broker keeps one signature per
client for that caller until it disconnects.

``fields`` (a list of keys) asks ``clients`` for only those keys of each row (an unknown
key is refused) and ``stats`` for only those keys of its answer; the keys of
``Operations.cheap_stats`` are then computed alone, without the full answer's walk of
every task and descriptor: what a caller polling every few seconds (the web console)
asks for.
"""

from __future__ import annotations

import gc
import logging
import operator
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..config import BrokerConfig, CaptureSettings, CommandAccess
from ..core.broker import CommandError
from ..core.peers import Peer
from ..io.housekeeping import rss_bytes
from ..plugins.loader import PluginConfigError, enforced_commands
from ..protocol.codes import ErrorCode
from . import config_file, logsetup
from .capture import TapHub, TrafficFilter
from .config_file import ConfigError, ConfigSource
from .logsetup import peer_fields
from .metrics import (
    USER_SERIES_TOP,
    TrafficTotals,
    command_families,
    process_figures,
    user_series,
)

if TYPE_CHECKING:
    from ..exposition import MetricsServer
    from ..io.server import Server

log = logging.getLogger("msgq_trio.ops")

#: Commands that change something: logged at INFO with the caller (an audit trail).
MUTATING = frozenset(
    {
        "drop",
        "shutdown",
        "config-set",
        "config-reload",
        "capture-start",
        "capture-stop",
        "dump-start",
    }
)
#: Commands everybody may use (the bus's own protocol); never guarded.
OPEN_COMMANDS = frozenset({"subscribe", "unsubscribe", "members", "version", "ping"})


def _params(params: object) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise CommandError(ErrorCode.BAD_REQUEST, "params must be a map")
    return params


def _str_list(params: dict[str, Any], key: str) -> list[str]:
    v = params.get(key) or []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise CommandError(ErrorCode.BAD_REQUEST, f"{key} must be a list of strings")
    return v


def _field_list(params: dict[str, Any], known: frozenset[str] | None) -> list[str] | None:
    """The ``fields`` param (None: every field); with ``known``, an unknown name is the
    caller's error, named."""
    if params.get("fields") is None:
        return None
    fields = _str_list(params, "fields")
    if known is not None:
        unknown = sorted(set(fields) - known)
        if unknown:
            raise CommandError(
                ErrorCode.BAD_REQUEST, f"unknown fields {unknown}; known: {sorted(known)}"
            )
    return fields


#: Callers whose last ``clients`` answer with ``since`` the broker remembers, the least
#: recently served forgotten first (that caller's next such answer is then ``full``,
#: as after a lost answer). Each remembers one signature per connected client, about
#: 200 bytes: 8 callers (a console or two and some tools polling) of 8,192 clients (the
#: default max_connections) keep at most about 13 MiB, where one per caller would grow
#: with the number of callers too.
CLIENTS_SINCE_CALLERS = 8

#: Row keys of the ``clients`` answer read straight off the peer: key -> attribute.
_CLIENT_ATTRS = {
    "lname": "lname",
    "name": "name",
    "pid": "pid",
    "uid": "uid",
    "gid": "gid",
    "msgs_in": "msgs_in",
    "msgs_out": "msgs_out",
    "bytes_in": "bytes_in",
    "bytes_out": "bytes_out",
    "queued_bytes": "outq_bytes",
    "where": "where",
}
#: Every row key of the ``clients`` answer (``Operations.client_row``).
CLIENT_FIELDS = frozenset(
    {*_CLIENT_ATTRS, "groups", "pending_out", "pending_in", "connected_at", "connected_for"}
)


def client_rows_of(
    peers: list[Peer], fields: list[str], now: float, wall: float
) -> list[dict[str, Any]]:
    """The ``clients`` rows of ``peers`` with only ``fields`` (each a key of
    :data:`CLIENT_FIELDS`), as ``Operations.client_row`` computes them; ``now`` is the trio
    clock, ``wall`` the time of day, read once for all rows."""
    direct = [f for f in fields if f in _CLIENT_ATTRS]
    get = [_CLIENT_ATTRS[f] for f in direct]
    computed = [f for f in fields if f not in _CLIENT_ATTRS]
    rows = []
    for p in peers:
        row = {k: getattr(p, a) for k, a in zip(direct, get, strict=True)}
        for f in computed:
            if f == "groups":
                row[f] = list(p.groups)
            elif f == "pending_out":
                row[f] = len(p.pending_out)
            elif f == "pending_in":
                row[f] = len(p.pending_in)
            elif f == "connected_at":
                row[f] = round(wall - (now - p.connected_at), 3)
            else:  # connected_for
                row[f] = round(now - p.connected_at, 3)
        rows.append(row)
    return rows


class Operations:
    """Configuration at runtime, control commands, capture and metrics of one broker.

    Args:
        server: the broker (its core gets the commands and hooks).
        config: the configuration the server was started with.
        source: where :meth:`reload` reads the configuration again.
        declared_access: plugin name -> the access verbs it declared for its commands
            (``plugins.loader.access_declarations``): a reload that changes
            ``[access] queue_group`` moves the queue plugin's checks with it.
        metrics_listeners / metrics_address: the bound metrics endpoint, if any.
    """

    def __init__(
        self,
        server: Server,
        config: BrokerConfig,
        source: ConfigSource,
        *,
        declared_access: Mapping[str, CommandAccess],
        metrics_listeners: list[trio.SocketListener] | None = None,
        metrics_address: str | None = None,
    ) -> None:
        self.server = server
        self.core = server.core
        self.config = config
        self.source = source
        self.declared_access = dict(declared_access)
        self.hub = TapHub(server.core, server.after_core, lambda: server.limits.out_soft_limit)
        self.totals = TrafficTotals()
        self.own_uid = os.geteuid()
        self.refusals = 0
        self.generation = 1
        self.loaded_at = time.time()
        self.reloads_ok = 0
        self.reloads_failed = 0
        self.metrics_address = metrics_address
        self.metrics: MetricsServer | None = None
        if metrics_listeners:
            # Imported only here and in render_metrics: prometheus_client is loaded by a
            # broker that serves or renders metrics, not by every broker's start.
            from ..exposition import MetricsServer

            self.metrics = MetricsServer(metrics_listeners, self.render_metrics)
        self._nursery: trio.Nursery | None = None
        self._server_stats: Callable[[Peer, Any], object] | None = None
        #: Caller -> the generation and the rows' signatures of its last ``clients``
        #: answer with ``since``; the most recently served last, at most
        #: CLIENTS_SINCE_CALLERS of them, each dropped when its caller disconnects.
        self._clients_seen: dict[Peer, tuple[int, dict[int, object]]] = {}
        self._clients_generation = 0

    # -- wiring -------------------------------------------------------------------------
    def install(self) -> None:
        """Register the control commands and the disconnect hook on the core."""
        core = self.core
        core.on_disconnect = self._peer_gone
        self._server_stats = core.commands.get("stats")
        commands: dict[str, Callable[[Peer, Any], object]] = {
            "clients": self._cmd_clients,
            "drop": self._cmd_drop,
            "shutdown": self._cmd_shutdown,
            "config-get": self._cmd_config_get,
            "config-set": self._cmd_config_set,
            "config-reload": self._cmd_config_reload,
            "stats": self._cmd_stats,
            "command-stats": self._cmd_command_stats,
            "capture-start": self._cmd_capture_start,
            "capture-stop": self._cmd_capture_stop,
            "capture-status": self._cmd_capture_status,
            "dump-start": self._cmd_dump_start,
            "dump-stop": self._cmd_dump_stop,
            "users": self._cmd_users,
            "audit": self._cmd_audit,
        }
        for name, fn in commands.items():
            assert name not in OPEN_COMMANDS
            core.commands[name] = self._guard(name, fn)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Capture tasks and the metrics endpoint. Starts the configured capture first, so
        an unusable capture directory fails the broker's start (raises OSError)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.hub.run)
            self.hub.set_traffic_logging(self.config.log.level == "TRAFFIC")
            if self.config.capture.enabled:
                self.hub.start_capture(self.config.capture)
            if self.metrics is not None:
                nursery.start_soon(self.metrics.serve)
                log.info("metrics at http://%s/metrics", self.metrics_address)
            task_status.started()

    def _peer_gone(self, peer: Peer, reason: str) -> None:
        self.totals.peer_gone(peer, reason)
        self.hub.peer_gone(peer)
        self._clients_seen.pop(peer, None)

    def allowed_uids(self) -> frozenset[int]:
        allow = self.config.control.allow_uids
        return frozenset(allow) if allow else frozenset({self.own_uid})

    def _guard(self, name: str, fn: Callable[[Peer, Any], object]) -> Callable[[Peer, Any], object]:
        def guarded(peer: Peer, params: Any) -> object:
            allowed = self.allowed_uids()
            # A Unix caller by uid (control.allow_uids); anyone (TCP clients included) by
            # an access rule with control = true.
            if (peer.remote or peer.uid not in allowed) and not (
                peer.acl is not None and peer.acl.control
            ):
                self.refusals += 1
                log.warning(
                    "refused control command %r from %s: uid %d is not allowed "
                    "(control.allow_uids: %s)",
                    name,
                    peer.describe(),
                    peer.uid,
                    sorted(allowed),
                    extra=peer_fields(peer),
                )
                who = peer.acl.identity if peer.remote and peer.acl else f"uid {peer.uid}"
                raise CommandError(
                    ErrorCode.FORBIDDEN,
                    f"control command {name!r} is restricted to uids {sorted(allowed)} "
                    f"and identities an access rule grants control; you are {who}",
                )
            log.log(
                logging.INFO if name in MUTATING else logging.DEBUG,
                "control command %r from %s",
                name,
                peer.describe(),
                extra=peer_fields(peer),
            )
            try:
                return fn(peer, params)
            except CommandError:
                raise
            except Exception as exc:
                # A bug in a control command: the caller gets internal-error, its
                # connection and the broker go on.
                log.exception(
                    "control command %r from %s failed",
                    name,
                    peer.describe(),
                    extra=peer_fields(peer),
                )
                raise CommandError(
                    ErrorCode.INTERNAL_ERROR, f"{name} failed: {type(exc).__name__}: {exc}"
                ) from exc

        return guarded

    # -- configuration --------------------------------------------------------------------
    def reload(self, origin: str) -> dict[str, Any]:
        """Re-read the configuration (file + flags) and apply it as a whole.

        Raises:
            ConfigError: invalid; logged, and the running configuration stays in force.
        """
        try:
            new = self.source.load()
        except ConfigError as exc:
            self.reloads_failed += 1
            log.error("%s: configuration refused, the running one stays in force: %s", origin, exc)
            raise
        return self.apply(new, origin)

    def apply(self, new: BrokerConfig, origin: str) -> dict[str, Any]:
        """Make ``new`` the running configuration; returns what changed and when it
        applies. What can fail (opening the log file, the capture directory) runs first;
        if it fails, nothing has changed (ConfigError)."""
        old = self.config
        changes = config_file.diff(old, new)
        commands = None
        if new.access != old.access:
            try:
                commands = enforced_commands(new.access, self.declared_access)
            except PluginConfigError as exc:
                self.reloads_failed += 1
                log.error(
                    "%s: configuration refused, the running one stays in force: %s", origin, exc
                )
                raise ConfigError(str(exc), "access.queue_group", new.access.queue_group) from None
        prepared = None
        if new.log != old.log:
            try:
                prepared = logsetup.prepare(new.log)
            except logsetup.LogFileError as exc:
                self.reloads_failed += 1
                log.error(
                    "%s: configuration refused, the running one stays in force: %s", origin, exc
                )
                raise ConfigError(str(exc), "log.file", new.log.file) from None
        if new.capture != old.capture:
            try:
                if new.capture.enabled:
                    self.hub.start_capture(new.capture)
                else:
                    self.hub.stop_capture()
            except (OSError, ValueError, RuntimeError) as exc:
                if prepared is not None:
                    prepared.discard()
                self.reloads_failed += 1
                log.error(
                    "%s: configuration refused, the running one stays in force: "
                    "capture.dir = %s: %s",
                    origin,
                    config_file.show(new.capture.dir),
                    exc,
                )
                raise ConfigError(
                    f"capture.dir = {config_file.show(new.capture.dir)}: {exc}",
                    "capture.dir",
                    new.capture.dir,
                ) from None
        if new.limits != old.limits:
            self.server.apply_limits(new.limits)
        if new.tcp != old.tcp:
            self.server.apply_tcp(new.tcp)
        if new.access != old.access:
            self.server.apply_access(new.access, commands)
        if new.quotas != old.quotas:
            self.server.apply_quotas(new.quotas)
        if prepared is not None:
            logsetup.install(prepared)
            self.hub.set_traffic_logging(new.log.level == "TRAFFIC")
        # socket and metrics.listen were read at start; they keep their running values.
        # plugins too: the supervisor started them from the configuration at start.
        self.config = attrs.evolve(
            new,
            socket=old.socket,
            metrics=old.metrics,
            plugins=old.plugins,
            tcp=attrs.evolve(
                new.tcp,
                listen=old.tcp.listen,  # type: ignore[arg-type]
                certfile=old.tcp.certfile,
                keyfile=old.tcp.keyfile,
                client_ca=old.tcp.client_ca,
                require_client_cert=old.tcp.require_client_cert,
                insecure=old.tcp.insecure,
            ),
        )
        self.generation += 1
        self.loaded_at = time.time()
        self.reloads_ok += 1
        out = []
        restart = []
        for key, a, b in changes:
            when = config_file.applies(key)
            out.append({"key": key, "old": a, "new": b, "applies": when})
            if when == "restart":
                restart.append(key)
                log.warning(
                    "%s: %s changed from %s to %s: it is read at start only, the running "
                    "broker keeps %s until it is restarted",
                    origin,
                    key,
                    config_file.show(a),
                    config_file.show(b),
                    config_file.show(a),
                )
            else:
                log.info(
                    "%s: %s = %s (was %s)%s",
                    origin,
                    key,
                    config_file.show(b),
                    config_file.show(a),
                    "; applies to new connections" if when == "new connections" else "",
                )
        if not changes:
            log.info("%s: configuration unchanged", origin)
        return {"generation": self.generation, "changed": out, "restart_required": restart}

    def _cmd_config_get(self, _peer: Peer, params: object) -> object:
        p = _params(params)
        key = p.get("key")
        if key is None:
            return config_file.to_dict(self.config)
        if not isinstance(key, str):
            raise CommandError(ErrorCode.BAD_REQUEST, "key must be a string")
        try:
            return config_file.get_key(self.config, key)
        except ConfigError as exc:
            raise CommandError(ErrorCode.BAD_REQUEST, str(exc)) from None

    def _cmd_config_set(self, peer: Peer, params: object) -> object:
        p = _params(params)
        key = p.get("key")
        if not isinstance(key, str) or "value" not in p:
            raise CommandError(ErrorCode.BAD_REQUEST, "params must be {'key': str, 'value': ...}")
        try:
            new = config_file.with_key(self.config, key, p["value"])
            return self.apply(new, f"config-set by {peer.lname}")
        except ConfigError as exc:
            log.warning(
                "config-set by %s refused: %s", peer.describe(), exc, extra=peer_fields(peer)
            )
            raise CommandError(ErrorCode.BAD_REQUEST, str(exc)) from None

    def _cmd_config_reload(self, peer: Peer, _params: object) -> object:
        try:
            return self.reload(f"config-reload by {peer.lname}")
        except ConfigError as exc:
            raise CommandError(ErrorCode.BAD_REQUEST, str(exc)) from None

    # -- clients ------------------------------------------------------------------------
    def client_row(self, p: Peer) -> dict[str, Any]:
        now = trio.current_time()
        return {
            "lname": p.lname,
            "name": p.name,
            "pid": p.pid,
            "uid": p.uid,
            "gid": p.gid,
            "groups": list(p.groups),
            "msgs_in": p.msgs_in,
            "msgs_out": p.msgs_out,
            "bytes_in": p.bytes_in,
            "bytes_out": p.bytes_out,
            "queued_bytes": p.outq_bytes,
            "pending_out": len(p.pending_out),
            "pending_in": len(p.pending_in),
            "connected_at": round(time.time() - (now - p.connected_at), 3),
            "connected_for": round(now - p.connected_at, 3),
            # A TCP client's identity and address (``tcp:NAME@host:port``); "" for Unix.
            "where": p.where,
        }

    def _cmd_clients(self, peer: Peer, params: object) -> object:
        p = _params(params)
        fields = _field_list(p, CLIENT_FIELDS)
        since = p.get("since")
        if since is not None:
            if isinstance(since, bool) or not isinstance(since, int) or since < 0:
                raise CommandError(
                    ErrorCode.BAD_REQUEST, f"since must be a generation (int >= 0), got {since!r}"
                )
            return self.clients_since(peer, fields or sorted(CLIENT_FIELDS), since)
        peers = [p for _, p in sorted(self.core.peers.items())]
        if fields is None:
            return [self.client_row(p) for p in peers]
        return client_rows_of(peers, fields, trio.current_time(), time.time())

    def clients_since(self, caller: Peer, fields: list[str], since: int) -> dict[str, Any]:
        """The ``clients`` answer with ``since``: only the rows that changed since the
        caller's answer of generation ``since`` (new clients included) and the lnames of
        the clients gone since; ``full`` (every row, nothing gone) when ``since`` is not
        the caller's last generation (0, a lost answer, another broker). A row changes
        when one of its ``fields`` does, ``connected_for`` excepted (it always does: the
        caller has ``now``, the broker's time of day, and ``connected_at``). Keeps one
        signature per client for the caller until its next such call, its end, or
        ``CLIENTS_SINCE_CALLERS`` other callers were served since."""
        last = self._clients_seen.pop(caller, None)
        full = last is None or last[0] != since
        seen: dict[int, object] = {} if full or last is None else last[1]
        direct = tuple(_CLIENT_ATTRS[f] for f in fields if f in _CLIENT_ATTRS)
        get = operator.attrgetter(*direct) if direct else (lambda _p: None)
        with_groups = "groups" in fields
        with_pending = "pending_in" in fields or "pending_out" in fields
        now_seen: dict[int, object] = {}
        changed = []
        for pid_, p in sorted(self.core.peers.items()):
            sig = (
                get(p),
                tuple(p.groups) if with_groups else None,
                (len(p.pending_in), len(p.pending_out)) if with_pending else None,
            )
            now_seen[pid_] = sig
            if seen.get(pid_) != sig:
                changed.append(p)
        gone = [] if full else [f"l.{i}" for i in seen.keys() - now_seen.keys()]
        self._clients_generation += 1
        remembered = self._clients_seen
        remembered[caller] = (self._clients_generation, now_seen)
        while len(remembered) > CLIENTS_SINCE_CALLERS:
            del remembered[next(iter(remembered))]
        wall = time.time()
        return {
            "generation": self._clients_generation,
            "full": full,
            "now": round(wall, 3),
            "rows": client_rows_of(changed, fields, trio.current_time(), wall),
            "gone": sorted(gone),
        }

    def _cmd_drop(self, peer: Peer, params: object) -> object:
        p = _params(params)
        lname = p.get("lname")
        reason = p.get("reason") or "dropped by an operator"
        if not isinstance(lname, str) or not isinstance(reason, str):
            raise CommandError(
                ErrorCode.BAD_REQUEST, "params must be {'lname': str, 'reason'?: str}"
            )
        victim = None
        if lname.startswith("l.") and lname[2:].isdigit():
            victim = self.core.peers.get(int(lname[2:]))
        if victim is None:
            raise CommandError(ErrorCode.NO_RECIPIENT, f"no client {lname!r}")
        if victim is peer:
            raise CommandError(ErrorCode.BAD_REQUEST, "a client cannot drop itself; disconnect")
        row = self.client_row(victim)
        log.warning(
            "dropping client %s on request of %s: %s",
            victim.describe(),
            peer.describe(),
            reason,
            extra=peer_fields(victim) | {"reason": reason},
        )
        self.core.kick(victim, ErrorCode.DROPPED, f"{reason} (by {peer.lname} uid {peer.uid})")
        return row

    def _cmd_shutdown(self, peer: Peer, params: object) -> object:
        reason = _params(params).get("reason") or "control command"
        if self._nursery is None:
            raise CommandError(ErrorCode.INTERNAL_ERROR, "operations are not running")
        log.warning(
            "shutdown requested by %s: %s", peer.describe(), reason, extra=peer_fields(peer)
        )
        # After this answer is queued: the GOODBYEs follow it on the caller's connection.
        self._nursery.start_soon(self.server.shutdown)
        return {"shutting_down": True}

    def _cmd_users(self, _peer: Peer, _params: object) -> object:
        return self.core.users.rows()

    # -- statistics and metrics -------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        core = self.core
        return {
            "traffic": self.totals.totals(core.peers.values()),
            "connections_total": len(core.peers) + sum(self.totals.disconnects.values()),
            "disconnects": dict(self.totals.disconnects),
            "capture": self.hub.stats(),
            "control": {"refusals": self.refusals, "allow_uids": sorted(self.allowed_uids())},
            "config": self.config_figures(),
            "metrics": {
                "address": self.metrics_address,
                "scrapes": self.metrics.scrapes if self.metrics else 0,
            },
            # The cyclic collector as gc_threshold set it (msgq_trio.runtime), and how
            # often each generation was collected since start.
            "collector": {
                "threshold": list(gc.get_threshold()),
                "collections": [g["collections"] for g in gc.get_stats()],
            },
            # The per-command table's size; its rows: the command-stats command.
            "command_stats": {
                "pairs": len(core.rpc.stats.pairs),
                "max_pairs": core.rpc.stats.max_pairs,
                "overflow": core.rpc.stats.overflow,
            },
        }

    def config_figures(self) -> dict[str, Any]:
        """The ``stats`` answer's ``config``: where it was read, its generation, reloads."""
        return {
            "file": str(self.source.path) if self.source.path else None,
            "generation": self.generation,
            "loaded_at": self.loaded_at,
            "reloads_ok": self.reloads_ok,
            "reloads_failed": self.reloads_failed,
        }

    def cheap_stats(self) -> dict[str, Callable[[], object]]:
        """The ``stats`` keys computed alone, each in O(clients) at most without a system
        call per client: what a caller polling ``stats`` with ``fields`` (the web console,
        every 2 s) asks for. The full answer walks every task and lists every descriptor."""
        server, core = self.server, self.core
        return {
            "connections": lambda: len(server.conns),
            "pending_requests": lambda: len(core.rpc),
            "groups": lambda: len(core.router.groups),
            "queued_bytes": lambda: sum(p.outq_bytes for p in core.peers.values()),
            "rss_bytes": rss_bytes,
            "uptime": lambda: trio.current_time() - server.started_at,
            "traffic": lambda: self.totals.totals(core.peers.values()),
            "capture": self.hub.stats,
            "config": self.config_figures,
        }

    def _cmd_stats(self, peer: Peer, params: object) -> object:
        fields = _field_list(_params(params), None)
        if fields is not None:
            cheap = self.cheap_stats()
            if all(f in cheap for f in fields):
                return {f: cheap[f]() for f in fields}
            full = self._cmd_stats(peer, None)
            assert isinstance(full, dict)
            return {f: full[f] for f in fields if f in full}
        base = self._server_stats(peer, params) if self._server_stats is not None else {}
        out = dict(base) if isinstance(base, dict) else {"server": base}
        out.update(self.stats())
        return out

    def _cmd_command_stats(self, _peer: Peer, params: object) -> object:
        top = _params(params).get("top")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
            raise CommandError(
                ErrorCode.BAD_REQUEST, f"top must be a positive integer, got {top!r}"
            )
        return self.core.rpc.stats.snapshot(top)

    def render_metrics(self) -> str:
        from ..exposition import Exposition  # see __init__: loaded when asked for

        core, server = self.core, self.server
        st = self.stats()
        t = st["traffic"]
        e = Exposition()
        e.family("msgq_up", "gauge", "1 while the broker serves.", 1)
        e.family("msgq_connections", "gauge", "Clients connected now.", len(core.peers))
        e.family(
            "msgq_connections_accepted",
            "counter",
            "Clients admitted (HELLO accepted) since start.",
            st["connections_total"],
        )
        e.family(
            "msgq_messages_received",
            "counter",
            "Frames received from clients (all kinds).",
            t["messages_in"],
        )
        e.family(
            "msgq_messages_sent",
            "counter",
            "Frames queued to clients (all kinds).",
            t["messages_out"],
        )
        e.family("msgq_bytes_received", "counter", "Bytes received from clients.", t["bytes_in"])
        e.family("msgq_bytes_sent", "counter", "Bytes written to clients.", t["bytes_out"])
        e.family(
            "msgq_disconnects",
            "counter",
            "Clients gone, by reason (closed, connection-lost, protocol-error, "
            "slow-consumer, forbidden = dropped by an operator, ...).",
            [({"reason": r}, n) for r, n in sorted(self.totals.disconnects.items())],
        )
        e.family(
            "msgq_dropped_clients",
            "counter",
            "Clients the broker dropped (slow consumer, hard limit, operator).",
            core.stats.get("dropped_peers", 0),
        )
        e.family(
            "msgq_messages_dropped",
            "counter",
            "Messages not delivered, by reason (no-recipient: nobody there; late-answer: "
            "an answer nobody waits for; sender-gone: sent by a client that hung up while "
            "its reads were paused by backpressure, not delivered yet).",
            [
                ({"reason": "no-recipient"}, core.stats.get("no_recipient", 0)),
                ({"reason": "late-answer"}, core.stats.get("late_answers", 0)),
                ({"reason": "sender-gone"}, core.stats.get("discarded_frames", 0)),
            ],
        )
        e.family(
            "msgq_request_timeouts",
            "counter",
            "Requests answered 'timeout' by the broker's deadline.",
            core.stats.get("timeouts", 0),
        )
        e.family("msgq_pending_requests", "gauge", "Requests waiting for an answer.", len(core.rpc))
        command_families(e, core.rpc.stats)
        e.family(
            "msgq_queued_bytes",
            "gauge",
            "Bytes queued in the broker for clients.",
            sum(p.outq_bytes for p in core.peers.values()),
        )
        e.family(
            "msgq_paused_readers",
            "gauge",
            "Clients whose reads are paused by backpressure (a receiver they feed is "
            "over out_soft_limit or has no room for their next frame).",
            server.paused_readers,
        )
        e.family(
            "msgq_groups", "gauge", "Groups with at least one member.", len(core.router.groups)
        )
        e.family(
            "msgq_busy_poll_passes",
            "counter",
            "Event-loop passes spent polling without sleeping (limits.busy_poll).",
            server.busy_polls,
        )
        e.family(
            "msgq_spliced_frames",
            "counter",
            "Large frames moved through the broker with splice (limits.splice_min_size).",
            server.spliced_frames,
        )
        e.family(
            "msgq_splice_fallbacks",
            "counter",
            "Large frames that took the copying path for want of a pipe "
            "(limits.splice_max_pipes, the pipe quota or the descriptor limit).",
            server.splice_fallbacks,
        )
        e.family(
            "msgq_splice_pipes",
            "gauge",
            "Pipes the broker holds for spliced frames in flight.",
            server.pipe_budget.held,
        )
        e.family(
            "msgq_capture_active",
            "gauge",
            "1 while a capture writes to files.",
            1 if self.hub.file is not None else 0,
        )
        e.family(
            "msgq_capture_records_written",
            "counter",
            "Capture records written to files or dump clients.",
            self.hub.written_total,
        )
        e.family(
            "msgq_capture_records_dropped",
            "counter",
            "Capture records lost to a full capture buffer.",
            self.hub.dropped_total,
        )
        e.family(
            "msgq_dump_clients", "gauge", "Clients receiving a live dump.", len(self.hub.dumps)
        )
        e.family(
            "msgq_control_refusals",
            "counter",
            "Control commands refused (caller's uid not allowed).",
            self.refusals,
        )
        e.family(
            "msgq_config_reloads",
            "counter",
            "Configuration reloads, by result.",
            [({"result": "ok"}, self.reloads_ok), ({"result": "failed"}, self.reloads_failed)],
        )
        e.family(
            "msgq_uptime_seconds",
            "gauge",
            "Seconds since the broker started.",
            trio.current_time() - server.started_at,
        )
        user_series(e, self.core.users.rows(), USER_SERIES_TOP)
        proc = process_figures()
        e.family("process_open_fds", "gauge", "Open file descriptors.", proc["fds"])
        e.family("process_resident_memory_bytes", "gauge", "Resident memory.", proc["rss"])
        e.family("msgq_build_info", "gauge", "Broker version.", [({"version": core.version}, 1)])
        return e.text()

    # -- capture ------------------------------------------------------------------------
    def _cmd_capture_start(self, _peer: Peer, params: object) -> object:
        p = dict(_params(params))
        data = config_file.to_dict(self.config)["capture"]
        data.update(p)
        data["enabled"] = True
        try:
            settings: CaptureSettings = config_file.build_section("capture", CaptureSettings, data)
        except ConfigError as exc:
            raise CommandError(ErrorCode.BAD_REQUEST, str(exc)) from None
        try:
            status = self.hub.start_capture(settings)
        except (OSError, ValueError, RuntimeError) as exc:
            raise CommandError(
                ErrorCode.BAD_REQUEST, f"cannot capture to {settings.dir}: {exc}"
            ) from None
        return status

    def _cmd_capture_stop(self, _peer: Peer, _params: object) -> object:
        return self.hub.stop_capture() or self.hub.capture_status()

    def _cmd_capture_status(self, _peer: Peer, _params: object) -> object:
        return self.hub.capture_status()

    def _cmd_dump_start(self, peer: Peer, params: object) -> object:
        p = _params(params)
        body = p.get("body") or "none"
        try:
            flt = TrafficFilter(
                _str_list(p, "kinds"), _str_list(p, "senders"), _str_list(p, "targets")
            )
            self.hub.add_dump(peer, flt, str(body))
        except (ValueError, RuntimeError) as exc:
            raise CommandError(ErrorCode.BAD_REQUEST, str(exc)) from None
        return {"lname": peer.lname, "filter": flt.describe(), "body": body}

    def _cmd_dump_stop(self, peer: Peer, _params: object) -> object:
        return self.hub.remove_dump(peer)

    # -- audit ----------------------------------------------------------------------------
    def _cmd_audit(self, peer: Peer, params: object) -> object:
        """A line in the broker's log for an action a client took on behalf of someone
        else (the web console's operators): who acted, through which connection, what.
        Bounded: the texts are cut, so a caller cannot fill the log with one line."""
        p = _params(params)
        actor, action, detail = p.get("actor"), p.get("action"), p.get("detail", "")
        if not isinstance(actor, str) or not isinstance(action, str) or not isinstance(detail, str):
            raise CommandError(
                ErrorCode.BAD_REQUEST,
                "params must be {'actor': str, 'action': str, 'detail'?: str}",
            )
        log.info(
            "audit: %s by %s via %s%s",
            action[:200],
            actor[:200],
            peer.describe(),
            f": {detail[:1000]}" if detail else "",
            extra=peer_fields(peer) | {"actor": actor[:200]},
        )
        return True
