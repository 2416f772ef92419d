"""The queue plugin's bus side: the queue commands, deliveries, bound groups, membership.

Two connections to the broker:

* ``msgq-queue`` (the API connection): member of ``settings.group``; answers the queue
  commands (docs/QUEUE.md, "Commands"), pushes deliveries to API consumers
  (``queue.deliver`` requests) and watches ``msgq.membership`` for consumers that leave.
* ``msgq-queue-binder``: holds the bindings of bound queues, so every request it gets
  is traffic to a bound group (whatever its command), every one-way message it gets too;
  and, being the binder, its own calls to the group's members are not redirected.

Error handling: a malformed command is answered ``bad-request`` naming the caller; an
unknown queue ``bad-request`` ("declare it first"); a full store ``queue-full``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import cbor2
import trio

from msgq_trio.client.bus import Bus, Message
from msgq_trio.client.tracing import continued, format_traceparent, recording
from msgq_trio.errors import (
    CommandFailed,
    ConnectionLost,
    MalformedMessage,
    RpcError,
    UsageError,
)
from msgq_trio.protocol.codes import ErrorCode

from . import admin
from .model import (
    KIND_BODY,
    KIND_REQUEST,
    KIND_TRACED,
    Consumer,
    Msg,
    Queue,
    Waiter,
    body_of,
    body_prefix,
    trace_of,
)
from .settings import parse_options
from .tasks import Engine

if TYPE_CHECKING:
    from .metrics import AgeTracker

log = logging.getLogger("msgq_trio.plugins.queue")

BAD = str(ErrorCode.BAD_REQUEST)
#: The command an API consumer receives for each delivery (answer = ack, error = nack).
DELIVER = "queue.deliver"
#: Most messages one ``fetch`` returns (bounds the answer frame: 1,000 x a 64 KiB body
#: is 64 MiB, the default max_frame_size).
MAX_FETCH = 1000


class BadRequest(ValueError):
    pass


def _str(params: Any, key: str) -> str:
    v = params.get(key) if isinstance(params, dict) else None
    if not isinstance(v, str) or not v:
        raise BadRequest(f"params need {key!r}: a non-empty string")
    return v


def _int(params: Any, key: str, default: int | None = None, lo: int = 0) -> int:
    v = params.get(key, default) if isinstance(params, dict) else default
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise BadRequest(f"params need {key!r}: an integer >= {lo}")
    return v


def _num(params: Any, key: str, default: float) -> float:
    v = params.get(key, default) if isinstance(params, dict) else default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise BadRequest(f"{key!r} must be a positive number")
    return float(v)


def _base(target: str) -> str:
    i = target.find("[")
    return target if i < 0 else target[:i]


class _Caller:
    """A caller of a bound group waiting for the member's answer to its stored request."""

    __slots__ = ("answer", "answered", "event", "inflight")

    def __init__(self) -> None:
        self.event = trio.Event()
        #: a member has the request now (set by the forwarder, cleared by a nack)
        self.inflight = False
        self.answered = False
        self.answer: Any = None


def _answer_within(request: Message, bus: Bus) -> float:
    """Seconds after its arrival by which a bound group's caller must have its answer:
    the request's deadline (its ``timeout``, else the broker's ``request_timeout``)
    less a tenth of it, at least half a second, so ``{"queued"}`` reaches the caller
    before the broker answers it ``timeout``."""
    limits = [
        float(t)
        for t in (request.header.get("timeout"), bus.limits.get("request_timeout"))
        if isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0
    ]
    total = min(limits, default=30.0)
    return max(0.0, total - max(0.5, total / 10))


