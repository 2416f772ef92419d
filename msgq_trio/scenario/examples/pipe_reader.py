"""A reader of the numbered records of :mod:`.pipe_writer`: ``python -m
msgq_trio.scenario.examples.pipe_reader PIPE [--timeout S] [--drop N | --swap N]``.

Reads the pipe PIPE until end of pipe, cuts the bytes into records and records each as
a ``deliver`` of its writer's key (``NAME:N``, producer NAME, seq N), in the order the
bytes came: the history checks then find a lost record (acked by the writer, never
delivered), a duplicate and a reordering. A record that is not one the writer makes
(corrupted, or shifted by lost or extra bytes) and bytes left over at end of pipe are
failures of the pipe, recorded as such.

Prints ``ready`` once its end is open. Exit status, like ``msgq-trio pipe read``: 0 at
end of pipe (every writer left, gracefully or not, and everything was read), 1 on a
pipe error (``pipe-broken``, the connection lost) or a bad record, 3 when a read waited
S seconds for nothing (a hang where the pipe promises an end).

History: per read a ``read`` invoke, then ``ok`` (``value``: bytes, or ``{"eof": true}``)
or ``fail`` with the error (``read-timeout``, ``pipe-broken``, ``connection-lost``,
``corrupt-record``, ``partial-record``), then one ``deliver`` per record in it.

Deliberately broken variants, for scenarios that must catch them: ``--drop N`` does not
record the N-th record it reads (a reader that loses one), ``--swap N`` records the N-th
and the N+1-th in the wrong order (a reader that reorders).
"""

from __future__ import annotations

import argparse
import sys

import trio

import msgq_trio
from msgq_trio.errors import MsgqError, PipeTimeout

from ._history import History
from .pipe_writer import RECORD, error_code, parse_record


async def main(pipe: str, timeout: float, drop: int, swap: int) -> int:
    h = History()
    async with msgq_trio.connect(name="pipe-reader") as bus:
        r = await bus.pipe(pipe).open_reader()
        print("ready", flush=True)
        buf = b""
        seen = 0  # records read so far
        held: tuple[str, int] | None = None  # --swap: the record recorded late

        def deliver(producer: str, seq: int) -> None:
            h.event("deliver", key=f"{producer}:{seq}", producer=producer, seq=seq)

        while True:
            op = h.invoke("read")
            try:
                data = await r.read(timeout=timeout)
            except PipeTimeout:
                h.complete(op, "fail", "read", error="read-timeout")
                print(f"nothing in {timeout} s", file=sys.stderr, flush=True)
                return 3
            except MsgqError as exc:
                h.complete(op, "fail", "read", error=error_code(exc))
                print(f"pipe error: {exc!r}", file=sys.stderr, flush=True)
                return 1
            if not data:
                if buf:
                    h.complete(op, "fail", "read", error="partial-record", value=buf.hex())
                    return 1
                h.complete(op, "ok", "read", value={"eof": True})
                return 0
            buf += data
            n = len(buf) // RECORD
            records = [buf[i * RECORD : (i + 1) * RECORD] for i in range(n)]
            buf = buf[n * RECORD :]
            parsed = [parse_record(rec) for rec in records]
            bad = next((i for i, p in enumerate(parsed) if p is None), None)
            if bad is not None:
                h.complete(op, "fail", "read", error="corrupt-record", value=records[bad].hex())
                return 1
            h.complete(op, "ok", "read", value=len(data))
            for parsed_rec in parsed:
                assert parsed_rec is not None
                seen += 1
                if seen == drop:
                    continue
                if seen == swap:
                    held = parsed_rec  # recorded after the next one
                    continue
                deliver(*parsed_rec)
                if held is not None:
                    deliver(*held)
                    held = None


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pipe")
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds a read may wait (then exit 3)"
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--drop", type=int, default=0, metavar="N", help="broken: lose record N")
    g.add_argument("--swap", type=int, default=0, metavar="N", help="broken: record N+1 before N")
    a = p.parse_args()
    sys.exit(trio.run(main, a.pipe, a.timeout, a.drop, a.swap))
