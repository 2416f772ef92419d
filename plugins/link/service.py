"""One link between brokers: consume a queue here, put each message into a queue of the
downstream broker under its original identity, ack here only once the downstream queue
answered for it (stored, consumed, or a duplicate of one it has).

Rules (docs/QUEUE.md, "Chained queues / links", states them for users):

1. A message is acked upstream only after the downstream put answered: then it is
   durable there, or consumed there, or a resend of one it already had. The upstream
   queue holds a message in flight to the link out of its commits for its ``ack_grace``
   (the queue plugin's rule), so when the answer comes within it, the message is never
   written upstream: a message is stored only at the last hop that has not been acked
   from further down.
2. Identity: downstream, a message is put as producer ``<source>/<original producer>``
   with its original producer seq. The downstream queue deduplicates by each producer's
   highest seq, so a resend (after a broken link, a link or upstream restart) is answered
   ``duplicate`` and not delivered twice.
3. Order: that deduplication needs each producer's messages in seq order on one
   connection. The link sends them in the order the upstream queue delivers them (its
   redeliveries keep their original order, whatever the order of the nacks, and a new
   session of the link first gets back what the previous one still held), one
   ``put_many`` per producer per delivery batch.
   Puts are pipelined, so each carries ``after`` (the producer's previous seq sent in
   this session): a put that overtakes a failed one is refused ``out-of-order`` instead
   of raising the producer's mark past messages that never arrived downstream.
4. Failure (connection lost, handshake or put timeout, an error answer): the session
   ends, every message the link holds is nacked upstream at once (the upstream queue
   stores it, having no consumer for it) and the link reconnects with a doubling backoff;
   the upstream queue then redelivers in order, with the same ids.
5. The upstream connection (``msgq-link.<name>`` on this broker) is the link's lifeline:
   losing it ends the plugin process (the supervisor restarts it; everything unacked is
   redelivered by the upstream queue).
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket as socketlib
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from msgq_trio.client.bus import Bus, connect
from msgq_trio.client.queue import Consumer, Queue, QueueMessage
from msgq_trio.errors import ConnectError, ConnectionLost, MsgqError, RequestTimeout, RpcError
from msgq_trio.exposition import Exposition, MetricsServer, open_plugin_listeners

from .settings import LinkConfig, LinkSettings

__all__ = ["Link", "LinkDown", "render_metrics", "serve"]

log = logging.getLogger("msgq_trio.plugins.link")

#: The upstream ack deadline of the link's deliveries, in put timeouts: the link answers
#: every delivery within one put timeout (ack or nack), so the upstream queue's own
#: redelivery only has to catch a stopped link process.
ACK_TIMEOUT_FACTOR = 3
#: A session that forwarded something resets the reconnect backoff.
COUNTERS = (
    "forwarded",
    "stored_downstream",
    "consumed_downstream",
    "duplicates_downstream",
    "retries",
    "sessions",
    "failures",
    "given_back",
    "out_of_order",
)


class LinkDown(Exception):
    """The downstream side of a link failed; the message says how."""


def _increasing_runs(ms: list[QueueMessage]) -> list[list[QueueMessage]]:
    """Split one producer's messages into runs of strictly increasing seqs (one
    ``put_many`` each). Normally there is one run; a redelivery of a message the link
    sent earlier on this connection starts a new run (the downstream queue answers it
    ``duplicate``)."""
    runs: list[list[QueueMessage]] = [[]]
    last = 0
    for m in ms:
        seq = m.producer_seq or 0
        if seq <= last and runs[-1]:
            runs.append([])
        runs[-1].append(m)
        last = seq
    return runs


class Link:
    """One configured link (see the module docstring for its rules).

    Args:
        name: the link's name (``[plugins.link.links.<name>]``).
        cfg: its settings.
        socket: this broker's socket (upstream).
    """

    def __init__(self, name: str, cfg: LinkConfig, socket: Path) -> None:
        self.name = name
        self.cfg = cfg
        self.socket = socket
        self.source = cfg.source or f"{socketlib.gethostname()}:{socket}:{cfg.from_queue}"
        self.state = "connecting"
        self.since = time.time()
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.last_error = ""
        self.last_error_at: float | None = None
        self.grace_here: float | None = None
        self.grace_there: float | None = None
        #: delivery id -> message received from upstream, not yet acked downstream
        self.held: dict[int, QueueMessage] = {}
        self._fail: LinkDown | None = None
        self._grace_warned: tuple[float | None, float | None] = (None, None)
        self._scope: trio.CancelScope | None = None

    # -- status ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The link's state for ``status`` / ``msgq-trio ctl links``."""
        return {
            "link": self.name,
            "state": self.state,
            "since": self.since,
            "address": self.cfg.address,
            "from_queue": self.cfg.from_queue,
            "to_queue": self.cfg.target_queue,
            "source": self.source,
            "in_flight": len(self.held),
            **self.counters,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "ack_grace_here": self.grace_here,
            "ack_grace_there": self.grace_there,
        }

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.since = time.time()

    # -- running --------------------------------------------------------------------------
    async def run(self, on_local_lost: Callable[[str], None]) -> None:
        """Connect upstream, then run sessions downstream forever, reconnecting with a
        doubling backoff. Returns when the upstream connection ended (after calling
        ``on_local_lost(why)``)."""
        cfg = self.cfg
        try:
            async with connect(self.socket, f"msgq-link.{self.name}") as local:
                delay = cfg.retry_min
                while True:
                    before = self.counters["forwarded"]
                    try:
                        await self._session(local)
                    except LinkDown as exc:
                        self._down(str(exc))
                    if self.counters["forwarded"] > before:
                        delay = cfg.retry_min
                    await trio.sleep(delay)
                    delay = min(delay * 2, cfg.retry_max)
        except* ConnectionLost as group:
            # except*: the upstream consumer may raise it inside a session's nursery,
            # which wraps it in an ExceptionGroup (a traceback at SIGTERM otherwise).
            first = group.exceptions[0]
            on_local_lost(f"link {self.name}: the connection to this broker ended: {first}")

    def _down(self, why: str) -> None:
        self.counters["failures"] += 1
        self.last_error = why
        self.last_error_at = time.time()
        self._set_state("down")
        log.warning("link %s to %s: %s (retrying)", self.name, self.cfg.address, why)

    def _credentials(self) -> dict[str, Any]:
        """connect() keyword arguments for the token and TLS settings (only those set, so
        a client without TCP support still serves Unix-socket links)."""
        cfg = self.cfg
        kw: dict[str, Any] = {}
        if cfg.token:
            kw["token"] = cfg.token
        elif cfg.token_file:
            try:
                kw["token"] = Path(cfg.token_file).read_text().strip()
            except OSError as exc:
                raise LinkDown(f"cannot read token_file {cfg.token_file}: {exc}") from None
        if cfg.tls:
            try:
                ctx = ssl.create_default_context(cafile=cfg.tls_ca or None)
                if cfg.tls_cert:
                    ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
            except (OSError, ssl.SSLError) as exc:
                raise LinkDown(f"TLS settings: {exc}") from None
            kw["ssl_context"] = ctx
        return kw

    async def _connect(self, stack: contextlib.AsyncExitStack, scope: trio.CancelScope) -> Bus:
        """Connect downstream within ``connect_timeout``. ``scope`` encloses the whole
        session (the connection's nursery lives in it, so the deadline cannot be a scope
        of its own around the connect): it gets the deadline, lifted once connected."""
        cfg = self.cfg
        try:
            cm = connect(cfg.address, f"msgq-link.{self.name}", **self._credentials())
        except TypeError as exc:
            raise LinkDown(f"this client cannot use the token/TLS settings: {exc}") from None
        scope.deadline = trio.current_time() + cfg.connect_timeout
        try:
            bus: Bus = await stack.enter_async_context(cm)
        except (ConnectError, ConnectionLost, OSError) as exc:
            raise LinkDown(f"cannot connect: {exc}") from None
        scope.deadline = math.inf
        return bus

    async def _session(self, local: Bus) -> None:
        """One downstream connection: connect, check, forward until it fails.

        Raises:
            LinkDown: always, in the end (what failed); everything the link held was
                nacked upstream before.
            ConnectionLost: the upstream connection ended.
        """
        self._fail = None
        self._set_state("connecting")
        with trio.CancelScope() as scope:
            await self._session_in(local, scope)
        if scope.cancelled_caught:
            raise LinkDown(f"no handshake within {self.cfg.connect_timeout} s")
        raise LinkDown(str(self._fail) if self._fail else "session ended")

    async def _session_in(self, local: Bus, scope: trio.CancelScope) -> None:
        cfg = self.cfg
        async with contextlib.AsyncExitStack() as stack:
            remote = await self._connect(stack, scope)
            there = remote.queue(cfg.target_queue)
            try:
                with trio.fail_after(cfg.put_timeout):
                    await there.declare()
                    self.grace_there = float((await there.stats()).get("ack_grace", 0.0))
            except trio.TooSlowError:
                raise LinkDown(
                    f"queue {cfg.target_queue!r} there did not answer within {cfg.put_timeout} s"
                ) from None
            except (ConnectionLost, RpcError) as exc:
                raise LinkDown(f"queue {cfg.target_queue!r} there: {exc}") from None
            here = local.queue(cfg.from_queue)
            try:
                self.grace_here = float((await here.stats()).get("ack_grace", 0.0))
            except RpcError as exc:
                raise LinkDown(f"queue {cfg.from_queue!r} here: {exc}") from None
            self._check_grace()
            consumer = here.consume(
                cfg.window, ids=True, ack_timeout=ACK_TIMEOUT_FACTOR * cfg.put_timeout
            )
            async with consumer:
                self.counters["sessions"] += 1
                self._set_state("up")
                log.info(
                    "link %s: up, %s -> %s at %s",
                    self.name,
                    cfg.from_queue,
                    cfg.target_queue,
                    cfg.address,
                )
                try:
                    async with trio.open_nursery() as n:
                        self._scope = n.cancel_scope
                        n.start_soon(self._watch, remote)
                        await self._pump(consumer, there, n)
                finally:
                    await self._give_back()

    def _check_grace(self) -> None:
        here, there = self.grace_here, self.grace_there
        if (here, there) == self._grace_warned:
            return  # once per combination, not at every reconnect
        self._grace_warned = (here, there)
        if here is not None and there is not None and here <= there:
            log.warning(
                "link %s: ack_grace of queue %s here (%.3f s) is not above that of %s "
                "there (%.3f s): a message a slow consumer there holds is written at both "
                "brokers; set ack_grace of %s here above %.3f s plus a round trip",
                self.name,
                self.cfg.from_queue,
                here,
                self.cfg.target_queue,
                there,
                self.cfg.from_queue,
                there,
            )

    def _failed(self, why: str) -> None:
        if self._fail is None:
            self._fail = LinkDown(why)
        if self._scope is not None:
            self._scope.cancel()

    async def _give_back(self) -> None:
        """Nack everything held (rule 4); the upstream queue redelivers it in order."""
        held, self.held = list(self.held.values()), {}
        self.counters["given_back"] += len(held)
        with trio.CancelScope(shield=True):
            for m in held:
                await m.nack()

    async def _watch(self, remote: Bus) -> None:
        """Notice a lost downstream connection while nothing is being sent."""
        try:
            async for _msg in remote:
                pass  # the downstream broker sends the link nothing but answers
            self._failed("the downstream broker closed the connection")
        except ConnectionLost as exc:
            self._failed(f"connection lost: {exc}")

    async def _pump(self, consumer: Consumer, there: Queue, nursery: trio.Nursery) -> None:
        # Puts are pipelined. Each names the seq of the producer's previous message sent
        # in this session (``after``): if that put failed downstream, this one is refused
        # too instead of raising the producer's mark past messages that never arrived
        # (their resend would be dropped as duplicates). The first put of a session is
        # unconditional: what came before it was acked by the downstream queue.
        last_sent: dict[str | None, int] = {}
        async for first in consumer:
            batch = [first, *consumer.take_ready(self.cfg.window)]
            by_producer: dict[str | None, list[QueueMessage]] = {}
            top = dict(last_sent)
            for m in batch:
                if m.deliveries > 1:
                    self.counters["retries"] += 1
                seq = m.producer_seq or 0
                if seq <= top.get(m.producer, 0) and m.id not in self.held:
                    # An older message of this producer after a newer one went down in
                    # this session, and not a resend of one we hold: the downstream
                    # queue would take it for a duplicate without having it. Start a new
                    # session: everything held goes back, and the upstream queue
                    # redelivers in queue order.
                    self.held[m.id] = m
                    self.counters["out_of_order"] += 1
                    self._failed(
                        f"producer {m.producer!r}: seq {seq} came after "
                        f"{top[m.producer]} (out of order upstream)"
                    )
                    return
                top[m.producer] = max(seq, top.get(m.producer, 0))
                self.held[m.id] = m
                by_producer.setdefault(m.producer, []).append(m)
            for producer, ms in by_producer.items():
                for run in _increasing_runs(ms):
                    try:
                        wait = there.start_put_encoded(
                            [m.raw for m in run],
                            [m.producer_seq or 0 for m in run],
                            producer=f"{self.source}/{producer}",
                            timeout=self.cfg.put_timeout,
                            after=last_sent.get(producer),
                            # each message's trace goes on downstream (docs/PROTOCOL.md)
                            traces=[_trace(m) for m in run],
                        )
                    except (ConnectionLost, MsgqError) as exc:
                        self._failed(f"cannot send: {exc}")
                        return
                    last_sent[producer] = max(last_sent.get(producer, 0), run[-1].producer_seq or 0)
                    nursery.start_soon(self._finish_put, wait, run)

    async def _finish_put(
        self, wait: Callable[[], Awaitable[dict[str, int]]], run: list[QueueMessage]
    ) -> None:
        try:
            res = await wait()
        except RequestTimeout:
            self._failed(f"no answer to a put within {self.cfg.put_timeout} s")
            return
        except ConnectionLost as exc:
            self._failed(f"connection lost: {exc}")
            return
        except RpcError as exc:
            self._failed(f"put refused: {exc.code}: {exc}")
            return
        c = self.counters
        c["forwarded"] += len(run)
        c["stored_downstream"] += int(res.get("stored", 0))
        c["consumed_downstream"] += int(res.get("consumed", 0))
        c["duplicates_downstream"] += int(res.get("duplicates", 0))
        for m in run:
            if self.held.pop(m.id, None) is not None:
                await m.ack()


