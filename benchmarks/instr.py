"""What one message costs, in measures a loaded machine does not move:
``python -m benchmarks.instr [--checkout PATH] [--workloads one-way,fan-out,req-reply]
[--tools callgrind,strace] [--n 2000] [--base 200] [--json FILE] [--keep DIR]``.

For a checkout (a directory holding msgq_trio's sources and a ``.venv`` with it
installed, e.g. a ``git worktree`` of an older commit; default: this repository), each
workload runs as separate processes started from that checkout's interpreter: a broker
(``python -m msgq_trio serve``), and clients written as the README teaches
(``connect()``, ``bus.send``, ``async for msg in bus``, ``@bus.command`` on an
``async def`` handler, ``bus.call``), so the same script drives old and new code through
public APIs only:

* ``one-way``: one publisher sends ``n`` 100-byte messages to one subscriber;
* ``fan-out``: the same to four subscribers (a "message" is one send, four deliveries);
* ``req-reply``: one requester makes ``n`` sequential calls of a 100-byte body to one
  responder.

Each workload runs twice, with ``--base`` and ``--base + --n`` messages, and every figure
is the difference divided by ``--n``: the processes' start-up, connection and shutdown
cancel out, what remains is the cost of one more message. Busy polling is off in the
broker and the clients (``--busy-poll 0``, ``connect(busy_poll=0)``): a poll spins for a
time, not for a count, so it would make the figures depend on the machine's speed.
``PYTHONHASHSEED=0`` fixes the interpreter's hashing.

Figures, per message and per process role (broker, pub/sub/req/resp; subscribers summed):

* ``callgrind``: instructions executed (``valgrind --tool=callgrind``, its ``totals``),
  counted from the moment every process is connected and ready (``callgrind_control
  -z``, before the publisher or requester is told to start) to its exit;
* ``strace``: system calls (``strace -f -c``), all of them and by name, among them
  ``epoll_wait`` (one per wake-up of trio's run loop);
* ``calls``: Python function calls, all of them and by function (``python -m cProfile``:
  a count, not a time, so it does not depend on the machine; the text report shows the
  eight most called).

How processes batch (how many frames one ``recv`` brings) still depends on timing, so
two runs of one commit differ a little: run a commit twice to see the spread before
reading a difference between commits. ``--keep DIR`` keeps each run's outputs
(``DIR/WORKLOAD-TOOL-COUNT/LABEL.cg`` ...) for a closer look, e.g. ``callgrind_annotate
--inclusive=yes DIR/fan-out-callgrind-2200/sub0.cg`` for where a subscriber's
instructions go. Under valgrind everything runs 20-50 times
slower: the defaults take a few minutes per workload on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WORKLOADS = ("one-way", "fan-out", "req-reply")
TOOLS = ("callgrind", "strace", "calls")
#: Seconds one process may take to start and report READY under valgrind on a loaded
#: machine (an interpreter's start-up is about a billion instructions).
START_TIMEOUT = 1200.0
#: Seconds a whole run may take before its processes are killed.
RUN_TIMEOUT = 1800.0

#: The clients, run by the checkout's interpreter: ``python SCRIPT ROLE SOCKET N``.
#: Only public API, so that it runs on every commit the tool compares.
CLIENT = r"""
import signal, sys, trio
from msgq_trio import connect

role, sock, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
GROUP, ECHO, SIZE = "instr.data", "instr.echo", 100
body = bytes(range(SIZE))

async def main():
    async with connect(sock, name="instr-" + role, busy_poll=0) as bus:
        if role == "sub":
            await bus.subscribe(GROUP)
            print("READY", flush=True)
            count = 0
            async for msg in bus:
                count += 1
                if count >= n:
                    break
            assert count == n
        elif role == "pub":
            print("READY", flush=True)
            sys.stdin.readline()  # GO: the counters were zeroed
            send = bus.send
            for _ in range(n):
                await send(GROUP, body)
            await bus.flush()
        elif role == "resp":
            @bus.command("echo")
            async def echo(params):
                return params
            with trio.open_signal_receiver(signal.SIGINT) as signals:
                await bus.subscribe(ECHO)
                print("READY", flush=True)
                async for _ in signals:
                    break
        elif role == "req":
            print("READY", flush=True)
            sys.stdin.readline()  # GO: the counters were zeroed
            call = bus.call
            for _ in range(n):
                assert await call(ECHO, "echo", body) == body

