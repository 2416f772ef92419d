"""Operator commands of the queue plugin: ``peek`` and ``purge`` (``msgq-trio queue``).

Registered by ``Service.setup`` on the plugin's API connection (REQUEST to the group
``msgq-queue``), like ``stats``; docs/QUEUE.md ("Operating queues") states them for users.

* ``peek {"queue", "n"?}`` -> the first ``n`` (default 10, at most 1,000) ready messages
  without delivering them: stored ones in seq order (read from the store on the store
  thread, in pages; the ones in flight or acked are left out), then the ones not stored
  yet in arrival order. Each is ``{"seq", "producer", "producer_seq", "deliveries",
  "size", "kind", "body", "attachments"}``: ``seq`` None while not stored, ``kind``
  ``"body"`` (queue API: ``body`` is the producer's CBOR), ``"request"`` (bound group:
  CBOR ``[cmd, params]``) or ``"message"`` (bound group: the one-way message's CBOR);
  ``size`` the length of ``body``; ``attachments`` how many binary attachments a bound
  group's request or message carries (stored after its CBOR, not shown).
* ``purge {"queue"}`` -> how many messages were removed: every message of the queue
  that no consumer holds and that is not waiting for its commit (``Engine.purge``).
  Logged at WARNING with the caller.

Errors: malformed params or an unknown queue answer ``bad-request``; a store failure
``internal-error`` (logged).
"""

from __future__ import annotations

import functools
import io
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import cbor2
from msgq_trio.storage.api import StorageError

from msgq_trio.client.bus import Message
from msgq_trio.errors import CommandFailed
from msgq_trio.protocol.codes import ErrorCode

from .model import KIND_BODY, KIND_MESSAGE, KIND_REQUEST, KIND_TRACED, PAGE, READY, Queue, body_of
from .tasks import Engine

__all__ = ["MAX_PEEK", "commands", "peek", "purge"]

log = logging.getLogger("msgq_trio.plugins.queue")

BAD = str(ErrorCode.BAD_REQUEST)
#: Most messages one ``peek`` returns: the same bound as ``fetch`` (1,000 bodies of up
#: to 64 KiB fill the default 64 MiB frame).
MAX_PEEK = 1000
#: ``peek`` without ``n``: a screenful.
DEFAULT_PEEK = 10
KINDS = {KIND_BODY: "body", KIND_REQUEST: "request", KIND_MESSAGE: "message", KIND_TRACED: "body"}

Handler = Callable[[Any, Message], Awaitable[Any]]


def _queue(engine: Engine, params: Any) -> Queue:
    name = params.get("queue") if isinstance(params, dict) else None
    if not isinstance(name, str) or not name:
        raise CommandFailed(BAD, "params need 'queue': a non-empty string")
    q = engine.queues.get(name)
    if q is None:
        raise CommandFailed(BAD, f"unknown queue {name!r}: declare it first")
    return q


def _split(data: bytes) -> tuple[bytes, int]:
    """A stored value's body (after the kind byte) and its number of attachments.

    A bound group's request or message is its CBOR, then, if it has any, a second CBOR
    item with its extensions (``{"attachments"?: [...], ...}``, service.py
    ``encode_bound``): the body ends where the first item ends. A queue-API body is the
    producer's CBOR, whole."""
    if not data or data[0] == KIND_BODY:
        return data[1:], 0
    if data[0] == KIND_TRACED:
        return body_of(data), 0
    fp = io.BytesIO(data)
    fp.seek(1)
    decoder = cbor2.CBORDecoder(fp)
    try:
        decoder.decode()
        end = fp.tell()
        ext = decoder.decode() if end < len(data) else {}
    except Exception:  # cbor2 raises several types; a listing must not fail on one value
        return data[1:], 0
    files = ext.get("attachments") if isinstance(ext, dict) else None
    return data[1:end], len(files) if isinstance(files, list) else 0


