"""A writer that streams numbered records into a named pipe: ``python -m
msgq_trio.scenario.examples.pipe_writer PIPE COUNT [--producer NAME] [--batch B]
[--timeout S] [--rate R] [--max-backlog BYTES]``.

Writes records 1..COUNT to the pipe PIPE of the pipe plugin (docs/PIPES.md), B records
per ``write``. A record is :data:`RECORD` bytes: the producer name, the record's number
and a digest of both, so a reader checks order, loss, duplication and corruption from
the bytes alone (:func:`parse_record`). A write is one chunk of the pipe (B records fit
in ``max_chunk``): the plugin accepts it whole or not at all.

A write that is not accepted within S seconds (the reader is not reading: the pipe is
full, or there is no reader yet) raises ``PipeTimeout`` with the prefix that went in:
those records are acked, the rest failed (``write-timeout``: not in the pipe) and are
written again, with the same numbers. So a stalled reader makes this writer wait, and
nothing is dropped. The first time, it prints ``blocked`` and, with ``--max-backlog``,
asks the pipe service how many bytes the pipe holds (``pipe.stats``): more than BYTES
is a failure (``backlog-over-bound``: the pipe's memory is not bounded as configured).
After the first write accepted after that it prints ``resumed``. The first write waits
for a reader without a timeout, as opening a fifo does. R limits records per second.

Prints ``ready`` once its end is open. Exit status 0 when all COUNT records were
accepted and the pipe closed, 1 on a pipe error (``pipe-broken``: every reader left, a
writer must not go on; the connection lost), like ``msgq-trio pipe write``.

History: per record a ``send`` invoke (key ``NAME:N``, producer NAME, seq N), then ``ok``
(accepted into the pipe), ``fail`` with ``write-timeout`` or ``pipe-broken`` (definitely
not in the pipe: a write is one chunk) or ``info`` (unknown: the connection broke); a
``backlog`` invoke, then ``ok`` or ``fail`` with ``backlog-over-bound``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import trio

import msgq_trio
from msgq_trio.client.pipe import DEFAULT_GROUP
from msgq_trio.errors import ConnectionLost, MsgqError, PipeBroken, PipeTimeout

from ._history import History

#: Bytes per record: a power of two, so that a multi-chunk write's chunk boundaries
#: (multiples of ``max_chunk``) never cut a record either.
RECORD = 64
#: Longest producer name (the record's fixed field).
NAME_LEN = 8
#: Records per write: 16 KiB, one chunk (``max_chunk`` is 256 KiB by default).
DEFAULT_BATCH = 256


def error_code(exc: MsgqError) -> str:
    """The documented code of a pipe error, as the history records it."""
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:
        return code
    return "connection-lost" if isinstance(exc, ConnectionLost) else type(exc).__name__


def make_record(producer: str, seq: int) -> bytes:
    """Record ``seq`` of ``producer``: ``NAME     000000000042 <digest>\\n``, RECORD bytes."""
    head = f"{producer:<{NAME_LEN}} {seq:012d} "
    fill = RECORD - len(head) - 1
    digest = hashlib.sha256(head.encode()).hexdigest()[:fill]
    return f"{head}{digest}\n".encode()


def parse_record(rec: bytes) -> tuple[str, int] | None:
    """``(producer, seq)`` of a record, or None if it is not a record this writer makes
    (corrupted, cut, or shifted by lost bytes)."""
    if len(rec) != RECORD:
        return None
    try:
        producer = rec[:NAME_LEN].decode().rstrip(" ")
        seq = int(rec[NAME_LEN + 1 : NAME_LEN + 13])
    except ValueError:
        return None
    if not producer or make_record(producer, seq) != rec:
        return None
    return producer, seq


async def check_backlog(bus: msgq_trio.Bus, h: History, pipe: str, bound: int) -> None:
    """Ask the pipe service how many bytes the pipe holds (``pipe.stats``, docs/PIPES.md)
    while this writer is blocked: ``ok`` within ``bound``, else ``fail`` with
    ``backlog-over-bound``, the stats as ``value`` either way."""
    op = h.invoke("backlog", key=pipe)
    try:
        stats = dict(await bus.call(DEFAULT_GROUP, "pipe.stats", {"pipe": pipe}))
    except MsgqError as exc:
        h.complete(op, "fail", "backlog", key=pipe, error=error_code(exc))
        return
    over = int(stats.get("buffered", 0)) > bound
    h.complete(
        op,
        "fail" if over else "ok",
        "backlog",
        key=pipe,
        value=stats,
        **({"error": "backlog-over-bound"} if over else {}),
    )


async def main(
    pipe: str, count: int, producer: str, batch: int, timeout: float, rate: float, bound: int
) -> int:
    h = History()
    async with msgq_trio.connect(name=f"pipe-writer-{producer}") as bus:
        w = await bus.pipe(pipe).open_writer()
        # One write must be one chunk: accepted whole or not at all.
        batch = max(1, min(batch, w.max_chunk // RECORD))
        print("ready", flush=True)
        blocked = resumed = False
        seq = 1  # the next record to write
        while seq <= count:
            last = min(count, seq + batch - 1)
            ops = {
                n: h.invoke("send", key=f"{producer}:{n}", producer=producer, seq=n)
                for n in range(seq, last + 1)
            }
            data = b"".join(make_record(producer, n) for n in range(seq, last + 1))
            try:
                # The first write waits for a reader however long, as opening a fifo
                # does: only a reader that stops reading is worth a timeout here.
                await w.write(data, timeout=timeout if seq > 1 else None)
            except PipeTimeout as exc:
                went = exc.written // RECORD  # whole records: PipeTimeout.written is exact
                for n in range(seq, last + 1):
                    if n < seq + went:
                        h.complete(ops[n], "ok", "send", key=f"{producer}:{n}")
                    else:
                        h.complete(
                            ops[n], "fail", "send", key=f"{producer}:{n}", error="write-timeout"
                        )
                if not blocked:
                    print("blocked", flush=True)
                    blocked = True
                    if bound:
                        await check_backlog(bus, h, pipe, bound)
                seq += went
                continue
            except PipeBroken as exc:
                for n in range(seq, last + 1):
                    h.complete(ops[n], "fail", "send", key=f"{producer}:{n}", error=error_code(exc))
                print(f"pipe broken: {exc}", file=sys.stderr, flush=True)
                return 1
            except MsgqError as exc:  # ConnectionLost and the rest: outcome unknown
                err = error_code(exc)
                for n in range(seq, last + 1):
                    h.complete(ops[n], "info", "send", key=f"{producer}:{n}", error=err)
                print(f"pipe error: {exc!r}", file=sys.stderr, flush=True)
                return 1
            for n in range(seq, last + 1):
                h.complete(ops[n], "ok", "send", key=f"{producer}:{n}")
            if blocked and not resumed:
                print("resumed", flush=True)
                resumed = True
            if rate:
                await trio.sleep((last - seq + 1) / rate)
            seq = last + 1
        await w.aclose()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pipe")
    p.add_argument("count", type=int)
    p.add_argument("--producer", default="w1", help=f"at most {NAME_LEN} characters")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="records per write")
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds a write may wait (then retried)"
    )
    p.add_argument("--rate", type=float, default=0.0, help="records per second (0: no limit)")
    p.add_argument(
        "--max-backlog",
        type=int,
        default=0,
        metavar="BYTES",
        help="when first blocked, check that the pipe holds at most BYTES (0: no check)",
    )
    a = p.parse_args()
    if not 0 < len(a.producer) <= NAME_LEN or " " in a.producer:
        p.error(f"--producer: 1 to {NAME_LEN} characters, no spaces")
    sys.exit(trio.run(main, a.pipe, a.count, a.producer, a.batch, a.timeout, a.rate, a.max_backlog))