#: help text of the counter families, by ``Link.counters`` key (``msgq_link_<key>_total``).
COUNTER_HELP = {
    "forwarded": "messages acked downstream (stored, consumed or duplicate there)",
    "stored_downstream": "forwarded messages the downstream queue stored",
    "consumed_downstream": "forwarded messages a downstream consumer acked before storing",
    "duplicates_downstream": "forwarded messages the downstream queue already had",
    "retries": "deliveries from the upstream queue that were redeliveries",
    "sessions": "downstream sessions that came up",
    "failures": "sessions that failed or could not be set up",
    "given_back": "messages nacked to the upstream queue at failures",
    "out_of_order": "sessions restarted for an older message after a newer one",
}
assert set(COUNTER_HELP) == set(COUNTERS)


def _trace(m: QueueMessage) -> str | None:
    tp = m.trace_header.get("traceparent")
    return tp if isinstance(tp, str) else None


def render_metrics(links: list[Link], now: float | None = None) -> str:
    """The links' state as Prometheus text (format 0.0.4), one sample per link per family
    (label ``link``; ``msgq_link_up`` also carries ``from_queue``, ``to_queue`` and
    ``address`` to join on). Counters are since the plugin process started."""
    now = time.time() if now is None else now
    ex = Exposition()
    ex.family(
        "msgq_link_up",
        "gauge",
        "1 while the link's downstream session is up, else 0",
        [
            (
                {
                    "link": ln.name,
                    "from_queue": ln.cfg.from_queue,
                    "to_queue": ln.cfg.target_queue,
                    "address": ln.cfg.address,
                },
                int(ln.state == "up"),
            )
            for ln in links
        ],
    )
    ex.family(
        "msgq_link_state_seconds",
        "gauge",
        "seconds the link has been in its current state (up, connecting, down)",
        [({"link": ln.name}, max(0.0, now - ln.since)) for ln in links],
    )
    ex.family(
        "msgq_link_in_flight",
        "gauge",
        "messages the link holds: received from upstream, not yet acked downstream",
        [({"link": ln.name}, len(ln.held)) for ln in links],
    )
    for key, help_text in COUNTER_HELP.items():
        ex.family(
            f"msgq_link_{key}",
            "counter",
            help_text,
            [({"link": ln.name}, ln.counters[key]) for ln in links],
        )
    return ex.text()