class Service:
    """Wires the engine to the two bus connections. Call :meth:`setup`, then run
    :meth:`serve` until the bus is lost."""

    def __init__(
        self,
        engine: Engine,
        bus: Bus,
        binder: Bus,
        nursery: trio.Nursery,
        ages: AgeTracker | None = None,
    ) -> None:
        self.engine = engine
        #: the oldest-message tracker `stats` reads its ``oldest_age`` from (None: omitted)
        self.ages = ages
        self.bus = bus
        self.binder = binder
        self.nursery = nursery
        self.bound: dict[str, Queue] = {}
        self.boot = f"bound.{uuid.uuid4().hex[:16]}"
        #: this plugin process: consumers compare it with the ``started`` notifications
        #: on ``<group>.events`` to see a restart (their deliveries then came from a
        #: process that is gone, and they consume again)
        self.instance = uuid.uuid4().hex
        self._bound_seq = 0
        #: Callers of bound groups whose request is stored and not yet answered, by
        #: its seq as producer :attr:`boot` (see :meth:`_bound_request`).
        self._callers: dict[int, _Caller] = {}
        engine.deliver = self._deliver
        engine.nursery = nursery
        # One-way messages to bound groups waiting to be forwarded; bounded by the
        # members' credit (each holds a window slot until forwarded), so never full.
        self._forward, self._forward_recv = trio.open_memory_channel[tuple[Queue, Consumer, Msg]](
            1 << 20
        )

    async def setup(self) -> None:
        """Register commands, subscribe, bind the bound queues' groups."""
        bus = self.bus
        for name, fn in (
            ("put", self._put),
            ("put_many", self._put_many),
            ("send", self._send),
            ("ack", self._ack),
            ("nack", self._nack),
            ("fetch", self._fetch),
        ):
            bus.add_inline_command(name, fn)
        for name, afn in (
            ("declare", self._declare),
            ("consume", self._consume),
            ("cancel", self._cancel),
            ("stats", self._stats),
            ("producer_state", self._producer_state),
            ("queues", self._queues),
        ):
            bus.add_command(name, afn)
        for name, handler in admin.commands(self.engine):  # peek, purge (admin.py)
            bus.add_command(name, handler)
        # Both in the binder's reader, in arrival order: a producer's one-way messages
        # and requests are stored (and so delivered) in the order it sent them.
        self.binder.set_default_handler(self._bound_request)
        self.binder.on_message_inline(self._bound_message)
        # A consumer's acks (one-way messages) in the reader too, in arrival order with
        # the requests it answers: a request sent after acks (``stats``, ``cancel``)
        # finds them applied. Taken by iteration, they waited behind such requests.
        bus.on_message_inline(self._acks)
        await bus.subscribe("msgq.membership")
        for q in list(self.engine.queues.values()):
            if q.opts.bind:
                await self.bind(q)
        await bus.subscribe(self.engine.settings.group)
        # Consumers of a previous plugin process wait for this to consume again.
        await bus.notify(
            f"{self.engine.settings.group}.events", "started", {"instance": self.instance}
        )

    async def bind(self, q: Queue) -> None:
        group = q.opts.bind
        if self.bound.get(group) is q:
            return
        await self.binder.call("msgq", "bind", {"group": group})
        self.bound[group] = q
        mine = {self.bus.lname, self.binder.lname}
        for member in await self.binder.members(group):
            if member.lname not in mine:
                self.engine.add_consumer(
                    q, Consumer(member.lname, "member", q.opts.window, q.opts.ack_timeout)
                )
        log.info("queue %s bound to group %s", q.name, group)

    async def serve(self) -> None:
        """Handle membership notifications until either connection ends (then return:
        the plugin process exits). One-way messages are taken in the readers (``setup``)."""
        async with trio.open_nursery() as n:

            async def membership() -> None:
                try:
                    async for msg in self.bus:
                        if msg.kind == "notification":
                            self._membership(msg)
                except ConnectionLost as exc:
                    log.info("queue plugin: connection ended: %s", exc)
                n.cancel_scope.cancel()

            async def bound_messages() -> None:
                try:
                    async for msg in self.binder:
                        if msg.kind == "message":
                            self._bound_message(msg)
                except ConnectionLost as exc:
                    log.info("queue plugin: binder connection ended: %s", exc)
                n.cancel_scope.cancel()

            n.start_soon(membership)
            n.start_soon(bound_messages)

    # -- helpers --------------------------------------------------------------------------
    def _queue(self, params: Any) -> Queue:
        name = _str(params, "queue")
        q = self.engine.queues.get(name)
        if q is None:
            raise BadRequest(f"unknown queue {name!r}: declare it first")
        return q

    def _inline(self, request: Message, fn: Any) -> None:
        try:
            fn(request.body)
        except BadRequest as exc:
            self.bus.answer_error(
                request, BAD, f"{request.sender} ({request.sender_name}): {request.command}: {exc}"
            )

    # -- producing ------------------------------------------------------------------------
    def _put(self, request: Message) -> None:
        def run(params: Any) -> None:
            q = self._queue(params)
            body = params.get("body")
            if not isinstance(body, bytes):
                raise BadRequest("params need 'body': CBOR-encoded bytes")
            producer = _str(params, "producer")
            seq = _int(params, "seq", lo=1)

            kind = body_prefix(request.header.get("traceparent")) if request.traced else b"B"
            self.engine.put(q, producer, [(seq, kind + body)], self._ack1(request))

        self._inline(request, run)

    def _send(self, request: Message) -> None:
        """``send {"queue", "producer", "seq", "body": CBOR bytes, "anycast"?: bool}``
        with the request's attachments: a one-way message to the group ``queue`` is
        bound to, stored and forwarded exactly like one sent to the group (``G[?]`` with
        ``anycast``), but answered at ack 1 (``"stored"``, ``"consumed"``,
        ``"duplicate"``) and deduplicated by producer and seq, across plugin restarts.
        Refused ``bad-request`` (nothing stored) for a queue without ``bind``, a body
        that is not one CBOR item, or file descriptors (closed)."""

        def run(params: Any) -> None:
            q = self._queue(params)
            if not q.opts.bind:
                raise BadRequest(
                    f"queue {q.name!r} is not bound to a group (option 'bind'): use put"
                )
            body = params.get("body")
            if not isinstance(body, bytes):
                raise BadRequest("params need 'body': CBOR-encoded bytes")
            producer = _str(params, "producer")
            seq = _int(params, "seq", lo=1)
            if request.fds:
                request.close()
                raise BadRequest("file descriptors cannot be stored")
            try:
                data = encode_bound_raw(
                    b"M",
                    body,
                    request.attachments,
                    params.get("anycast") is True,
                    (request.sender, request.sender_name),
                )
            except ValueError as exc:
                raise BadRequest(str(exc)) from None

            self.engine.put(q, producer, [(seq, data)], self._ack1(request))

        self._inline(request, run)

    def _ack1(self, request: Message) -> Waiter:
        """The waiter of one message put by ``request`` (``put``, ``send``): answers it
        ``"stored"``, ``"consumed"`` or ``"duplicate"`` at ack 1, or with the error."""

        def done(w: Waiter) -> None:
            if w.error:
                self.bus.answer_error(request, w.error[0], w.error[1])
            else:
                self.bus.answer(
                    request, "stored" if w.stored else "consumed" if w.consumed else "duplicate"
                )

        return Waiter(1, done)

    def _put_many(self, request: Message) -> None:
        def run(params: Any) -> None:
            q = self._queue(params)
            producer = _str(params, "producer")
            bodies = params.get("bodies")
            if not isinstance(bodies, list) or not set(map(type, bodies)) <= {bytes}:
                raise BadRequest("params need 'bodies': a list of CBOR-encoded bytes")
            seqs = params.get("seqs")
            if seqs is None:
                first = _int(params, "first_seq", lo=1)
                seqs = range(first, first + len(bodies))
            elif not (
                isinstance(seqs, list)
                and len(seqs) == len(bodies)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in seqs)
                and all(a < b for a, b in zip([0, *seqs], seqs, strict=False))
            ):
                # Explicit seqs (a link forwards its messages' original ones): strictly
                # increasing, since a seq at or below an accepted one is a resend.
                raise BadRequest(
                    "'seqs' must be strictly increasing positive integers, one per body"
                )
            after = params.get("after")
            if after is not None and (
                not isinstance(after, int) or isinstance(after, bool) or after < 1
            ):
                raise BadRequest("'after' must be a positive integer (a producer seq)")
            if not bodies:
                self.bus.answer(request, {"stored": 0, "consumed": 0, "duplicates": 0})
                return

            def done(w: Waiter) -> None:
                if w.error:
                    self.bus.answer_error(request, w.error[0], w.error[1])
                else:
                    self.bus.answer(
                        request,
                        {"stored": w.stored, "consumed": w.consumed, "duplicates": w.duplicates},
                    )

            kind = body_prefix(request.header.get("traceparent")) if request.traced else b"B"
            traces = params.get("traces")
            if isinstance(traces, list) and len(traces) == len(bodies):
                # Each message's own trace (a link forwards them): kept where valid.
                kinds = [body_prefix(t) if t is not None else kind for t in traces]
                items = [(seq, k + b) for seq, k, b in zip(seqs, kinds, bodies, strict=True)]
            else:
                items = [(seq, kind + b) for seq, b in zip(seqs, bodies, strict=True)]
            self.engine.put(q, producer, items, Waiter(len(items), done), after)

        self._inline(request, run)

    # -- consuming ------------------------------------------------------------------------
    def _deliver(self, q: Queue, c: Consumer, msgs: list[Msg]) -> None:
        """Send deliveries now (so they leave in queue order).

        A push consumer gets one ``queue.deliver`` request per batch; its answer only
        says "received" (acks come by id, as one-way ``ack`` messages), an error answer
        (not consuming, gone) gives the batch back. A bound-group member gets each
        message as the original request; its answer is the ack, an error the nack."""
        try:
            if c.kind == "push":
                # Columns, not a row per message: a list per message costs the plugin
                # (the process every message passes) twice the encoding time.
                params: dict[str, Any] = {
                    "queue": q.name,
                    "ids": [m.mid for m in msgs],
                    "bodies": [m.data[1:] for m in msgs],
                    "deliveries": [m.deliveries for m in msgs],
                }
                if c.ids:
                    params["producers"] = [m.producer for m in msgs]
                    params["seqs"] = [m.pseq for m in msgs]
                if any(m.data[0] == KIND_TRACED for m in msgs):
                    wait = self._deliver_traced(c, msgs, params)
                else:
                    wait = self.bus.start_call(c.lname, DELIVER, params)
                self.nursery.start_soon(self._batch_delivery, q, c, msgs, wait)
                return
            # A bound group's member: requests and one-way messages alike go out
            # through the forwarder, in message id order, so a producer's messages and
            # requests reach each member in the order they were sent.
            fwd = self._forward
            for m in msgs:
                if m.data[0] == KIND_REQUEST:
                    slot = self._caller(m)
                    if slot is not None:
                        # A member has it from now on: its caller waits for the answer
                        # even if the commit comes first (which the forwarder may let
                        # happen before it runs).
                        slot.inflight = True
                fwd.send_nowait((q, c, m))
        except ConnectionLost:
            return  # the plugin is going away; the messages stay stored

    def _deliver_traced(
        self, c: Consumer, msgs: list[Msg], params: dict[str, Any]
    ) -> Callable[[], Awaitable[Any]]:
        """Start a delivery of which some messages were put by traced requests: their
        bodies without the traceparent, the traceparents as a column ``traces`` (None
        for an untraced message), and the delivery request itself in the trace of the
        first traced message, as a hop caused by its put (core/traces.py)."""
        params["bodies"] = [body_of(m.data) for m in msgs]
        traces = [trace_of(m.data) for m in msgs]
        params["traces"] = traces
        first = next(t for t in traces if t)
        with continued({"traceparent": first}, f"deliver {params['queue']}", "producer") as tc:
            if tc is not None and recording():
                # The delivery is a recorded span here (the broker emits spans,
                # plugins/otel.py): the messages of the put that caused it are
                # delivered under it, so the consumer's spans follow the broker's hop
                # of the delivery. Without spans here its id names no span: each
                # message keeps its put's.
                mine = format_traceparent(tc.trace_id, tc.span_id, tc.flags)
                params["traces"] = [mine if t == first else t for t in traces]
            return self.bus.start_call(c.lname, DELIVER, params)

    async def _batch_delivery(
        self, q: Queue, c: Consumer, msgs: list[Msg], wait: Callable[[], Awaitable[Any]]
    ) -> None:
        try:
            await wait()
        except ConnectionLost:
            return
        except RpcError as exc:
            log.info(
                "queue %s: delivery of %d messages to %s refused (%s: %s): redelivering",
                q.name,
                len(msgs),
                c.lname,
                exc.code,
                exc,
            )
            if q.consumers.get(c.lname) is c:
                del q.consumers[c.lname]
            self.engine.nack_many([m for m in msgs if m.owner is c])

    async def forwarder(self) -> None:
        """Send what bound queues deliver to their groups' members, in queue order:
        a request to the one member it was dispatched to (its answer is the ack, an
        error the nack: :meth:`_delivery`); a one-way message (``send`` to the group, a
        queue client's ``send``, or a ``put`` into the bound queue, from a link for
        example) to the whole group, or to one member if sent to ``G[?]``, acked once
        handed to the broker. Stored traffic goes out on behalf of its producer
        (``on_behalf_of``): members see the producer as the sender, the binder as
        ``via``.

        A dispatch hands messages over as one batch per member, so with two members
        they come interleaved (0, 2, 4, then 1, 3, 5); but a one-way message goes to
        the whole group, whose members must see a producer's messages in the order
        sent. So everything handed over at once (a dispatch runs without a checkpoint)
        is sent in message id order, which is arrival order; a later dispatch hands
        over later messages."""
        recv = self._forward_recv
        binder = self.binder
        async for first in recv:
            batch = [first]
            with contextlib.suppress(trio.WouldBlock):
                while True:
                    batch.append(recv.receive_nowait())
            batch.sort(key=lambda item: item[2].mid)
            for q, c, m in batch:
                if m.owner is not c:
                    # Given back meanwhile (the member left): redelivered elsewhere, or
                    # waiting for a member, in which case its caller need not wait.
                    slot = self._caller(m)
                    if slot is not None and m.owner is None:
                        slot.inflight = False
                        slot.event.set()
                    continue
                try:
                    stored = decode_bound(m.data)
                except ValueError as exc:
                    self._unforwardable(q, m, exc)
                    continue
                try:
                    if stored.kind == KIND_REQUEST:
                        cmd, params = stored.value
                        wait = binder.start_call(
                            c.lname,
                            cmd,
                            params,
                            timeout=c.ack_timeout,
                            attachments=stored.attachments,
                            on_behalf_of=stored.origin,
                        )
                        self.nursery.start_soon(self._delivery, q, c, m, wait)
                        continue
                    target = f"{q.opts.bind}[?]" if stored.anycast else q.opts.bind
                    await binder.send(
                        target, stored.value, stored.attachments, on_behalf_of=stored.origin
                    )
                except ConnectionLost:
                    return
                except UsageError as exc:  # e.g. a stored command name the bus refuses
                    self._unforwardable(q, m, exc)
                    continue
                self.engine.ack(m)

    def _unforwardable(self, q: Queue, m: Msg, exc: Exception) -> None:
        """A stored message that cannot reach the group (its stored value cannot be
        decoded or sent): logged with its producer and seq, then acked (dropped), so it
        cannot block the queue."""
        log.warning(
            "queue %s: message %d (producer %s seq %d) cannot be forwarded to %s and is "
            "dropped: %s",
            q.name,
            m.mid,
            m.producer,
            m.pseq,
            q.opts.bind,
            exc,
        )
        self.engine.ack(m)

    async def _delivery(
        self, q: Queue, c: Consumer, m: Msg, wait: Callable[[], Awaitable[Any]]
    ) -> None:
        try:
            answer = await wait()
        except ConnectionLost:
            return  # the plugin is going away; the message stays stored
        except RpcError as exc:
            log.info(
                "queue %s: delivery of message %d to %s failed (%s): redelivering",
                q.name,
                m.mid,
                c.lname,
                exc.code,
            )
            if (
                exc.code in (ErrorCode.RECIPIENT_GONE, ErrorCode.NO_RECIPIENT)
                and q.consumers.get(c.lname) is c
            ):
                del q.consumers[c.lname]
            slot = self._caller(m)
            if slot is not None:  # its caller is told {"queued"}: it stays stored
                slot.inflight = False
                slot.event.set()
            self.engine.nack(m)
            return
        slot = self._caller(m)
        if slot is not None:
            slot.answer, slot.answered = answer, True
            slot.event.set()
        self.engine.ack(m, answer)

    async def _consume(self, params: Any, request: Message) -> dict[str, str]:
        q = self._check(params)
        window = _int(params, "window", 1, lo=1)
        timeout = _num(params, "ack_timeout", q.opts.ack_timeout)
        ids = params.get("ids", False) is True
        self.engine.add_consumer(q, Consumer(request.sender, "push", window, timeout, ids))
        log.info(
            "queue %s: consumer %s (%s) window %d",
            q.name,
            request.sender,
            request.sender_name,
            window,
        )
        return {"instance": self.instance}

    async def _cancel(self, params: Any, request: Message) -> bool:
        q = self._check(params)
        return q.consumers.pop(request.sender, None) is not None

    def _check(self, params: Any) -> Queue:
        try:
            return self._queue(params)
        except BadRequest as exc:
            raise CommandFailed(BAD, str(exc)) from None

    def _fetch(self, request: Message) -> None:
        def run(params: Any) -> None:
            q = self._queue(params)
            n = min(_int(params, "n", 1, lo=1), MAX_FETCH)
            c = q.fetchers.get(request.sender)
            if c is None:
                timeout = _num(params, "ack_timeout", q.opts.ack_timeout)
                c = Consumer(request.sender, "fetch", 1 << 62, timeout)
                self.engine.add_consumer(q, c)
            got = self.engine.fetch(q, c, n, trio.current_time())
            if not got and q.spilled:
                # Nothing in memory but stored messages on disk: answer after a page-in.
                self.nursery.start_soon(self._fetch_paged, request, q, c, n)
                return
            self.bus.answer(request, _fetched(got))

        self._inline(request, run)

    async def _fetch_paged(self, request: Message, q: Queue, c: Consumer, n: int) -> None:
        await self.engine.refill(q)
        got = self.engine.fetch(q, c, n, trio.current_time())
        try:
            self.bus.answer(request, _fetched(got))
        except ConnectionLost:
            self.engine.nack_many(got)

    def _ack_ids(self, request: Message, ack: bool) -> None:
        def run(params: Any) -> None:
            q = self._queue(params)
            ids = params.get("ids")
            if not isinstance(ids, list):
                raise BadRequest("params need 'ids': a list of message ids")
            n = 0
            n = self._settle(q, request.sender, ids, ack)
            self.bus.answer(request, n)

        self._inline(request, run)

    def _settle(self, q: Queue, lname: str, ids: list[Any], ack: bool) -> int:
        """Ack or nack the messages ``ids`` of ``q`` that ``lname`` holds; returns how
        many it held (others were redelivered meanwhile, or are not its own)."""
        if ack:
            return self.engine.ack_ids(q, lname, ids)
        by_id = q.by_id
        held = []
        for mid in ids:
            m = by_id.get(mid) if type(mid) is int else None
            if m is None or m.owner is None or m.owner.lname != lname:
                continue
            held.append(m)
        if held:
            held = list(dict.fromkeys(held))  # an id given twice counts once
            self.engine.nack_many(held)
        return len(held)

    def _acks(self, msg: Message) -> None:
        """One-way ``{"ack"|"nack": queue, "ids": [...]}`` from a push consumer."""
        body = msg.body
        if not isinstance(body, dict) or not isinstance(body.get("ids"), list):
            log.warning(
                "queue plugin: ignoring a malformed message from %s (%s)",
                msg.sender,
                msg.sender_name,
            )
            return
        ack = "ack" in body
        q = self.engine.queues.get(str(body.get("ack" if ack else "nack")))
        if q is not None:
            self._settle(q, msg.sender, body["ids"], ack)

    def _ack(self, request: Message) -> None:
        self._ack_ids(request, True)

    def _nack(self, request: Message) -> None:
        self._ack_ids(request, False)

    # -- administration ------------------------------------------------------------------
    async def _declare(self, params: Any, request: Message) -> bool:
        name = _str(params, "queue") if isinstance(params, dict) else ""
        if not name:
            raise CommandFailed(BAD, "params need 'queue'")
        opts_table = {k: v for k, v in params.items() if k != "queue"}
        try:
            opts = parse_options(opts_table) if opts_table else None
        except (ValueError, TypeError) as exc:
            raise CommandFailed(BAD, f"declare {name!r}: {exc}") from None
        q = self.engine.queues.get(name)
        if opts is not None and q is not None and opts.bind and q.opts.bind not in ("", opts.bind):
            raise CommandFailed(BAD, f"queue {name!r} is bound to {q.opts.bind!r} already")
        if (
            opts is not None
            and opts.bind
            and opts.bind in self.bound
            and self.bound[opts.bind].name != name
        ):
            raise CommandFailed(
                BAD, f"group {opts.bind!r} is bound to queue {self.bound[opts.bind].name!r} already"
            )
        try:
            created = await self.engine.declare(name, opts if q is None or opts else None)
        except ValueError as exc:
            raise CommandFailed(BAD, f"declare {name!r}: {exc}") from None
        q = self.engine.queues[name]
        if q.opts.bind:
            try:
                await self.bind(q)
            except RpcError as exc:
                raise CommandFailed(
                    exc.code or BAD, f"cannot bind {q.opts.bind!r}: {exc}"
                ) from None
        log.info(
            "queue %s declared by %s (%s)%s",
            name,
            request.sender,
            request.sender_name,
            " (new)" if created else "",
        )
        return created

    async def _stats(self, params: Any, _request: Message) -> dict[str, Any]:
        q = self._check(params)
        stats = self.engine.stats(q)
        if self.ages is not None:
            stats["oldest_age"] = self.ages.oldest_age(q, trio.current_time())
        return stats

    async def _producer_state(self, params: Any, _request: Message) -> int:
        q = self._check(params)
        producer = _str(params, "producer")
        p = self.engine.producers.get((q.name, producer))
        if p is not None and p.hwm is not None:
            return p.hwm
        hwm: int = await self.engine.thread.run(self.engine.store.producer_state, q.name, producer)
        return hwm

    async def _queues(self, _params: Any, _request: Message) -> list[str]:
        return sorted(self.engine.queues)

    # -- bound groups ---------------------------------------------------------------------
    def _bound_put(self, q: Queue, data: bytes, waiter: Waiter) -> int:
        """Store a bound group's traffic as producer :attr:`boot`; returns its seq."""
        self._bound_seq += 1
        self.engine.put(q, self.boot, [(self._bound_seq, data)], waiter)
        return self._bound_seq

    def _caller(self, m: Msg) -> _Caller | None:
        """The caller still waiting for the member's answer to stored request ``m``."""
        return self._callers.get(m.pseq) if m.producer == self.boot else None

    def _bound_request(self, params: Any, request: Message) -> Awaitable[Any]:
        """A request to a bound group: stored at once, in the binder's reader (so in
        arrival order with one-way messages, :meth:`_bound_message`), with its
        attachments; the returned awaitable answers the caller with the member's own
        answer if one answers before the commit, or while the caller still waits (the
        request was in flight to a member when it became durable; until shortly before
        the caller's deadline); otherwise, once it is durable, ``{"queued":
        "<queue>"}``: nobody answered yet, the queue delivers it later and that answer
        is only the queue's ack. A member's error answer is a nack (redelivered), so the
        caller then gets ``{"queued"}`` too. One carrying file descriptors is answered
        ``bad-request`` (a descriptor cannot be stored; the broker already refuses them,
        core ``_binder``), and the client library closes them."""
        started = trio.current_time()
        group = _base(request.target)
        q = self.bound.get(group)
        if q is None:
            raise CommandFailed(str(ErrorCode.NO_RECIPIENT), f"{group!r} is not bound here")
        if request.fds:
            raise CommandFailed(
                BAD,
                f"{request.sender} ({request.sender_name}): queue "
                f"{q.name!r} bound to {group!r} cannot store file "
                "descriptors",
            )
        done = trio.Event()
        waiter = Waiter(1, lambda _w: done.set())
        slot = _Caller()
        data = encode_bound(
            b"R",
            [request.command, params],
            request.attachments,
            origin=(request.sender, request.sender_name),
        )
        seq = self._bound_seq + 1
        self._callers[seq] = slot  # before the put: dispatch may hand it out at once
        if self._bound_put(q, data, waiter) != seq:
            raise AssertionError("bound seqs are taken one at a time")
        deadline = started + _answer_within(request, self.binder)

        async def answer() -> Any:
            try:
                await done.wait()
                if waiter.error:
                    raise CommandFailed(*waiter.error)
                if waiter.consumed:
                    return waiter.answer
                if slot.inflight and not slot.answered:
                    with trio.move_on_at(deadline):
                        await slot.event.wait()
                if slot.answered:
                    return slot.answer
                return {"queued": q.name}
            finally:
                del self._callers[seq]

        return answer()

    def _bound_message(self, msg: Message) -> None:
        """A one-way message to a bound group (``G`` or ``G[?]``): stored with its
        attachments and whether it went to ``G[?]``. One that cannot be stored (file
        descriptors, which the broker already refuses; a malformed body) is dropped with
        a WARNING naming the sender: it cannot be answered."""
        q = self.bound.get(_base(msg.target))
        if q is None:
            return
        try:
            if msg.fds:
                raise ValueError("it carries file descriptors, which cannot be stored")
            data = encode_bound(
                b"M",
                msg.body,
                msg.attachments,
                msg.target.endswith("[?]"),
                (msg.sender, msg.sender_name),
            )
        except (MalformedMessage, ValueError) as exc:
            log.warning(
                "queue %s: dropping a message from %s (%s) to %r: %s",
                q.name,
                msg.sender,
                msg.sender_name,
                msg.target,
                exc,
            )
            msg.close()
            return
        self._bound_put(q, data, Waiter(1, lambda _w: None))

    def _membership(self, msg: Message) -> None:
        p = msg.body
        if not isinstance(p, dict):
            return
        event = msg.event
        lname = p.get("lname")
        if not isinstance(lname, str) or lname in (self.bus.lname, self.binder.lname):
            return
        if event == "disconnected":
            self.engine.remove_consumer(lname)
        elif event in ("subscribed", "unsubscribed"):
            q = self.bound.get(str(p.get("group")))
            if q is None:
                return
            if event == "subscribed":
                self.engine.add_consumer(
                    q, Consumer(lname, "member", q.opts.window, q.opts.ack_timeout)
                )
            else:
                q.consumers.pop(lname, None)


