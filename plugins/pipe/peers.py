"""Pipes across brokers: the pipe services of a set of brokers as one (docs/PIPES.md,
"Pipes across brokers").

Every pipe name has one *home*: the broker whose pipe engine holds the pipe. Each broker
computes it the same way -- rendezvous hashing of the name over the node names of the
brokers it is connected to (its own included), :func:`home_of` -- so an open on any
broker lands in the one engine where every other end of that name is, and the engine's
rules (plugins/pipe/engine.py) hold across brokers unchanged: one arrival order, one
buffer, one bound, one flush.

A broker whose client opens a pipe homed elsewhere *forwards*: its pipe service is an
ordinary client of the home broker (one connection per peer, ``msgq-pipe-peer``, made
with the link plugin's downstream settings and credentials), opens the end there and
relays the client's reads, writes and close one for one, answers included. The handle
it gives its client is its own (a *proxy*); the home sees the end as owned by the
forwarding broker's connection. Flow control is the pipe protocol's own: a read asks
for at most ``n`` bytes (its credit), a write is answered only once the home accepted
it, and each proxy may have at most ``max_pending`` requests in flight -- so the home's
``max_buffer`` bounds the pipe and a forwarding broker holds at most the requests in
flight (``max_pending x max_chunk`` per end).

Failure: a forwarding broker's connection to the home ending (the home broker stopped
or was killed, the network cut or black-holed it: the heartbeat ends it) fails every
proxy through it ``pipe-broken``; the home, seeing that connection's ``disconnected``
event, breaks every pipe with an end through it (engine Rule 9): its local ends fail
``pipe-broken`` too. A client of a forwarding broker that closes, crashes or is
SIGKILLed has its remote ends closed in order (as on one broker).
"""

from __future__ import annotations

import hashlib
import logging
import math
import socket as socketlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import attrs
import trio

from msgq_trio.client.bus import Bus, Message, connect
from msgq_trio.client.session import PendingCall
from msgq_trio.errors import (
    ConnectError,
    ConnectionLost,
    MsgqError,
    NoRecipient,
    RecipientGone,
)

from ..link.service import Link, LinkDown
from ..link.settings import LinkConfig
from .engine import BAD_REQUEST, LIMIT_EXCEEDED, PIPE_BROKEN, Done, Engine, EngineError
from .settings import PipeSettings


class Service(Protocol):
    """What the federation uses of the pipe service (plugins/pipe/service.py)."""

    bus: Bus
    engine: Engine
    settings: PipeSettings

    def _sent(self, done: list[Done]) -> None: ...


__all__ = ["Federation", "Peer", "Proxy", "home_of"]

log = logging.getLogger("msgq_trio.plugins.pipe")

#: The client name of a pipe service's connection to a peer broker.
PEER_CLIENT = "msgq-pipe-peer"


def home_of(name: str, nodes: list[str]) -> str:
    """The home of pipe ``name`` among ``nodes`` (rendezvous hashing: every broker with
    the same set picks the same one; a broker leaving moves only its own names)."""
    return max(nodes, key=lambda n: hashlib.sha256(f"{n}\0{name}".encode()).digest())


@attrs.define(eq=False)
class Peer:
    """One configured peer broker and this broker's connection to it."""

    cfg: LinkConfig
    node: str = ""  # its node name, learned at hello
    bus: Bus | None = None  # while connected
    state: str = "connecting"
    last_error: str = ""
    proxies: set[int] = attrs.field(factory=set)
    session: trio.CancelScope | None = None  # the connected session, to end it
    ended: str = ""  # why this side ended the session


@attrs.define(eq=False)
class Proxy:
    """An end a local client opened on a pipe homed on ``peer``."""

    handle: int  # the local client's handle
    owner: str  # its lname
    name: str
    role: str
    peer: Peer
    remote: int  # the handle on the home broker
    pending: int = 0
    broken: str = ""


