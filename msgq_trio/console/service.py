"""The console's broker side: one poller shared by every browser tab, the actions, the
logged-in viewers' own connections and the live traffic streams.

Cost to the broker is independent of the number of viewers: the poller takes one
snapshot per interval on the console's own connection and every tab gets that same
document. A snapshot asks only for what the open views show (:data:`VIEW_SECTIONS`):
the broker card's cheap figures always (``stats`` with ``fields``, ``groups``, and
``config-get`` when the configuration's generation moved), ``clients`` only while a
viewer looks at the clients or groups, ``command-stats`` at the commands, the queue,
pipe and link plugins at the queues; and nothing at all while no viewer is connected.
Only the traffic view and a form's declaration cost a request per viewer, and the
traffic streams are bounded (``max_traffic``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from .. import connect
from ..client.bus import Bus
from ..errors import MsgqError, RpcError
from ..ops.introspect_cli import gather
from .model import DEFAULT_INTERVAL, DEFAULT_MAX_ROWS, History, Raw, view

log = logging.getLogger("msgq_trio.console")

#: Live traffic views open at once (each is a connection with a dump on the broker):
#: a handful of operators watching; more are refused with a clear message.
DEFAULT_MAX_TRAFFIC = 4
#: Batches of traffic records held for a viewer that reads slowly (then they are dropped).
TRAFFIC_BACKLOG = 64
#: Queues whose ``stats`` the snapshot asks for at most (one request each).
MAX_QUEUES = 200
#: Sessions (logged-in viewers, each with a broker connection) at once.
DEFAULT_MAX_SESSIONS = 32
#: A session unused this long is closed with its connection (seconds).
SESSION_IDLE = 3600.0


#: What each view of the page shows beyond the broker card (the sections a snapshot
#: asks the broker for while a viewer is on that view); ``all``: every section (the
#: ``/api/snapshot`` document, and an event stream that names no view).
SECTIONS = frozenset({"clients", "commands", "queues"})
VIEW_SECTIONS: dict[str, frozenset[str]] = {
    "broker": frozenset(),
    "clients": frozenset({"clients"}),
    "groups": frozenset({"clients"}),  # the groups table is made from the clients' rows
    "commands": frozenset({"commands"}),
    "queues": frozenset({"queues"}),
    "traffic": frozenset(),
    "actions": frozenset(),
    "all": SECTIONS,
}
#: The ``clients`` row keys the page shows (the broker computes and sends no others;
#: how long each is connected follows from ``connected_at`` and the answer's ``now``).
CLIENT_FIELDS = [
    "lname",
    "name",
    "pid",
    "uid",
    "groups",
    "queued_bytes",
    "msgs_in",
    "msgs_out",
    "connected_at",
    "where",
]
#: The ``stats`` keys the broker card and the chart show; each is computed alone by the
#: broker, without the full answer's walk of every task and descriptor.
STATS_FIELDS = [
    "connections",
    "pending_requests",
    "queued_bytes",
    "rss_bytes",
    "uptime",
    "traffic",
    "capture",
    "config",
]


class ActionError(Exception):
    """An action the console refuses before it reaches the broker (the viewer's fault)."""


@dataclass
class Session:
    """One viewer: the CSRF token of its page, and when logged in, its own connection
    to the broker (the broker's access rules and log see that identity)."""

    sid: str
    csrf: str
    actor: str
    bus: Bus | None = None
    last_used: float = field(default_factory=time.monotonic)
    stop: trio.Event = field(default_factory=trio.Event)


class Console:
    """The console's state: the latest snapshot and the sessions.

    Args:
        socket: the broker's address (``connect``'s first argument).
        connect_kw: ``connect()`` keywords of the console's own connection (token, TLS).
        login: viewers log in with a broker token; their actions run on a connection
            made with it. Without, every action runs on the console's own connection.
        interval: seconds between snapshots (:data:`DEFAULT_INTERVAL`).
    """

    def __init__(
        self,
        socket: str | None,
        connect_kw: Mapping[str, Any],
        *,
        login: bool = False,
        interval: float = DEFAULT_INTERVAL,
        max_rows: int = DEFAULT_MAX_ROWS,
        max_traffic: int = DEFAULT_MAX_TRAFFIC,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        self.socket = socket
        self.connect_kw = dict(connect_kw)
        self.login = login
        self.interval = interval
        self.max_rows = max_rows
        self.max_traffic = max_traffic
        self.max_sessions = max_sessions
        self.history = History()
        self.seq = 0
        #: The latest document, its JSON made when first asked for (a stream that
        #: had the previous one gets the delta instead), and the delta's JSON.
        self._doc: dict[str, Any] = {"taken_at": None, "errors": {"broker": "connecting"}}
        self._text: str | None = None
        self._delta: str | None = None
        #: The latest document shows the clients table as the broker last answered it.
        self._clients_shown = False
        self.snapshots = 0
        self.bus: Bus | None = None
        self.sessions: dict[str, Session] = {}
        self.traffic_open = 0
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        #: Event streams open per view (the sections they need are polled).
        self.watching: dict[str, int] = {}
        #: Until then (trio clock), every section is polled: ``/api/snapshot`` readers.
        self.full_until = -math.inf
        #: The sections the current document holds.
        self.sections: frozenset[str] = frozenset()
        self._wake = trio.Event()
        self._version: Any = None
        #: The configuration's generation and the config-get answer of that generation.
        self._config: tuple[Any, Mapping[str, Any]] = (None, {})
        #: The clients table as the broker last answered it (lname -> row) and that
        #: answer's generation: each snapshot asks only for what changed since.
        self._clients: dict[str, Mapping[str, Any]] = {}
        self._clients_generation = 0

    # -- the poller ---------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll the broker forever; reconnect after a loss (the page shows why)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._expire_sessions)
            started = False
            while True:
                try:
                    async with connect(
                        self.socket, name="msgq-trio-console", **self.connect_kw
                    ) as bus:
                        self.bus = bus
                        self._version = None
                        self._config = (None, {})
                        self._clients, self._clients_generation = {}, 0
                        if not started:
                            task_status.started()
                            started = True
                        # One snapshot per interval, start to start: a slow answer
                        # shortens the pause, never adds a burst of catch-up polls. No
                        # viewer, no snapshot; a viewer that needs a section the
                        # document lacks gets one at once.
                        deadline = trio.current_time()
                        while True:
                            wanted = self.wanted()
                            if wanted is None:
                                await self._wake.wait()
                                deadline = trio.current_time()
                                continue
                            await self.poll_once(bus, wanted)
                            deadline = max(deadline + self.interval, trio.current_time())
                            with trio.move_on_at(deadline):
                                while (self.wanted() or frozenset()) <= self.sections:
                                    await self._wake.wait()
                                deadline = trio.current_time()
                except (MsgqError, OSError) as exc:
                    self.bus = None
                    self._publish(
                        {"taken_at": time.time(), "errors": {"broker": f"unreachable: {exc}"}}
                    )
                    if not started:
                        task_status.started()
                        started = True
                    await trio.sleep(self.interval)

    # -- who is looking at what ----------------------------------------------------------
    def wanted(self) -> frozenset[str] | None:
        """The sections the next snapshot asks for; None: no viewer, no snapshot."""
        if trio.current_time() < self.full_until:
            return SECTIONS
        if not any(self.watching.values()):
            return None
        out: frozenset[str] = frozenset()
        for v, n in self.watching.items():
            if n:
                out |= VIEW_SECTIONS[v]
        return out

    def _demand(self, was_idle: bool) -> None:
        """A viewer came: the poller snapshots at once if it was idle (no viewer until
        now: the document is old) or if the document lacks a section now wanted."""
        if was_idle:
            self.sections = frozenset()  # too old: viewers wait for the next snapshot
        self._wake.set()
        self._wake = trio.Event()

    @property
    def idle(self) -> bool:
        """No snapshot is being taken for anyone (the document may be old)."""
        return self.wanted() is None

    @contextlib.contextmanager
    def watch(self, view: str) -> Iterator[frozenset[str]]:
        """An event stream open on ``view`` (a key of :data:`VIEW_SECTIONS`): its
        sections are polled while it lasts. Yields the sections it needs."""
        was_idle = self.idle
        self.watching[view] = self.watching.get(view, 0) + 1
        sections = VIEW_SECTIONS[view]
        self._demand(was_idle)
        try:
            yield sections
        finally:
            self.watching[view] -= 1

    async def fresh_document(self, timeout: float) -> str:
        """The document with every section, for a reader of ``/api/snapshot``: every
        section is polled for the next two intervals (a reader polling the endpoint
        keeps them fresh); waits up to ``timeout`` for a snapshot that has them all, else
        returns the latest document."""
        was_idle = self.idle
        self.full_until = trio.current_time() + 2 * self.interval
        self._demand(was_idle)
        with trio.move_on_after(timeout):
            while not self.sections >= SECTIONS:
                await self._changed.wait()
        return self.document

    async def poll_once(self, bus: Bus, sections: frozenset[str] = SECTIONS) -> None:
        """One snapshot: the broker card's sources and ``sections`` asked at once, each
        bounded by the interval; a source that fails is named in the document's
        ``errors``, the rest still shows."""
        raw = Raw(taken_at=time.time())
        wait = max(self.interval, 1.0)

        async def ask(attr: str, target: str, command: str, params: Any = None) -> None:
            try:
                setattr(raw, attr, await bus.call(target, command, params, timeout=wait))
            except RpcError as exc:
                raw.errors[attr] = f"{exc.code}: {exc.message}"

        async def queues() -> None:
            group = str((raw.config.get("access") or {}).get("queue_group") or "msgq-queue")
            try:
                names = await bus.call(group, "queues", timeout=wait)
                rows = []
                for name in list(names)[:MAX_QUEUES]:
                    rows.append(await bus.call(group, "stats", {"queue": name}, timeout=wait))
                raw.queues = rows
            except RpcError as exc:
                if exc.code != "no-recipient":
                    raw.errors["queues"] = f"{exc.code}: {exc.message}"

        async def optional(attr: str, target: str, command: str, params: Any = None) -> None:
            try:
                setattr(raw, attr, await bus.call(target, command, params, timeout=wait))
            except RpcError as exc:
                if exc.code != "no-recipient":  # the plugin does not run: nothing to show
                    raw.errors[attr] = f"{exc.code}: {exc.message}"

        async def clients() -> None:
            since = {"fields": CLIENT_FIELDS, "since": self._clients_generation}
            try:
                answer = await bus.call("msgq", "clients", since, timeout=wait)
            except RpcError as exc:
                raw.errors["clients"] = f"{exc.code}: {exc.message}"
                return
            if isinstance(answer, list):  # a broker that answers every row each time
                raw.clients = answer
                return
            table = {} if answer.get("full") else self._clients
            gone = [str(lname) for lname in answer.get("gone") or ()]
            for lname in gone:
                table.pop(lname, None)
            changed = set()
            for row in answer.get("rows") or ():
                changed.add(str(row.get("lname")))
                table[str(row.get("lname"))] = row
            self._clients, self._clients_generation = table, int(answer["generation"])
            raw.clients = list(table.values())
            raw.clients_now = answer.get("now")
            clients_ok.append(True)
            if not answer.get("full"):
                clients_delta.append((changed, gone))

        async def version() -> None:
            # Once per connection: a broker that is upgraded is a new connection.
            if self._version is None:
                await ask("version", "msgq", "version")
                self._version = raw.version or None
            else:
                raw.version = self._version

        # What changed in the clients table since the previous snapshot (the broker's
        # answer to clients with since), if it told.
        clients_delta: list[tuple[set[str], list[str]]] = []
        clients_ok: list[bool] = []
        # The configuration again only when its generation moved (a reload, config-set):
        # the stats' config figures say, before anything else is asked.
        await ask("stats", "msgq", "stats", {"fields": STATS_FIELDS})
        generation = (raw.stats.get("config") or {}).get("generation")
        if generation is None or generation != self._config[0]:
            await ask("config", "msgq", "config-get")
            if "config" not in raw.errors:
                self._config = (generation, raw.config)
        else:
            raw.config = self._config[1]
        async with trio.open_nursery() as n:
            n.start_soon(version)
            n.start_soon(ask, "groups", "msgq", "groups")
            if "clients" in sections:
                n.start_soon(clients)
            if "commands" in sections:
                n.start_soon(ask, "command_stats", "msgq", "command-stats")
            if "queues" in sections:
                n.start_soon(queues)
                n.start_soon(optional, "pipes", "msgq-pipe", "pipe.ls", {"all": True})
                n.start_soon(optional, "links", "msgq-link", "status")
        doc = view(raw, self.history, max_rows=self.max_rows)
        doc["interval"] = self.interval
        doc["console"] = {"lname": bus.lname, "login": self.login}
        doc["sections"] = sorted(sections)
        doc["clients_now"] = raw.clients_now
        delta = None
        # A delta only to a document whose table the broker's answer was relative to.
        if clients_delta and self._clients_shown and "clients" in self.sections:
            delta = self._delta_of(doc, *clients_delta[0])
        self._clients_shown = bool(clients_ok)
        self._publish(doc, sections, delta)

    def _delta_of(
        self, doc: dict[str, Any], changed: set[str], gone: list[str]
    ) -> dict[str, Any] | None:
        """``doc`` as a change to the previous document, for a page that has it: the
        clients table as the rows that changed and the lnames gone (the page works out
        how long each client is connected from ``clients_now``), the groups table only
        if it changed. None when the tables were cut to ``max_rows``."""
        prev = self._doc
        if doc["clients_total"] > self.max_rows or prev.get("clients_total", 0) > self.max_rows:
            return None
        delta = {k: v for k, v in doc.items() if k not in ("clients", "groups")}
        delta["clients_delta"] = {
            "set": [r for r in doc["clients"] if r["lname"] in changed],
            "gone": gone,
        }
        if doc["groups"] != prev.get("groups"):
            delta["groups"] = doc["groups"]
        return delta

    @property
    def document(self) -> str:
        """The latest document as JSON (made once per snapshot, when first asked for)."""
        if self._text is None:
            self._text = json.dumps(self._doc, default=str, separators=(",", ":"))
        return self._text

    def _publish(
        self,
        doc: dict[str, Any],
        sections: frozenset[str] = SECTIONS,
        delta: dict[str, Any] | None = None,
    ) -> None:
        self._doc, self._text = doc, None
        self._delta = (
            None if delta is None else json.dumps(delta, default=str, separators=(",", ":"))
        )
        self.sections = sections
        self.seq += 1
        self.snapshots += 1
        self._changed.set()
        self._changed = trio.Event()

    async def next_update(
        self, seq: int, sections: frozenset[str] = frozenset()
    ) -> tuple[int, str, str]:
        """The current document if it is newer than ``seq`` and holds ``sections``, else
        the next such one as soon as it is made (every tab waits on the same snapshot; a
        document without the broker, the broker being unreachable, holds every section).
        Returns its seq, ``"delta"`` and the change to document ``seq`` when there is one
        (the reader had the previous document), else ``"snapshot"`` and the document.
        Safe to cancel."""
        while self.seq == seq or not sections <= self.sections:
            await self._changed.wait()
        if self._delta is not None and seq == self.seq - 1:
            return self.seq, "delta", self._delta
        return self.seq, "snapshot", self.document

    # -- sessions -------------------------------------------------------------------------
    def new_session(self, actor: str, bus: Bus | None = None) -> Session:
        s = Session(sid=secrets.token_urlsafe(32), csrf=secrets.token_urlsafe(32), actor=actor)
        s.bus = bus
        self.sessions[s.sid] = s
        return s

    def session(self, sid: str | None) -> Session | None:
        s = self.sessions.get(sid) if sid else None
        if s is not None:
            s.last_used = time.monotonic()
        return s

    def end_session(self, sid: str) -> None:
        s = self.sessions.pop(sid, None)
        if s is not None:
            s.stop.set()

    async def _expire_sessions(self) -> None:
        while True:
            await trio.sleep(60)
            now = time.monotonic()
            for sid, s in list(self.sessions.items()):
                if now - s.last_used > SESSION_IDLE:
                    self.end_session(sid)

    async def log_in(self, token: str) -> Session:
        """A session with its own broker connection made with ``token``.

        Raises:
            ActionError: too many sessions, or the broker refused the token.
        """
        if self._nursery is None:
            raise ActionError("the console is not running")
        if sum(1 for s in self.sessions.values() if s.bus is not None) >= self.max_sessions:
            raise ActionError(f"too many viewers logged in (at most {self.max_sessions})")
        kw = {k: v for k, v in self.connect_kw.items() if k != "token"}
        ready: list[Session] = []

        async def hold(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                async with connect(
                    self.socket, name="msgq-trio-console-user", token=token, **kw
                ) as bus:
                    s = self.new_session(f"{bus.lname}", bus)
                    ready.append(s)
                    task_status.started()
                    await s.stop.wait()
            except (MsgqError, OSError) as exc:
                if not ready:
                    raise ActionError(f"the broker refused the login: {exc}") from None
                log.info("a viewer's connection ended: %s", exc)
                self.end_session(ready[0].sid)

        await self._nursery.start(hold)
        s = ready[0]
        s.actor = await self._who(s)
        return s

    async def _who(self, s: Session) -> str:
        """A logged-in viewer as the broker knows its connection (``tcp:NAME@host:port``),
        asked on the console's connection; its lname if that is refused."""
        assert s.bus is not None
        lname = s.bus.lname
        try:
            if self.bus is not None:
                for row in await self.bus.call("msgq", "clients", timeout=self.interval * 5):
                    if row.get("lname") == lname and row.get("where"):
                        return f"{row['where']} ({lname})"
        except MsgqError:
            pass
        return f"viewer on {lname}"

    # -- actions --------------------------------------------------------------------------
    async def act(self, s: Session, action: Mapping[str, Any]) -> dict[str, Any]:
        """Run one action for the viewer of ``s``: on its own connection when logged in,
        else on the console's. Returns ``{"ok": true, "result"}`` or the broker's refusal
        ``{"ok": false, "code", "message"}``; each is written to the broker's log with the
        viewer's identity (the ``audit`` control command).

        Raises:
            ActionError: a malformed action (nothing was sent).
        """
        bus = s.bus or self.bus
        if bus is None:
            raise ActionError("the console has no connection to the broker")
        kind = action.get("action")
        timeout = self.interval * 5

        def text(key: str) -> str:
            v = action.get(key)
            if not isinstance(v, str) or not v:
                raise ActionError(f"{key!r} must be a non-empty string")
            return v

        detail: str
        try:
            if kind == "call":
                target, command = text("target"), text("command")
                params = action.get("params")
                detail = f"{target} {command} {json.dumps(params)[:500]}"
                result = await bus.call(target, command, params, timeout=timeout)
            elif kind == "notify":
                group, event = text("group"), text("event")
                params = action.get("params")
                detail = f"{group} {event} {json.dumps(params)[:500]}"
                await bus.notify(group, event, params)
                result = None
            elif kind == "drop":
                lname = text("lname")
                detail = lname
                result = await bus.call(
                    "msgq",
                    "drop",
                    {"lname": lname, "reason": f"dropped from the web console by {s.actor}"},
                    timeout=timeout,
                )
            elif kind == "purge":
                queue = text("queue")
                detail = queue
                group = str(action.get("group") or "msgq-queue")
                result = await bus.call(group, "purge", {"queue": queue}, timeout=timeout)
            elif kind == "capture-start":
                params = action.get("params") or {}
                if not isinstance(params, dict):
                    raise ActionError("params must be a map")
                detail = json.dumps(params)[:500]
                result = await bus.call("msgq", "capture-start", params, timeout=timeout)
            elif kind == "capture-stop":
                detail = ""
                result = await bus.call("msgq", "capture-stop", timeout=timeout)
            else:
                raise ActionError(f"unknown action {kind!r}")
        except RpcError as exc:
            await self._audit(s, str(kind), f"{detail}: refused {exc.code}: {exc.message}")
            return {"ok": False, "code": exc.code, "message": exc.message, "data": exc.data}
        except (TypeError, ValueError) as exc:  # params the codec cannot encode
            raise ActionError(f"params cannot be sent: {exc}") from None
        await self._audit(s, str(kind), f"{detail}: ok")
        return {"ok": True, "result": result}

    async def _audit(self, s: Session, action: str, detail: str) -> None:
        """The broker's log line for a viewer's action. The console's own connection
        writes it (a viewer may lack control rights); without them, the console's log."""
        params = {"actor": s.actor, "action": f"console {action}", "detail": detail}
        try:
            if self.bus is None:
                raise MsgqError("no connection")
            await self.bus.call("msgq", "audit", params, timeout=self.interval * 5)
        except MsgqError as exc:
            log.warning("audit line not written to the broker's log (%s): %s", exc, params)

    async def describe(self, target: str) -> list[dict[str, Any]]:
        """The members of group ``target`` with their declarations (``msgq.introspect``)."""
        if self.bus is None:
            raise ActionError("the console has no connection to the broker")
        return await gather(self.bus, target, timeout=self.interval)

    # -- live traffic ---------------------------------------------------------------------
    async def open_traffic(
        self, filters: Mapping[str, Any]
    ) -> tuple[trio.MemoryReceiveChannel[dict[str, Any]], trio.CancelScope]:
        """A connection of the console's with a dump running (``dump-start`` with
        ``filters``), read by a task of the console: its batches of records arrive on the
        returned channel (a viewer that falls behind loses batches, counted in the next
        one's ``dropped``). Cancel the scope, or close the channel, to end it.

        Raises:
            ActionError: :attr:`max_traffic` views are open already.
            MsgqError: the broker refused the connection or the dump.
        """
        if self._nursery is None:
            raise ActionError("the console is not running")
        if self.traffic_open >= self.max_traffic:
            raise ActionError(f"at most {self.max_traffic} traffic views at once")
        send, recv = trio.open_memory_channel[dict[str, Any]](TRAFFIC_BACKLOG)
        scope = trio.CancelScope()
        timeout = self.interval * 5

        async def run(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            self.traffic_open += 1
            started = False
            try:
                with scope, send:
                    async with connect(
                        self.socket, name="msgq-trio-console-dump", **self.connect_kw
                    ) as bus:
                        await bus.call("msgq", "dump-start", dict(filters), timeout=timeout)
                        task_status.started()
                        started = True
                        await self._forward(bus, send)
            except (MsgqError, OSError, trio.BrokenResourceError) as exc:
                if not started:
                    raise
                log.info("a traffic view ended: %s", exc)
            finally:
                self.traffic_open -= 1

        await self._nursery.start(run)
        return recv, scope

    @staticmethod
    async def _forward(bus: Bus, send: trio.MemorySendChannel[dict[str, Any]]) -> None:
        own = bus.lname
        dropped = 0
        async for msg in bus:
            body = msg.body
            if msg.sender != "l.0" or not isinstance(body, dict) or "records" not in body:
                continue
            recs = [
                r
                for r in body["records"]
                if isinstance(r, dict) and own not in (r.get("sender"), r.get("target"))
            ]
            dropped += int(body.get("dropped") or 0)
            if not recs and not dropped:
                continue
            try:
                send.send_nowait({"records": recs, "dropped": dropped})
                dropped = 0
            except trio.WouldBlock:
                dropped += len(recs)