# -- stored values of bound groups (see Service._bound_request/_bound_message) ----------------
class Stored(NamedTuple):
    """A message of a bound queue, decoded from its stored value."""

    #: :data:`KIND_REQUEST`, :data:`KIND_MESSAGE` or :data:`KIND_BODY` (a ``put``: it
    #: reaches the members as a one-way message)
    kind: int
    #: ``[cmd, params]`` of a request, the body of a one-way message or put
    value: Any
    #: the binary attachments it came with, delivered with it
    attachments: list[bytes]
    #: a one-way message sent to ``G[?]``: forwarded to one member, not the group
    anycast: bool
    #: ``(lname, name)`` of the producer that sent it to the group, None if unknown
    #: (a put, or stored before origins were kept): members then see the binder
    origin: tuple[str, str] | None


def encode_bound(
    kind: bytes,
    value: Any,
    attachments: Sequence[bytes | memoryview] = (),
    anycast: bool = False,
    origin: tuple[str, str] | None = None,
) -> bytes:
    """The stored value: ``kind`` (``b"R"`` request, ``b"M"`` message), CBOR ``value``,
    then, only if there are any, a second CBOR item: the map of extensions
    ``{"attachments"?: [bytes...], "anycast"?: true, "from"?: [lname, name]}``.

    Raises:
        ValueError: ``value`` cannot be encoded as CBOR (the client decoded it, so only
            values cbor2 cannot write back, such as undecodable tags, end up here).
    """
    try:
        head = kind + cbor2.dumps(value)
    except (cbor2.CBOREncodeError, TypeError) as exc:
        raise ValueError(f"cannot be stored: {exc}") from exc
    return head + _extensions(attachments, anycast, origin)


