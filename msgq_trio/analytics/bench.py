"""Benchmark of ``msgq-trio analyze capture`` on a synthetic capture.

    python -m msgq_trio.analytics.bench [--records 1000000] [--connections N]
        [--restarts N] [--dir DIR] [--master URL] [--conf KEY=VALUE]...

Writes ``--records`` records in the documented capture format (docs/CAPTURE.md: every
key, one JSON object per line, files of at most 100,000 records named like a rotating
capture) and times the whole analysis (``run_capture``: reading, every figure, the
Parquet tables and the HTML report) in a Spark session already started, so the JVM's
start-up is reported apart, and prints the driver's peak RSS. The traffic is seeded
(``--seed``), so runs are comparable: 200 clients in 20 service groups over 10 minutes;
per 100 frames about 40 messages, 27 requests with their answers (about 2 % answered
with an error by the callee, 1 % refused no-recipient by the broker, 1 % timing out,
1 % never answered), 5 notifications. With ``--connections N`` the senders are N
short-lived connections instead (one after the other, each its own lname: connection
churn), answered by the 200 long-lived service clients; with ``--restarts N`` the
capture spans N broker restarts (each lifetime its ``broker_instance``, lnames and
request ids starting again).
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
_NULLS = (
    '"command":null,"event":null,"code":null,"error_message":null,"body":null,"body_encoding":null'
)


def _line(
    ts: float,
    seq: int,
    kind: str,
    sender: str,
    name: str,
    target: str,
    *,
    rid: int | None = None,
    reply: bool = False,
    size: int = 60,
    outcome: str = "delivered",
    recipients: int = 1,
    command: str | None = None,
    event: str | None = None,
    code: str | None = None,
    on_behalf: str | None = None,
    origin: str = "",
) -> str:
    tail = _NULLS
    if command or event or code:
        tail = (
            f'"command":{json.dumps(command)},"event":{json.dumps(event)},'
            f'"code":{json.dumps(code)},"error_message":'
            f'{json.dumps(code and "synthetic " + code)},"body":null,"body_encoding":null'
        )
    rid_s = "null" if rid is None else str(rid)
    return (
        f'{{"ts":{ts:.6f},"seq":{seq},"kind":"{kind}","sender":"{sender}",'
        f'"sender_name":"{name}","on_behalf_of":{json.dumps(on_behalf)},'
        f'"target":"{target}","request_id":{rid_s},'
        f'"reply_to":{rid_s if reply else "null"},"all":false,"size":{size},'
        f'"attachments":0,"fds":0,"outcome":"{outcome}","recipients":{recipients},'
        f"{tail}{origin}}}\n"
    )


def generate(
    directory: Path, records: int, seed: int = 1, *, connections: int = 0, restarts: int = 0
) -> int:
    """Write about ``records`` synthetic capture records (exactly ``records`` unless the
    last request's answer lands past it) into ``directory``; returns the count written.
    ``connections``: short-lived sender connections (0: the 200 clients send);
    ``restarts``: broker restarts the capture spans (module docstring)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    t0 = 1_800_000_000.0
    names = [f"Svc{i % GROUPS}" for i in range(CLIENTS)]
    next_rid: dict[str, int] = {}
    lifetimes = restarts + 1
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
        life = seq * lifetimes // records
        origin = (
            f',"broker_instance":"{life + 0xB0:016x}",'
            f'"broker_started":{t0 - 1 + SPAN_S * life / lifetimes:.6f}'
        )
        c = rng.randrange(CLIENTS)
        me, name = f"l.{c + 1}", names[c]
        if connections:  # the current short-lived connection (lnames after the services,
            # numbered again from each restart, as a broker does)
            conn = seq * connections // records - life * connections // lifetimes
            me, name = f"l.{CLIENTS + 1 + conn}", "Client"
        x = rng.random()
        seq += 1
        if x < 0.55:
            out.append(
                _line(
                    ts,
                    seq,
                    "message",
                    me,
                    name,
                    f"Feed{c % 7}",
                    size=40 + rng.randrange(400),
                    recipients=1 + rng.randrange(5),
                    origin=origin,
                )
            )
        elif x < 0.60:
            out.append(
                _line(
                    ts,
                    seq,
                    "notification",
                    me,
                    name,
                    f"Svc{c % GROUPS}",
                    event="changed",
                    recipients=9,
                    origin=origin,
                )
            )
        else:
            key = f"{life}/{me}"  # request ids are per connection and broker lifetime
            rid = next_rid[key] = next_rid.get(key, 0) + 1
            g = rng.randrange(GROUPS)
            callee = g + GROUPS * rng.randrange(CLIENTS // GROUPS)
            cmd = f"cmd{g % 5}"
            y = rng.random()
            if y < 0.01:  # nobody there: the broker answers at once
                out.append(
                    _line(
                        ts,
                        seq,
                        "command",
                        me,
                        name,
                        f"Nobody{g}",
                        rid=rid,
                        outcome="no-recipient",
                        recipients=0,
                        command=cmd,
                        origin=origin,
                    )
                )
                seq += 1
                out.append(
                    _line(
                        ts,
                        seq,
                        "error",
                        "l.0",
                        "msgq",
                        f"Nobody{g}",
                        rid=rid,
                        reply=True,
                        code="no-recipient",
                        origin=origin,
                    )
                )
                continue
            out.append(
                _line(
                    ts,
                    seq,
                    "command",
                    me,
                    name,
                    f"Svc{g}[?]",
                    rid=rid,
                    size=70,
                    command=cmd,
                    origin=origin,
                )
            )
            if y < 0.02:  # never answered in the capture
                continue
            seq += 1
            lat = rng.lognormvariate(-6.5, 0.8)  # ~1.5 ms median
            if y < 0.03:
                out.append(
                    _line(
                        ts + 0.5,
                        seq,
                        "error",
                        "l.0",
                        "msgq",
                        me,
                        rid=rid,
                        reply=True,
                        code="timeout",
                        on_behalf=f"l.{callee + 1}",
                        origin=origin,
                    )
                )
            elif y < 0.05:
                out.append(
                    _line(
                        ts + lat,
                        seq,
                        "error",
                        f"l.{callee + 1}",
                        names[callee],
                        me,
                        rid=rid,
                        reply=True,
                        outcome="forwarded",
                        code="bad-request",
                        origin=origin,
                    )
                )
            else:
                out.append(
                    _line(
                        ts + lat,
                        seq,
                        "answer",
                        f"l.{callee + 1}",
                        names[callee],
                        me,
                        rid=rid,
                        reply=True,
                        size=50 + rng.randrange(200),
                        outcome="forwarded",
                        origin=origin,
                    )
                )
        if len(out) >= PER_FILE:
            flush()
    if out:
        flush()
    return seq


def _peak_rss_mib(pid: int) -> float | None:
    """Peak resident memory (VmHWM) of process ``pid`` in MiB, None if unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    from .cli import _conf

    p = argparse.ArgumentParser(
        prog="python -m msgq_trio.analytics.bench", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument(
        "--connections",
        type=int,
        default=0,
        help="short-lived sender connections (default 0: 200 long-lived clients)",
    )
    p.add_argument("--restarts", type=int, default=0, help="broker restarts in the capture")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--dir", type=Path, default=None, help="work directory (default: a temporary one, removed)"
    )
    p.add_argument("--master", default=None, help="Spark master (default local[*])")
    p.add_argument(
        "--conf",
        action="append",
        type=_conf,
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting (repeatable), e.g. spark.driver.memory=512m",
    )
    args = p.parse_args(argv)
    work = args.dir or Path(tempfile.mkdtemp(prefix="msgq-analytics-bench-"))
    try:
        t = time.monotonic()
        n = generate(
            work / "capture",
            args.records,
            args.seed,
            connections=args.connections,
            restarts=args.restarts,
        )
        gen_s = time.monotonic() - t
        size = sum(f.stat().st_size for f in (work / "capture").glob("*.jsonl"))
        print(f"generated {n} records ({size / 2**20:.0f} MiB) in {gen_s:.1f} s")

        from .cli import run_capture
        from .session import analysis_session

        t = time.monotonic()
        with analysis_session(args.master, dict(args.conf)) as spark:
            start_s = time.monotonic() - t
            master = spark.sparkContext.master
            print(f"Spark {spark.version} started ({master}) in {start_s:.1f} s")
            t = time.monotonic()
            fig = run_capture(spark, [str(work / "capture")], str(work / "report"))
            run_s = time.monotonic() - t
            gateway = getattr(spark.sparkContext._gateway, "proc", None)
            jvm_rss = _peak_rss_mib(gateway.pid) if gateway is not None else None
        py_rss = _peak_rss_mib(os.getpid())
        print(
            f"analysed {fig['records']} records in {run_s:.1f} s "
            f"({fig['records'] / run_s:,.0f} records/s); requests {fig['requests']}; "
            f"driver peak RSS: JVM {jvm_rss} MiB, Python {py_rss} MiB"
        )
        print(
            json.dumps(
                {
                    "records": fig["records"],
                    "bytes_on_disk": size,
                    "connections": args.connections,
                    "restarts": args.restarts,
                    "generate_s": round(gen_s, 1),
                    "spark_start_s": round(start_s, 1),
                    "analysis_s": round(run_s, 1),
                    "master": master,
                    "conf": dict(args.conf),
                    "driver_jvm_peak_rss_mib": jvm_rss,
                    "driver_python_peak_rss_mib": py_rss,
                    "cpus": len(os.sched_getaffinity(0)),
                }
            )
        )
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