def _row(
    seq: int | None, producer: str, producer_seq: int, deliveries: int, data: bytes
) -> dict[str, Any]:
    body, attachments = _split(data)
    return {
        "seq": seq,
        "producer": producer,
        "producer_seq": producer_seq,
        "deliveries": deliveries,
        "size": len(body),
        "kind": KINDS.get(data[0], "unknown") if data else "unknown",
        "body": body,
        "attachments": attachments,
    }


async def peek(engine: Engine, params: Any, request: Message) -> list[dict[str, Any]]:
    """``peek``: see the module docstring. Reads pages of at most ``PAGE`` messages from
    the first stored one, each one short read on the store thread (no read transaction
    spans an await). Delivers nothing and changes nothing.

    Not a snapshot: a message delivered or acked while the pages are read may still be
    listed, one stored meanwhile may be missing; the answer is for a human's eye."""
    q = _queue(engine, params)
    n = params.get("n", DEFAULT_PEEK)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise CommandFailed(BAD, "'n' must be an integer >= 1")
    n = min(n, MAX_PEEK)
    out: list[dict[str, Any]] = []
    start = 0
    while len(out) < n:
        # Twice what is missing: some stored ones are skipped (in flight), and a page's
        # store-thread time grows with its size (commits queue behind it).
        limit = min(PAGE, 2 * (n - len(out)) + 16)
        try:
            chunk = await engine.thread.run(engine.store.read_range, q.name, start, limit)
        except StorageError as exc:
            log.error(
                "queue %s: peek for %s (%s): cannot read the store: %s",
                q.name,
                request.sender,
                request.sender_name,
                exc,
            )
            raise CommandFailed(
                str(ErrorCode.INTERNAL_ERROR), f"queue {q.name!r}: cannot read the store: {exc}"
            ) from None
        for sm in chunk:
            if sm.seq in q.deleting:
                continue  # acked; its delete is not committed yet
            m = q.mem.get(sm.seq)
            if m is not None and m.state != READY:
                continue  # in flight (or moving to the dead-letter queue)
            deliveries = m.deliveries if m is not None else sm.delivery_count
            out.append(_row(sm.seq, sm.producer, sm.producer_seq, deliveries, sm.body))
            if len(out) == n:
                break
        if len(chunk) < limit:
            break
        start = chunk[-1].seq + 1
    if len(out) < n:
        # Ready messages not stored yet (waiting for their commit), in arrival order.
        # One the store had by the time of the read above is listed there already.
        seen = {(r["producer"], r["producer_seq"]) for r in out}
        waiting = sorted(
            (
                m
                for m in (*q.ready, *(m for _, m in q.again))
                if m.state == READY and m.seq is None and (m.producer, m.pseq) not in seen
            ),
            key=lambda m: m.mid,
        )
        for m in waiting[: n - len(out)]:
            out.append(_row(None, m.producer, m.pseq, m.deliveries, m.data))
    return out


async def purge(engine: Engine, params: Any, request: Message) -> int:
    """``purge``: remove every message of the queue that no consumer holds and that is
    not waiting for its commit (``Engine.purge``); returns how many. Destroys data, so
    it is logged at WARNING naming the caller, with the count."""
    q = _queue(engine, params)
    log.warning("queue %s: purge requested by %s (%s)", q.name, request.sender, request.sender_name)
    try:
        n = await engine.purge(q)
    except StorageError as exc:
        log.error(
            "queue %s: purge for %s (%s) failed: %s",
            q.name,
            request.sender,
            request.sender_name,
            exc,
        )
        raise CommandFailed(
            str(ErrorCode.INTERNAL_ERROR), f"queue {q.name!r}: purge failed: {exc}"
        ) from None
    log.warning(
        "queue %s: purged %d messages for %s (%s)", q.name, n, request.sender, request.sender_name
    )
    return n


def commands(engine: Engine) -> list[tuple[str, Handler]]:
    """The operator commands as ``(name, handler(params, request))`` for
    ``Bus.add_command``."""
    return [("peek", functools.partial(peek, engine)), ("purge", functools.partial(purge, engine))]