trio.run(main)
"""


def _python(checkout: Path) -> str:
    venv = checkout / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MSGQ_TRIO"))}
    env["PYTHONHASHSEED"] = "0"
    return env


def _wrap(tool: str, out: Path, label: str) -> list[str]:
    """What runs before the interpreter (valgrind, strace)."""
    if tool == "calls":
        return []
    if tool == "callgrind":
        return [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}/{label}.cg",
            f"--log-file={out}/{label}.vglog",
        ]
    return ["strace", "-f", "-c", "-o", f"{out}/{label}.strace"]


class _Run:
    """The processes of one workload run under one tool, killed whatever happens."""

    def __init__(self, checkout: Path, tool: str, out: Path) -> None:
        self.checkout, self.tool, self.out = checkout, tool, out
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.files: list[Any] = []
        self.deadline = time.monotonic() + RUN_TIMEOUT

    def start(self, label: str, argv: Sequence[str]) -> subprocess.Popen[str]:
        err = open(self.out / f"{label}.err", "w")  # noqa: SIM115 (closed by close())
        self.files.append(err)
        if self.tool == "calls":
            argv = ["-m", "cProfile", "-o", f"{self.out}/{label}.prof", *argv]
        proc = subprocess.Popen(
            [*_wrap(self.tool, self.out, label), _python(self.checkout), *argv],
            cwd=self.checkout,
            env=_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        self.procs[label] = proc
        return proc

    def client(self, label: str, role: str, sock: Path, n: int) -> subprocess.Popen[str]:
        script = self.out / "instr_client.py"
        if not script.exists():
            script.write_text(CLIENT)
        return self.start(label, [str(script), role, str(sock), str(n)])

    def ready(self, label: str) -> None:
        """Wait for the client's READY line."""
        proc = self.procs[label]
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"{label} did not start: {self._stderr(label)}")

    def go(self, label: str) -> None:
        """Zero every process's counters (callgrind), then let ``label`` start sending:
        what the processes did while the others started (under valgrind, minutes of
        timers on a loaded machine) is not counted."""
        if self.tool == "callgrind":
            for proc in self.procs.values():
                # An explicit pid: without one, callgrind_control acts on every
                # callgrind process of the machine.
                subprocess.run(
                    ["callgrind_control", "-z", str(proc.pid)],
                    check=True,
                    capture_output=True,
                    timeout=START_TIMEOUT,
                )
        stdin = self.procs[label].stdin
        assert stdin is not None
        stdin.write("GO\n")
        stdin.flush()

    def _stderr(self, label: str) -> str:
        return (self.out / f"{label}.err").read_text()[-2000:]

    def wait(self, label: str) -> None:
        proc = self.procs[label]
        rc = proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        if rc != 0:
            raise RuntimeError(f"{label} exited with {rc}: {self._stderr(label)}")

    def stop(self, label: str) -> None:
        """SIGINT (the broker and the responder end cleanly on it), then wait. Sent to
        the traced process itself: valgrind runs in it, strace is its parent (and would
        detach on a signal of its own, leaving the process running)."""
        proc = self.procs[label]
        pid = proc.pid
        if self.tool == "strace":
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            pid = int(children[0])
        os.kill(pid, signal.SIGINT)
        self.wait(label)

    def close(self) -> None:
        """Kill what still runs; close every pipe and file."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        for f in self.files:
            f.close()


def _wait_socket(path: Path, proc: subprocess.Popen[str]) -> None:
    import socket

    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited with status {proc.returncode}")
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(str(path))
            return
        except OSError:
            time.sleep(0.2)
        finally:
            s.close()
    raise RuntimeError("broker did not start")


def run_workload(checkout: Path, workload: str, tool: str, n: int, out: Path) -> list[str]:
    """One run of ``workload`` with ``n`` messages under ``tool``; the labels of its
    processes (their figures are in ``out/LABEL.cg`` or ``out/LABEL.strace``)."""
    sock = out / "broker.sock"
    run = _Run(checkout, tool, out)
    try:
        broker = run.start(
            "broker",
            [
                "-m",
                "msgq_trio",
                "--log-level",
                "WARNING",
                "serve",
                "--socket",
                str(sock),
                "--busy-poll",
                "0",
                "--slow-consumer-timeout",
                "3600",
            ],
        )
        _wait_socket(sock, broker)
        if workload == "req-reply":
            run.client("resp", "resp", sock, n)
            run.ready("resp")
            run.client("req", "req", sock, n)
            run.ready("req")
            run.go("req")
            run.wait("req")
            run.stop("resp")
        else:
            subs = [f"sub{i}" for i in range(4 if workload == "fan-out" else 1)]
            for label in subs:
                run.client(label, "sub", sock, n)
            for label in subs:
                run.ready(label)
            run.client("pub", "pub", sock, n)
            run.ready("pub")
            run.go("pub")
            run.wait("pub")
            for label in subs:
                run.wait(label)
        run.stop("broker")
        return list(run.procs)
    finally:
        run.close()


def _instructions(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def _syscalls(path: Path) -> dict[str, int]:
    """``strace -c``'s table: calls per system call name."""
    calls: dict[str, int] = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and re.fullmatch(r"[\d.]+", fields[0]) and fields[-1] != "total":
            # % time, seconds, usecs/call, calls, [errors,] syscall
            calls[fields[-1]] = calls.get(fields[-1], 0) + int(fields[3])
    return calls