class Federation:
    """The broker-to-broker side of one pipe service."""

    def __init__(self, service: Service, socket: Path) -> None:
        self.service = service
        s = service.settings
        self.node = s.node or f"{socketlib.gethostname()}:{socket}"
        self.peers = [Peer(cfg) for cfg in s.peers]
        self.proxies: dict[int, Proxy] = {}
        #: Connections of peer brokers to this one (lname -> node), from their hello.
        self.links_in: dict[str, str] = {}
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        #: Opens in flight per client, and the clients that left meanwhile.
        self._opening: dict[str, int] = {}
        self._vanished: set[str] = set()
        self.counters = {"bytes_to_peers": 0, "bytes_from_peers": 0, "forwarded_opens": 0}

    # -- membership of the set ---------------------------------------------------------
    def nodes(self) -> list[str]:
        """This broker and every peer it is connected to now."""
        return [self.node] + [p.node for p in self.peers if p.bus is not None and p.node]

    def _missing(self) -> set[str]:
        """Peers connected to this broker that it is not connected to (yet), and peers
        whose first connection attempt has not ended: an open waits for them (at most
        ``peer_wait``) so that both brokers count the same set."""
        first = {p.cfg.address for p in self.peers if p.state == "connecting"}
        return (set(self.links_in.values()) - set(self.nodes())) | first

    def _change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, nursery: trio.Nursery) -> None:
        """Start one connection loop per peer (call once)."""
        self._nursery = nursery
        for peer in self.peers:
            nursery.start_soon(self._peer_loop, peer)

    async def _peer_loop(self, peer: Peer) -> None:
        cfg = peer.cfg
        delay = cfg.retry_min
        # The link plugin's credentials (token, token_file, TLS) for the same settings.
        creds = Link(f"pipe-peer:{cfg.address}", cfg, Path("-"))
        group = self.service.settings.group
        while True:
            why = ""
            try:
                kw = creds._credentials()
                with trio.CancelScope(deadline=trio.current_time() + cfg.connect_timeout) as cs:
                    async with connect(cfg.address, PEER_CLIENT, **kw) as bus:
                        info = await bus.call(group, "pipe.peer.hello", {"node": self.node})
                        node = info.get("node") if isinstance(info, dict) else None
                        if not isinstance(node, str) or not node or node == self.node:
                            raise LinkDown(f"peer answered hello with node {node!r}")
                        cs.deadline = math.inf
                        peer.session, peer.ended = cs, ""
                        peer.node, peer.bus, peer.state = node, bus, "up"
                        log.info("pipe peer %s (%s): connected", cfg.address, node)
                        self._change()
                        delay = cfg.retry_min
                        lost = await bus.wait_lost()
                        why = str(lost)
                if cs.cancelled_caught:
                    why = peer.ended or (
                        f"no answer within connect_timeout ({cfg.connect_timeout} s)"
                    )
            except (MsgqError, LinkDown, OSError) as exc:
                why = str(exc) or type(exc).__name__
            finally:
                peer.session = None
                if peer.bus is not None:
                    self._peer_down(peer, why or "connection closed")
            peer.state, peer.last_error = "down", why
            log.warning("pipe peer %s: %s (retrying in %.3g s)", cfg.address, why, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, cfg.retry_max)

    def _home_restarted(self, peer: Peer, exc: MsgqError) -> None:
        """The peer's pipe service went away (its plugin restarted, with every pipe it
        held): end the session, so every end through it breaks and the next session
        says hello to the new service (which must count this broker's connection as a
        peer's)."""
        if peer.session is not None and not peer.ended:
            peer.ended = f"the pipe service of broker {peer.node} went away: {exc}"
            peer.session.cancel()

    def _peer_down(self, peer: Peer, why: str) -> None:
        """The connection to ``peer`` ended: every proxy through it is broken."""
        peer.bus = None
        msg = f"the connection to broker {peer.node} ({peer.cfg.address}) was lost: {why}"
        for h in sorted(peer.proxies):
            px = self.proxies.get(h)
            if px is not None:
                px.broken = f"pipe {px.name!r}: {msg}"
        if peer.proxies:
            log.warning("pipe peer %s: %d remote ends broken", peer.cfg.address, len(peer.proxies))
        self._change()

    # -- the home side -----------------------------------------------------------------
    def hello(self, request: Message, p: Any) -> None:
        node = p.get("node") if isinstance(p, dict) else None
        if not isinstance(node, str) or not node:
            raise EngineError(BAD_REQUEST, "pipe.peer.hello needs 'node' (str)")
        if node == self.node:
            raise EngineError(BAD_REQUEST, f"node name {node!r} is this broker's own")
        self.links_in[request.sender] = node
        log.info("pipe peer %s (%s) connected to this broker", node, request.sender)
        self.service.bus.answer(request, {"node": self.node})
        self._change()

    def link_gone(self, lname: str) -> bool:
        """A connection left; True if it was a peer broker's (its pipes are broken)."""
        node = self.links_in.pop(lname, None)
        if node is None:
            return False
        why = f"the connection from broker {node} was lost"
        log.warning("pipe peer %s: %s", node, why)
        self.service._sent(self.service.engine.break_owner(lname, why))
        self._change()
        return True

    # -- the forwarding side -----------------------------------------------------------
    def wants(self, p: Any) -> bool:
        """Whether an open from a local client goes through the set (not: persistent
        pipes, which stay on the broker whose store holds them)."""
        if not self.peers or not isinstance(p, dict) or "peer" in p:
            return False
        name = p.get("pipe")
        declared = self.service.engine.declared.get(name) if isinstance(name, str) else None
        return p.get("persistent") is not True and not (declared and declared.persistent)

    def open(self, request: Message, p: dict[str, Any], local: Callable[[], None]) -> None:
        """Open for a local client: at home here (``local()``), or forwarded."""
        name = p.get("pipe")
        if (
            not self._missing()
            and isinstance(name, str)
            and home_of(name, self.nodes()) == self.node
        ):
            local()
            return
        sender = request.sender
        self._opening[sender] = self._opening.get(sender, 0) + 1
        assert self._nursery is not None
        self._nursery.start_soon(self._open_task, request, p, local)

    async def _open_task(
        self, request: Message, p: dict[str, Any], local: Callable[[], None]
    ) -> None:
        sender = request.sender
        try:
            with trio.move_on_after(self.service.settings.peer_wait):
                while self._missing():
                    await self._changed.wait()
            if sender in self._vanished:
                return
            name = str(p.get("pipe"))
            home = home_of(name, self.nodes())
            peer = next((x for x in self.peers if x.bus is not None and x.node == home), None)
            if peer is None:
                local()
                return
            await self._forward_open(request, p, peer)
        finally:
            left = self._opening[sender] - 1
            if left:
                self._opening[sender] = left
            else:
                del self._opening[sender]
                self._vanished.discard(sender)

    async def _forward_open(self, request: Message, p: dict[str, Any], peer: Peer) -> None:
        bus = peer.bus
        assert bus is not None
        svc = self.service
        params = {**p, "persistent": False, "peer": self.node}
        try:
            info = await bus.call(svc.settings.group, "pipe.open", params)
        except ConnectionLost as exc:
            svc.bus.answer_error(
                request, PIPE_BROKEN, f"pipe.open: broker {peer.node} went away: {exc}"
            )
            return
        except (RecipientGone, NoRecipient) as exc:
            self._home_restarted(peer, exc)
            svc.bus.answer_error(
                request,
                PIPE_BROKEN,
                f"pipe.open: the pipe service of broker {peer.node} went away: {exc}",
            )
            return
        except MsgqError as exc:
            code = getattr(exc, "code", None) or "internal-error"
            svc.bus.answer_error(request, code, getattr(exc, "message", str(exc)))
            return
        remote = info.get("handle") if isinstance(info, dict) else None
        if not isinstance(remote, int):
            log.error("pipe peer %s answered pipe.open without a handle: %r", peer.node, info)
            svc.bus.answer_error(
                request, "internal-error", f"pipe.open: broker {peer.node} answered {info!r}"
            )
            return
        if request.sender in self._vanished or peer.bus is not bus:
            # Its client left (or the peer went) while the open was on its way.
            if peer.bus is bus:
                self._fire_close(bus, remote)
            return
        handle = next(svc.engine._handles)
        px = Proxy(handle, request.sender, str(p.get("pipe")), str(p.get("mode")), peer, remote)
        self.proxies[handle] = px
        peer.proxies.add(handle)
        self.counters["forwarded_opens"] += 1
        svc.bus.answer(request, {**info, "handle": handle, "home": peer.node})

    def _fire_close(self, bus: Bus, remote: int) -> None:
        try:
            call = bus.start_request(self.service.settings.group, "pipe.close", {"h": remote})
        except MsgqError:
            return
        assert self._nursery is not None
        self._nursery.start_soon(self._drop, bus, call)

    @staticmethod
    async def _drop(bus: Bus, call: PendingCall) -> None:
        await bus.wait_call(call)
        bus.forget_call(call)

    def forward(self, request: Message, command: str, p: Any) -> bool:
        """Relay ``command`` on a proxy handle to its home; False if ``p['h']`` is not a
        proxy (the engine's own handle, or unknown)."""
        h = p.get("h") if isinstance(p, dict) else None
        px = self.proxies.get(h) if isinstance(h, int) else None
        if px is None:
            return False
        svc = self.service
        if px.owner != request.sender:
            raise EngineError(PIPE_BROKEN, f"unknown pipe handle {h}")
        if command == "pipe.close":
            self._forget(px)
            if px.broken or px.peer.bus is None:
                svc.bus.answer(request, True)
                return True
        elif px.broken:
            svc.bus.answer_error(request, PIPE_BROKEN, px.broken)
            return True
        elif px.pending >= svc.settings.max_pending:
            raise EngineError(
                LIMIT_EXCEEDED,
                f"more than max_pending ({svc.settings.max_pending}) operations on one handle",
            )
        bus = px.peer.bus
        assert bus is not None
        blobs = request.attachments
        try:
            call = bus.start_request(
                svc.settings.group, command, {**p, "h": px.remote}, attachments=blobs
            )
        except MsgqError as exc:
            svc.bus.answer_error(request, PIPE_BROKEN, f"pipe {px.name!r}: {exc}")
            return True
        self.counters["bytes_to_peers"] += sum(len(b) for b in blobs)
        px.pending += 1
        assert self._nursery is not None
        self._nursery.start_soon(self._relay, request, bus, call, px)
        return True

    async def _relay(self, request: Message, bus: Bus, call: PendingCall, px: Proxy) -> None:
        await bus.wait_call(call)
        bus.forget_call(call)
        px.pending -= 1
        svc = self.service
        err = call.error
        if err is None:
            blobs = call.frame.blobs() if call.frame is not None else []
            self.counters["bytes_from_peers"] += sum(len(b) for b in blobs)
            svc.bus.answer(request, call.result, attachments=blobs)
        elif isinstance(err, (ConnectionLost, RecipientGone, NoRecipient, ConnectError)):
            if isinstance(err, (RecipientGone, NoRecipient)):
                self._home_restarted(px.peer, err)
            svc.bus.answer_error(
                request, PIPE_BROKEN, px.broken or f"pipe {px.name!r}: broker {px.peer.node}: {err}"
            )
        else:
            code = getattr(err, "code", None) or "internal-error"
            svc.bus.answer_error(request, code, getattr(err, "message", str(err)))

    def _forget(self, px: Proxy) -> None:
        self.proxies.pop(px.handle, None)
        px.peer.proxies.discard(px.handle)

    def client_gone(self, lname: str) -> None:
        """A local client left: close its remote ends in order (the home then applies
        the single-broker rules: end of pipe, reader gone)."""
        if lname in self._opening:
            self._vanished.add(lname)
        for px in [x for x in self.proxies.values() if x.owner == lname]:
            self._forget(px)
            if not px.broken and px.peer.bus is not None:
                self._fire_close(px.peer.bus, px.remote)

    # -- operations --------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "peers": [
                {
                    "address": p.cfg.address,
                    "node": p.node,
                    "state": p.state,
                    "last_error": p.last_error,
                    "ends": len(p.proxies),
                }
                for p in self.peers
            ],
            "links_in": sorted(self.links_in.values()),
            "remote_ends": len(self.proxies),
            "ends_from_peers": sum(
                len(self.service.engine.by_owner.get(lname, ())) for lname in self.links_in
            ),
            **self.counters,
        }

    def ls_all(self, request: Message) -> None:
        """Answer ``request`` with the listing of this broker and of every peer it is
        connected to (``pipe.ls {all: true}``; ``msgq-trio pipe ls``)."""
        assert self._nursery is not None
        self._nursery.start_soon(self._ls_all, request)

    async def _ls_all(self, request: Message) -> None:
        brokers = [self.listing()]
        errors = []
        for peer in self.peers:
            bus = peer.bus
            if bus is None:
                errors.append({"address": peer.cfg.address, "error": peer.last_error or "down"})
                continue
            try:
                with trio.fail_after(peer.cfg.connect_timeout):
                    brokers.append(dict(await bus.call(self.service.settings.group, "pipe.ls")))
            except (MsgqError, trio.TooSlowError) as exc:
                errors.append({"address": peer.cfg.address, "error": str(exc) or "timeout"})
        self.service.bus.answer(request, {"brokers": brokers, "unreachable": errors})

    def listing(self) -> dict[str, Any]:
        """This broker's pipes and their ends, each end with its broker."""
        pipes = self.service.engine.listing()
        for pipe in pipes:
            for e in pipe["ends"]:  # type: ignore[attr-defined]
                e["broker"] = self.links_in.get(e["owner"], self.node)
        return {
            "node": self.node,
            "pipes": pipes,
            "remote": [
                {"name": px.name, "role": px.role, "owner": px.owner, "home": px.peer.node}
                for px in self.proxies.values()
            ],
        }
