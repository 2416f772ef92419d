"""The console's model: broker answers in, view data out. No I/O, no event loop.

The poller (:mod:`msgq_trio.console.service`) gathers one :class:`Raw` per interval from
the broker's control commands and the plugins' status commands; :func:`view` turns it,
with the :class:`History` of earlier snapshots, into the JSON document every browser tab
renders. The forms of the "call" action come from a component's declaration
(``msgq.introspect``): :func:`form_fields` describes the inputs, :func:`parse_form` turns
the submitted strings back into typed params, naming the field at fault.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Seconds between two snapshots. Two seconds: the contract of "a client appears within
#: 2 s"; one snapshot per interval whatever the number of open browser tabs.
DEFAULT_INTERVAL = 2.0
#: Points kept for the rate charts: 5 minutes at the default interval.
DEFAULT_HISTORY = 150
#: Rows of each table sent to the browsers at most (the rest is counted, not sent): a
#: page with 1,000 client rows still loads fast; the filter and sort run on the console.
DEFAULT_MAX_ROWS = 2000


@dataclass
class Raw:
    """One snapshot as the broker answered it. ``errors``: source -> why it is missing
    (a plugin that is not running, a refused command)."""

    taken_at: float
    version: Mapping[str, Any] = field(default_factory=dict)
    stats: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    clients: list[Mapping[str, Any]] = field(default_factory=list)
    groups: list[Mapping[str, Any]] = field(default_factory=list)
    command_stats: Mapping[str, Any] = field(default_factory=dict)
    capture: Mapping[str, Any] = field(default_factory=dict)
    queues: list[Mapping[str, Any]] = field(default_factory=list)
    pipes: Mapping[str, Any] = field(default_factory=dict)
    links: list[Mapping[str, Any]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    #: The broker's time of day when it answered ``clients`` (rows without
    #: ``connected_for`` are that long connected since their ``connected_at``).
    clients_now: float | None = None


@dataclass
class History:
    """Totals of earlier snapshots, for rates and the charts (a bounded ring)."""

    maxlen: int = DEFAULT_HISTORY
    points: deque[tuple[float, float, float]] = field(default_factory=deque)
    #: (group, command) -> requests and errors at the previous snapshot.
    commands: dict[tuple[str, str], tuple[float, int, int]] = field(default_factory=dict)
    #: The clients table of the previous snapshot (``client_rows``'s cache).
    clients: dict[str, tuple[Mapping[str, Any], dict[str, Any]]] = field(default_factory=dict)

    def add(self, t: float, msgs_in: float, msgs_out: float) -> None:
        self.points.append((t, msgs_in, msgs_out))
        while len(self.points) > self.maxlen:
            self.points.popleft()

    def rates(self) -> list[dict[str, float]]:
        """Messages per second in and out between consecutive points (counter resets,
        a restarted broker, give 0 rather than a negative rate)."""
        out: list[dict[str, float]] = []
        pts = list(self.points)
        for (t0, i0, o0), (t1, i1, o1) in itertools.pairwise(pts):
            dt = t1 - t0
            if dt <= 0:
                continue
            out.append(
                {"t": t1, "in": max(i1 - i0, 0) / dt, "out": max(o1 - o0, 0) / dt},
            )
        return out


def _num(v: Any, default: float = 0) -> float:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _finite(v: Any) -> float | None:
    """JSON has no infinity: a latency past the last bucket is sent as None + a flag."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def identity(row: Mapping[str, Any]) -> str:
    """Who a client is: its TCP identity and address, else ``pid N uid N``."""
    where = row.get("where")
    if isinstance(where, str) and where:
        return where
    return f"pid {row.get('pid')} uid {row.get('uid')}"


