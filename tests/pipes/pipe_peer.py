"""A pipe client process for the tests: ``python pipe_peer.py write|read NAME [options]``.

Data is a pattern (byte at offset i is i % 251), so a reader checks every byte it gets
against its offset: a lost, duplicated or reordered byte breaks the pattern. Prints
``open`` once attached, ``progress N`` every 16 MiB, and at the end ``wrote N`` /
``read N ok`` (or ``error TYPE: ...`` and exit status 1).

With ``--persistent`` the pipe is opened persistent; the writer then uses ``write``
(answered once durable) and prints ``acked N`` after each, and the reader checks each
byte against its offset in the pipe (``PipeReader.offset``: a resumed reader starts
where the plugin says), prints ``first OFFSET`` once and ``at OFFSET`` after each read,
and fails if two reads are not contiguous.
"""

from __future__ import annotations

import argparse
import sys

import trio

import msgq_trio
import msgq_trio.client.pipe
from msgq_trio.errors import MsgqError

P = 251
PATTERN = bytes(range(P)) * (((1 << 20) // P) + 2)
PROGRESS = 16 << 20


def pattern_at(offset: int, n: int) -> bytes:
    """``n`` (<= 1 MiB) pattern bytes starting at absolute ``offset``."""
    o = offset % P
    return PATTERN[o : o + n]


async def main(a: argparse.Namespace) -> int:
    async with msgq_trio.connect(name=f"pipe-peer-{a.role}") as bus:
        pipe = bus.pipe(a.name)
        try:
            if a.role == "write":
                w = await pipe.open_writer(
                    on_reader_gone=a.on_reader_gone, persistent=a.persistent or None
                )
                print("open", flush=True)
                sent = 0
                next_mark = PROGRESS
                while a.total < 0 or sent < a.total:
                    n = a.chunk if a.total < 0 else min(a.chunk, a.total - sent)
                    if a.persistent:
                        await w.write(pattern_at(sent, n))
                        print("acked", sent + n, flush=True)
                    else:
                        await w.send_all(pattern_at(sent, n))
                    sent += n
                    if sent >= next_mark:
                        print("progress", sent, flush=True)
                        next_mark += PROGRESS
                await w.aclose()
                print("wrote", sent, flush=True)
            else:
                r = await pipe.open_reader(readers=a.readers, persistent=a.persistent or None)
                print("open", flush=True)
                if a.persistent:
                    return await read_persistent(r, a.pause)
                got = 0
                next_mark = PROGRESS
                pause_mark = a.pause_every
                while True:
                    data = await r.receive_some(a.chunk)
                    if not data:
                        break
                    if data != pattern_at(got, len(data)):
                        print("error pattern broken at offset", got, flush=True)
                        return 1
                    got += len(data)
                    if got >= next_mark:
                        print("progress", got, flush=True)
                        next_mark += PROGRESS
                    if a.pause_every and got >= pause_mark:
                        await trio.sleep(a.pause)
                        pause_mark += a.pause_every
                await r.aclose()
                print("read", got, "ok", flush=True)
        except MsgqError as exc:
            print(f"error {type(exc).__name__}: {exc}", flush=True)
            return 1
    return 0


async def read_persistent(r: msgq_trio.client.pipe.PipeReader, pause: float) -> int:
    """Read to end of pipe, checking every byte against its offset in the pipe (and
    sleeping ``pause`` seconds after each read)."""
    at: int | None = None
    while True:
        data = await r.receive_some(65536)
        if not data:
            break
        assert r.offset is not None
        start = r.offset - len(data)
        if at is None:
            print("first", start, flush=True)
        elif start != at:
            print("error not contiguous: read at", start, "after", at, flush=True)
            return 1
        if data != pattern_at(start, len(data)):
            print("error pattern broken at offset", start, flush=True)
            return 1
        at = r.offset
        print("at", at, flush=True)
        if pause:
            await trio.sleep(pause)
    await r.aclose()
    print("read", at, "ok", flush=True)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["read", "write"])
    ap.add_argument("name")
    ap.add_argument("--total", type=int, default=-1, help="bytes to write (-1: forever)")
    ap.add_argument("--chunk", type=int, default=1 << 20)
    ap.add_argument("--readers", default=None)
    ap.add_argument("--on-reader-gone", default="fail")
    ap.add_argument("--pause-every", type=int, default=0, help="reader: pause after each N bytes")
    ap.add_argument("--pause", type=float, default=0.0)
    ap.add_argument("--persistent", action="store_true")
    sys.exit(trio.run(main, ap.parse_args()))