def encode_bound_raw(
    kind: bytes,
    encoded: bytes,
    attachments: Sequence[bytes | memoryview],
    anycast: bool,
    origin: tuple[str, str] | None,
) -> bytes:
    """:func:`encode_bound` for a value already CBOR-encoded by the producer (a queue
    client's ``send``).

    Raises:
        ValueError: ``encoded`` is not exactly one well-formed CBOR item (the end of the
            first item is where the extensions start, so it must be checked).
    """
    fp = io.BytesIO(encoded)
    try:
        cbor2.CBORDecoder(fp).decode()
    except (cbor2.CBORDecodeError, ValueError, TypeError) as exc:
        raise ValueError(f"body is not well-formed CBOR: {exc}") from exc
    if fp.tell() != len(encoded):
        raise ValueError(f"body has {len(encoded) - fp.tell()} bytes after its CBOR item")
    return kind + encoded + _extensions(attachments, anycast, origin)


def _extensions(
    attachments: Sequence[bytes | memoryview], anycast: bool, origin: tuple[str, str] | None
) -> bytes:
    # Appended after the value rather than inside it, because a message body may be any
    # CBOR value (a list of two included), so only the end of the first item tells them
    # apart. Values stored before extensions existed are the first part alone and decode
    # unchanged (decode_bound).
    ext: dict[str, Any] = {}
    if attachments:
        ext["attachments"] = [bytes(a) for a in attachments]
    if anycast:
        ext["anycast"] = True
    if origin is not None:
        ext["from"] = list(origin)
    return cbor2.dumps(ext) if ext else b""