def client_rows(
    clients: Iterable[Mapping[str, Any]],
    now: float | None = None,
    cache: dict[str, tuple[Mapping[str, Any], dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """The clients table, in lname order (l.2 before l.10). ``now``: the broker's time
    of day, for rows that come without ``connected_for``. ``cache`` (lname -> the broker's
    row and its table row, replaced by this call's): a broker row that is the very object
    of the previous call (a client ``clients`` with ``since`` did not send again) reuses
    its table row, only ``connected_for`` made anew."""
    rows: list[dict[str, Any]] = []
    seen: dict[str, tuple[Mapping[str, Any], dict[str, Any]]] = {}
    for c in clients:
        lname = str(c.get("lname", ""))
        hit = cache.get(lname) if cache is not None else None
        if hit is not None and hit[0] is c:
            base = hit[1]
        else:
            base = {
                "lname": lname,
                "n": int(lname[2:]) if lname[2:].isdigit() else 0,
                "name": str(c.get("name", "")),
                "identity": identity(c),
                "pid": c.get("pid"),
                "uid": c.get("uid"),
                "groups": [str(g) for g in c.get("groups") or ()],
                "queued_bytes": _num(c.get("queued_bytes")),
                "msgs_in": _num(c.get("msgs_in")),
                "msgs_out": _num(c.get("msgs_out")),
                "connected_at": _num(c.get("connected_at")),
            }
        seen[lname] = (c, base)
        row = dict(base)
        if "connected_for" in c or now is None:
            row["connected_for"] = _num(c.get("connected_for"))
        else:
            row["connected_for"] = round(max(now - base["connected_at"], 0.0), 3)
        rows.append(row)
    if cache is not None:
        cache.clear()
        cache.update(seen)
    rows.sort(key=lambda r: int(r["n"]))
    return rows


def group_rows(clients: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Groups and their members, from the clients' own group lists (so no request per
    group): ``[{"group", "members": [{"lname", "name"}]}]`` by name."""
    groups: dict[str, list[dict[str, str]]] = {}
    for c in clients:
        for g in c.get("groups") or ():
            groups.setdefault(str(g), []).append(
                {"lname": str(c.get("lname", "")), "name": str(c.get("name", ""))}
            )
    return [{"group": g, "members": groups[g]} for g in sorted(groups)]


def command_rows(
    command_stats: Mapping[str, Any], history: History, now: float
) -> list[dict[str, Any]]:
    """Per (group, command): requests, rate since the previous snapshot, outcomes,
    errors by code, p50/p99 (the upper bounds of their latency buckets)."""
    rows = []
    seen: dict[tuple[str, str], tuple[float, int, int]] = {}
    for c in command_stats.get("commands") or ():
        key = (str(c.get("group", "")), str(c.get("command", "")))
        requests = int(_num(c.get("requests")))
        outcomes = c.get("outcomes") or {}
        failed = sum(int(_num(v)) for k, v in outcomes.items() if k != "ok")
        prev = history.commands.get(key)
        rate = None
        if prev is not None and now > prev[0] and requests >= prev[1]:
            rate = (requests - prev[1]) / (now - prev[0])
        seen[key] = (now, requests, failed)
        lat = c.get("latency") or {}
        rows.append(
            {
                "group": key[0],
                "command": key[1],
                "requests": requests,
                "rate": rate,
                "failed": failed,
                "outcomes": {str(k): int(_num(v)) for k, v in outcomes.items()},
                "errors": {str(k): int(_num(v)) for k, v in (c.get("errors") or {}).items()},
                "p50": _finite(lat.get("p50")),
                "p99": _finite(lat.get("p99")),
                "p99_over": lat.get("p99") is not None and _finite(lat.get("p99")) is None,
            }
        )
    history.commands = seen
    return rows


def broker_view(raw: Raw) -> dict[str, Any]:
    """The broker's card: version, uptime, configuration source, listeners, plugins."""
    cfg = raw.config
    tcp = cfg.get("tcp") or {}
    listeners = []
    if cfg.get("socket"):
        listeners.append(f"unix:{cfg['socket']}")
    for addr in tcp.get("listen") or ():
        listeners.append(("tls://" if tcp.get("certfile") else "tcp://") + str(addr))
    metrics = (cfg.get("metrics") or {}).get("listen")
    if metrics:
        listeners.append(f"metrics http://{metrics}")
    members = {str(g.get("group")): int(_num(g.get("members"))) for g in raw.groups}
    plugins = []
    for name, settings in sorted((cfg.get("plugins") or {}).items()):
        group = (settings or {}).get("group") if isinstance(settings, dict) else None
        group = str(group or f"msgq-{name}")
        if name == "queue":
            group = str((cfg.get("access") or {}).get("queue_group") or group)
        n = members.get(group, 0)
        plugins.append({"name": name, "group": group, "state": "running" if n else "down"})
    stats = raw.stats
    config_src = (stats.get("config") or {}).get("file")
    return {
        "version": str(raw.version.get("broker", "?")),
        "protocol": raw.version.get("protocol"),
        "uptime": _num(stats.get("uptime")),
        "config_file": config_src or "(flags and defaults)",
        "config_generation": (stats.get("config") or {}).get("generation"),
        "listeners": listeners,
        "plugins": plugins,
        "connections": int(_num(stats.get("connections"))),
        "pending_requests": int(_num(stats.get("pending_requests"))),
        "queued_bytes": int(_num(stats.get("queued_bytes"))),
        "rss_bytes": int(_num(stats.get("rss_bytes"))),
        "capture": dict(raw.capture) if raw.capture else dict(stats.get("capture") or {}),
    }


def queue_rows(queues: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Durable queues: depth, oldest age, consumers, redeliveries, dead letters (the
    queue plugin's ``stats`` rows; missing figures are None)."""
    rows = []
    for q in queues:
        rows.append(
            {
                "queue": str(q.get("queue") or q.get("name") or ""),
                "depth": q.get("depth", q.get("ready")),
                "in_flight": q.get("in_flight"),
                "oldest_age": _finite(q.get("oldest_age")),
                "consumers": q.get("consumers"),
                "redelivered": q.get("redelivered"),
                "dead_lettered": q.get("dead_lettered"),
                "dead_letter": q.get("dead_letter"),
                "bound": q.get("bound"),
            }
        )
    return sorted(rows, key=lambda r: r["queue"])


def pipe_rows(listing: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Pipes and their ends from the pipe plugin's ``pipe.ls`` (every broker it sees):
    each end as its owner's lname, writers (role ``w``) and readers (``r``) apart."""
    rows = []
    for b in listing.get("brokers") or ():
        if not isinstance(b, Mapping):
            continue
        node = str(b.get("node", ""))
        for p in b.get("pipes") or ():
            if not isinstance(p, Mapping):
                continue
            ends = [e for e in p.get("ends") or () if isinstance(e, Mapping)]
            rows.append(
                {
                    "node": node,
                    "name": str(p.get("name", "")),
                    "writers": [str(e.get("owner", "?")) for e in ends if e.get("role") == "w"],
                    "readers": [str(e.get("owner", "?")) for e in ends if e.get("role") == "r"],
                    "mode": p.get("mode"),
                    "buffered": p.get("buffered"),
                    "persistent": bool(p.get("persistent")),
                }
            )
    return rows


def link_rows(links: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The link plugin's links to other brokers, as it reports them."""
    return [{str(k): v for k, v in link.items()} for link in links]


def view(raw: Raw, history: History, *, max_rows: int = DEFAULT_MAX_ROWS) -> dict[str, Any]:
    """The document every browser tab gets: JSON-safe, at most ``max_rows`` per table."""
    traffic = raw.stats.get("traffic") or {}
    history.add(raw.taken_at, _num(traffic.get("messages_in")), _num(traffic.get("messages_out")))
    clients = client_rows(raw.clients, raw.clients_now, history.clients)
    groups = group_rows(clients)  # members in lname order, as the clients table
    return {
        "taken_at": raw.taken_at,
        "broker": broker_view(raw),
        "clients": clients[:max_rows],
        "clients_total": len(clients),
        "groups": groups[:max_rows],
        "groups_total": len(groups),
        "commands": command_rows(raw.command_stats, history, raw.taken_at)[:max_rows],
        "queues": queue_rows(raw.queues)[:max_rows],
        "pipes": pipe_rows(raw.pipes)[:max_rows],
        "links": link_rows(raw.links)[:max_rows],
        "rates": history.rates(),
        "errors": dict(raw.errors),
    }


# -- forms of the call action -------------------------------------------------------------
class FormError(ValueError):
    """A field of a submitted form does not hold what its declaration asks (the user's
    fault); ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


#: Declared CBOR types with an input of their own; any other type is a JSON field.
_SCALAR_INPUTS = {"str": "text", "int": "number", "float": "number", "bool": "checkbox"}


def form_fields(command: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The inputs of a command's form from its declaration (``msgq.introspect``): one per
    declared parameter, with ``input`` text/number/checkbox or json (lists, maps, unions)."""
    out = []
    for p in command.get("params") or ():
        if not isinstance(p, Mapping) or not isinstance(p.get("name"), str):
            continue
        t = str(p.get("type", "any"))
        f: dict[str, Any] = {
            "name": p["name"],
            "type": t,
            "input": _SCALAR_INPUTS.get(t, "json"),
            "required": bool(p.get("required", True)),
            "doc": str(p.get("doc") or ""),
        }
        if "default" in p:
            f["default"] = p["default"]
        out.append(f)
    return out


def parse_value(name: str, declared: str, text: str) -> Any:
    """One submitted field as its declared type. Raises FormError naming the field."""
    if declared == "str":
        return text
    if declared == "int":
        try:
            return int(text, 10)
        except ValueError:
            raise FormError(name, f"expected an integer, got {text!r}") from None
    if declared == "float":
        try:
            v = float(text)
        except ValueError:
            raise FormError(name, f"expected a number, got {text!r}") from None
        if not math.isfinite(v):
            raise FormError(name, f"expected a finite number, got {text!r}")
        return v
    if declared == "bool":
        if text in ("true", "on", "1"):
            return True
        if text in ("false", "off", "0", ""):
            return False
        raise FormError(name, f"expected true or false, got {text!r}")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise FormError(name, f"not JSON ({exc})") from None


def parse_form(fields: list[dict[str, Any]], values: Mapping[str, str]) -> dict[str, Any]:
    """The params of a call from the submitted strings of its form: an empty optional
    field is left out (the callee's default applies); a required one must be there (an
    unchecked checkbox is ``false``). Raises FormError naming the first field at fault,
    or ``params`` for a value no field declares."""
    known = {f["name"] for f in fields}
    for name in values:
        if name not in known:
            raise FormError("params", f"{name!r} is not a declared parameter")
    out: dict[str, Any] = {}
    for f in fields:
        name = f["name"]
        text = values.get(name)
        if f["input"] == "checkbox":
            text = text or "false"
        if text is None or (text == "" and f["input"] != "text"):
            if f["required"]:
                raise FormError(name, "is required")
            continue
        out[name] = parse_value(name, f["type"], text)
    return out
