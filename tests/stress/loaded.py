"""Run a command (the test suite by default) while CPU burners keep every core busy.

The suite must pass on a busy machine: a user's laptop or a shared CI runner. This
starts one burner per core (``stress-ng --cpu N`` when installed, Debian package
``stress-ng``; else N Python processes spinning), runs the command ``--runs`` times in a
row, prints each run's wall time and exit status, and stops the burners, also when
interrupted. Exit status: 0 when every run passed, else the first failing run's status.

    python3 tests/stress/loaded.py                      # the README's pytest part, once
    python3 tests/stress/loaded.py --runs 3             # three in a row, for rare flakes
    python3 tests/stress/loaded.py -- .venv/bin/python -m pytest tests/e2e -q

Run it from the repository's top directory, after the README's install step.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

#: How the README's test command starts (README.md, tests/test_readme.py checks it).
README_COMMAND_START = "python3 -m venv .venv && .venv/bin/pip install -e '.[dev"


def readme_test_command(readme: str) -> str:
    """The README's test command: its indented line that creates the venv with the dev
    extra. Raises LookupError if the README has none."""
    for line in readme.splitlines():
        if line.strip().startswith(README_COMMAND_START):
            return line.strip()
    raise LookupError(f"README.md has no line starting with {README_COMMAND_START!r}")


def default_command() -> list[str]:
    """The pytest part of the README's test command (the install step is done once),
    run by bash as the README's reader would."""
    with open("README.md", encoding="utf-8") as f:
        pytest_part = readme_test_command(f.read()).split("&&")[-1].strip()
    return ["bash", "-c", pytest_part]


def start_burners(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` CPU burners: stress-ng if installed (one process tree), else Python loops.

    Each burner runs in its own process group, so stopping it stops its workers too.
    """
    stress = shutil.which("stress-ng")
    if stress:
        argv = [stress, "--cpu", str(n), "--cpu-method", "all", "--quiet"]
        return [subprocess.Popen(argv, start_new_session=True)]
    spin = "while True: pass"
    return [
        subprocess.Popen([sys.executable, "-c", spin], start_new_session=True) for _ in range(n)
    ]


def stop_burners(burners: list[subprocess.Popen[bytes]]) -> None:
    for p in burners:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in burners:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--burners",
        type=int,
        default=os.cpu_count() or 1,
        help="CPU burners to run (default: one per core, %(default)s)",
    )
    ap.add_argument("--runs", type=int, default=1, help="times to run the command in a row")
    ap.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="the command after --; default: the README's pytest command",
    )
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    command = command or default_command()
    env = dict(os.environ)
    # As in the README's command: Spark's Python workers are the venv's interpreter.
    env.setdefault("PYSPARK_PYTHON", os.path.abspath(os.path.join(".venv", "bin", "python")))
    print(f"loaded.py: command: {' '.join(command)}", flush=True)
    burners = start_burners(args.burners)
    print(
        f"loaded.py: {args.burners} CPU burner(s) running "
        f"({'stress-ng' if shutil.which('stress-ng') else 'python'})",
        flush=True,
    )
    status = 0
    try:
        for i in range(1, args.runs + 1):
            t0 = time.monotonic()
            rc = subprocess.call(command, env=env)
            took = time.monotonic() - t0
            print(
                f"loaded.py: run {i}/{args.runs}: exit status {rc}, wall time "
                f"{took / 60:.1f} min ({took:.0f} s)",
                flush=True,
            )
            if rc and not status:
                status = rc
    finally:
        stop_burners(burners)
    return status


if __name__ == "__main__":
    sys.exit(main())