def decode_bound(data: bytes) -> Stored:
    """The inverse of :func:`encode_bound`; a put's value (:data:`KIND_BODY`) is its
    body, without extensions. Values without extensions, including every one stored
    before they existed, have none.

    Raises:
        ValueError: the value is not well-formed CBOR, or a request's is not
            ``[cmd, params]`` with a string ``cmd`` (a put's body is the producer's,
            unchecked until here).
    """
    kind = data[0]
    if kind == KIND_TRACED:  # a put by a traced request, for the members as any put
        data = b"B" + body_of(data)
        kind = KIND_BODY
    fp = io.BytesIO(data)
    fp.seek(1)
    decoder = cbor2.CBORDecoder(fp)
    try:
        value = decoder.decode()
        ext = decoder.decode() if kind != KIND_BODY and fp.tell() < len(data) else {}
    except (cbor2.CBORDecodeError, ValueError, TypeError, EOFError) as exc:
        raise ValueError(f"stored value is not well-formed CBOR: {exc}") from exc
    if kind == KIND_REQUEST and not (
        isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
    ):
        raise ValueError("stored request is not [cmd, params]")
    if not isinstance(ext, dict):
        ext = {}
    origin = ext.get("from")
    if not (
        isinstance(origin, list)
        and len(origin) == 2
        and all(isinstance(x, str) and x and "\0" not in x for x in origin)
    ):
        origin = None
    return Stored(
        kind,
        value,
        list(ext.get("attachments", ())),
        ext.get("anycast") is True,
        (origin[0], origin[1]) if origin else None,
    )


def _fetched(got: list[Msg]) -> list[list[Any]]:
    """A ``fetch`` answer's rows: ``[id, body, deliveries]``, and the ``traceparent`` the
    message was put with as a fourth item where its put was traced (docs/QUEUE.md)."""
    return [
        [m.mid, body_of(m.data), m.deliveries]
        if m.data[0] != KIND_TRACED
        else [m.mid, body_of(m.data), m.deliveries, trace_of(m.data)]
        for m in got
    ]
