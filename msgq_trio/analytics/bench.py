"""Benchmark of ``msgq-trio analyze capture`` on a synthetic capture.

    python -m msgq_trio.analytics.bench [--records 1000000] [--dir DIR] [--master URL]

Writes ``--records`` records in the documented capture format (docs/CAPTURE.md: every
key, one JSON object per line, files of at most 100,000 records named like a rotating
capture) and times the whole analysis (``run_capture``: reading, every figure, the
Parquet tables and the HTML report) in a Spark session already started, so the JVM's
start-up is reported apart. The traffic is seeded (``--seed``), so runs are comparable:
200 clients in 20 service groups over 10 minutes; per 100 frames about 40 messages, 27
requests with their answers (about 2 % answered with an error by the callee, 1 %
refused no-recipient by the broker, 1 % timing out, 1 % never answered), 5
notifications.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

CLIENTS = 200
GROUPS = 20
SPAN_S = 600.0
PER_FILE = 100_000
_NULLS = ('"command":null,"event":null,"code":null,"error_message":null,"body":null,'
          '"body_encoding":null')


def _line(ts: float, seq: int, kind: str, sender: str, name: str, target: str, *,
          rid: int | None = None, reply: bool = False, size: int = 60,
          outcome: str = "delivered", recipients: int = 1, command: str | None = None,
          event: str | None = None, code: str | None = None,
          on_behalf: str | None = None) -> str:
    tail = _NULLS
    if command or event or code:
        tail = (f'"command":{json.dumps(command)},"event":{json.dumps(event)},'
                f'"code":{json.dumps(code)},"error_message":'
                f'{json.dumps(code and "synthetic " + code)},"body":null,"body_encoding":null')
    rid_s = "null" if rid is None else str(rid)
    return (f'{{"ts":{ts:.6f},"seq":{seq},"kind":"{kind}","sender":"{sender}",'
            f'"sender_name":"{name}","on_behalf_of":{json.dumps(on_behalf)},'
            f'"target":"{target}","request_id":{rid_s},'
            f'"reply_to":{rid_s if reply else "null"},"all":false,"size":{size},'
            f'"attachments":0,"fds":0,"outcome":"{outcome}","recipients":{recipients},'
            f"{tail}}}\n")


def generate(directory: Path, records: int, seed: int = 1) -> int:
    """Write about ``records`` synthetic capture records (exactly ``records`` unless the
    last request's answer lands past it) into ``directory``; returns the count written."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    t0 = 1_800_000_000.0
    names = [f"Svc{i % GROUPS}" for i in range(CLIENTS)]
    next_rid = [0] * CLIENTS
    seq = 0
    out: list[str] = []
    files = 0

    def flush() -> None:
        nonlocal files, out
        files += 1
        (directory / f"capture-{files:06d}.jsonl").write_text("".join(out))
        out = []

    while seq < records:
        ts = t0 + SPAN_S * seq / records
        c = rng.randrange(CLIENTS)
        me, name = f"l.{c + 1}", names[c]
        x = rng.random()
        seq += 1
        if x < 0.55:
            out.append(_line(ts, seq, "message", me, name, f"Feed{c % 7}",
                             size=40 + rng.randrange(400), recipients=1 + rng.randrange(5)))
        elif x < 0.60:
            out.append(_line(ts, seq, "notification", me, name, f"Svc{c % GROUPS}",
                             event="changed", recipients=9))
        else:
            next_rid[c] += 1
            rid = next_rid[c]
            g = rng.randrange(GROUPS)
            callee = g + GROUPS * rng.randrange(CLIENTS // GROUPS)
            cmd = f"cmd{g % 5}"
            y = rng.random()
            if y < 0.01:  # nobody there: the broker answers at once
                out.append(_line(ts, seq, "command", me, name, f"Nobody{g}", rid=rid,
                                 outcome="no-recipient", recipients=0, command=cmd))
                seq += 1
                out.append(_line(ts, seq, "error", "l.0", "msgq", f"Nobody{g}", rid=rid,
                                 reply=True, code="no-recipient"))
                continue
            out.append(_line(ts, seq, "command", me, name, f"Svc{g}[?]", rid=rid,
                             size=70, command=cmd))
            if y < 0.02:  # never answered in the capture
                continue
            seq += 1
            lat = rng.lognormvariate(-6.5, 0.8)  # ~1.5 ms median
            if y < 0.03:
                out.append(_line(ts + 0.5, seq, "error", "l.0", "msgq", me, rid=rid,
                                 reply=True, code="timeout", on_behalf=f"l.{callee + 1}"))
            elif y < 0.05:
                out.append(_line(ts + lat, seq, "error", f"l.{callee + 1}", names[callee], me,
                                 rid=rid, reply=True, outcome="forwarded",
                                 code="bad-request"))
            else:
                out.append(_line(ts + lat, seq, "answer", f"l.{callee + 1}", names[callee], me,
                                 rid=rid, reply=True, size=50 + rng.randrange(200),
                                 outcome="forwarded"))
        if len(out) >= PER_FILE:
            flush()
    if out:
        flush()
    return seq


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m msgq_trio.analytics.bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dir", type=Path, default=None,
                   help="work directory (default: a temporary one, removed)")
    p.add_argument("--master", default=None, help="Spark master (default local[*])")
    args = p.parse_args(argv)
    work = args.dir or Path(tempfile.mkdtemp(prefix="msgq-analytics-bench-"))
    try:
        t = time.monotonic()
        n = generate(work / "capture", args.records, args.seed)
        gen_s = time.monotonic() - t
        size = sum(f.stat().st_size for f in (work / "capture").glob("*.jsonl"))
        print(f"generated {n} records ({size / 2**20:.0f} MiB) in {gen_s:.1f} s")

        from .cli import run_capture
        from .session import spark_session

        t = time.monotonic()
        spark = spark_session(args.master)
        start_s = time.monotonic() - t
        master = spark.sparkContext.master
        print(f"Spark {spark.version} started ({master}) in {start_s:.1f} s")
        t = time.monotonic()
        fig = run_capture(spark, [str(work / "capture")], work / "report")
        run_s = time.monotonic() - t
        print(f"analysed {fig['records']} records in {run_s:.1f} s "
              f"({fig['records'] / run_s:,.0f} records/s); requests {fig['requests']}")
        print(json.dumps({"records": fig["records"], "bytes_on_disk": size,
                          "generate_s": round(gen_s, 1), "spark_start_s": round(start_s, 1),
                          "analysis_s": round(run_s, 1), "master": master,
                          "cpus": len(os.sched_getaffinity(0))}))
        spark.stop()
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