def _calls(path: Path) -> dict[str, int]:
    """cProfile's counts: calls per function (``file:line:name``, the file from the
    package or site-packages down), built-ins included."""
    import pstats

    calls: dict[str, int] = {}
    stats: dict[Any, Any] = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    for (file, line, name), (_cc, nc, _tt, _ct, _callers) in stats.items():
        short = re.sub(r"^.*/(msgq_trio|site-packages|lib/python3\.\d+)/", "", file)
        # A built-in's name may hold its address ("... at 0x7f..."): one key per process.
        key = f"{short}:{line}:{name}" if file != "~" else re.sub(r" at 0x[0-9a-f]+", "", name)
        calls[key] = calls.get(key, 0) + nc
    return calls


def _role(label: str) -> str:
    return re.sub(r"\d+$", "", label)


def measure(
    checkout: Path, workload: str, tool: str, n: int, base: int, keep: Path | None = None
) -> dict[str, Any]:
    """Figures per message of ``workload`` under ``tool``: the runs with ``base`` and
    ``base + n`` messages, differenced. ``{role: instructions}`` for callgrind,
    ``{role: {"total": calls, name: calls...}}`` for strace (system calls) and calls
    (Python function calls). With ``keep``, each run's outputs are moved there."""
    totals: list[dict[str, Any]] = []
    for count in (base, base + n):
        out = Path(tempfile.mkdtemp(prefix="instr-"))
        try:
            labels = run_workload(checkout, workload, tool, count, out)
            per_role: dict[str, Any] = {}
            for label in labels:
                role = _role(label)
                if tool == "callgrind":
                    per_role[role] = per_role.get(role, 0) + _instructions(out / f"{label}.cg")
                else:
                    calls = per_role.setdefault(role, {})
                    counts = (
                        _syscalls(out / f"{label}.strace")
                        if tool == "strace"
                        else _calls(out / f"{label}.prof")
                    )
                    for name, c in counts.items():
                        calls[name] = calls.get(name, 0) + c
            totals.append(per_role)
        finally:
            if keep is not None:
                kept = keep / f"{workload}-{tool}-{count}"
                shutil.rmtree(kept, ignore_errors=True)
                keep.mkdir(parents=True, exist_ok=True)
                shutil.move(str(out), str(kept))
            else:
                shutil.rmtree(out, ignore_errors=True)
    small, large = totals
    if tool == "callgrind":
        return {role: round((large[role] - small[role]) / n) for role in large}
    result: dict[str, Any] = {}
    for role, calls in large.items():
        diff = {name: (c - small[role].get(name, 0)) / n for name, c in calls.items()}
        least = 0.005 if tool == "strace" else 0.05  # calls: hundreds of functions
        per = {name: round(v, 2) for name, v in sorted(diff.items()) if abs(v) >= least}
        result[role] = {"total": round(sum(diff.values()), 2), **per}
    return result


def _commit(checkout: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def report(results: dict[str, Any]) -> str:
    """The figures as text, one line per workload, tool and role."""
    lines = [f"{results['checkout']} at {results['commit']}, per message (n={results['n']}):"]
    for workload, by_tool in results["workloads"].items():
        for tool, per_role in by_tool.items():
            for role, value in per_role.items():
                if tool == "callgrind":
                    text = f"{value:,} instructions"
                else:
                    parts = sorted(
                        ((v, k) for k, v in value.items() if k != "total" and v >= 0.05),
                        reverse=True,
                    )
                    names = ", ".join(f"{k} {v}" for v, k in parts[:8])
                    what = "syscalls" if tool == "strace" else "Python calls"
                    text = f"{value['total']} {what} ({names})"
                lines.append(f"  {workload:9} {tool:9} {role:6} {text}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instr", description=__doc__)
    parser.add_argument("--checkout", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--n", type=int, default=2000, help="messages measured (default 2000)")
    parser.add_argument("--base", type=int, default=200, help="messages of the base run")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--keep", type=Path, help="keep each run's outputs in this folder")
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    tools = [t for t in args.tools.split(",") if t]
    for name in workloads:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    for name in tools:
        if name not in TOOLS:
            parser.error(f"unknown tool {name!r} (known: {', '.join(TOOLS)})")
        program = {"callgrind": "valgrind", "strace": "strace"}.get(name)
        if program is not None and shutil.which(program) is None:
            parser.error(f"{name} needs {program} on PATH")
    checkout = args.checkout.resolve()
    results: dict[str, Any] = {
        "checkout": str(checkout),
        "commit": _commit(checkout),
        "n": args.n,
        "base": args.base,
        "workloads": {},
    }
    for workload in workloads:
        results["workloads"][workload] = {
            tool: measure(checkout, workload, tool, args.n, args.base, args.keep) for tool in tools
        }
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