async def serve(
    socket: Path,
    settings: LinkSettings,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run every configured link and answer ``status`` on ``settings.group`` until the
    connection to this broker ends; with ``settings.metrics``, serve ``/metrics`` too.

    Resource handling: every connection (one for status, one upstream and one
    downstream per link) and the metrics listeners are closed on return; messages a link
    held are nacked upstream (or redelivered by the upstream queue when the process dies).

    Raises:
        OSError: the ``metrics`` address cannot be bound (before ready, so the broker's
            start fails; the message names the key).
    """
    links = [Link(name, cfg, socket) for name, cfg in settings.links.items()]
    listeners, shown = await open_plugin_listeners("link", settings.metrics)

    async def status(_params: Any, _request: Any) -> list[dict[str, Any]]:
        return [{**link.status(), "metrics": shown} for link in links]

    try:
        async with connect(socket, "msgq-link") as bus, trio.open_nursery() as n:
            bus.add_command("status", status)
            await bus.subscribe(settings.group)
            if listeners:
                n.start_soon(MetricsServer(listeners, lambda: render_metrics(links)).serve)
                log.info("link plugin: metrics on http://%s/metrics", shown)

            def local_lost(why: str) -> None:
                log.info("%s", why)
                n.cancel_scope.cancel()

            for link in links:
                n.start_soon(link.run, local_lost)
            task_status.started()
            try:
                async for _msg in bus:
                    pass
            except ConnectionLost as exc:
                log.info("link plugin: the connection to this broker ended: %s", exc)
            n.cancel_scope.cancel()
    finally:
        for listener in listeners:  # closed already if the server ran
            await trio.aclose_forcefully(listener)
