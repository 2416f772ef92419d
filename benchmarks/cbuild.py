"""Builds the C client's benchmark worker (clients/c, ``msgq-bench``) with meson.

The ``msgq_trio-c`` system calls :func:`c_worker` when a run starts its broker: the
first call in a process runs ``meson setup`` (if the build directory is new) and
``meson compile`` of that one target, so an edited libmsgq is rebuilt before it is
measured; later calls return the path at once.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
C_DIR = ROOT / "clients" / "c"
#: Under the checkout's ignored ``build/``; ``MSGQ_BENCH_C_BUILD`` picks another.
DEFAULT_BUILD_DIR = ROOT / "build" / "bench-c"
TARGET = "msgq-bench"
#: A cold build compiles libmsgq and the worker; a loaded 2-core machine needs minutes.
BUILD_TIMEOUT = 600.0


class CBuildError(RuntimeError):
    """libmsgq or its benchmark worker could not be built (the message says why)."""


def build_dir() -> Path:
    return Path(os.environ.get("MSGQ_BENCH_C_BUILD", DEFAULT_BUILD_DIR))


@functools.cache
def c_worker() -> str:
    """The path of the built ``msgq-bench``, building it first.

    Raises:
        CBuildError: a tool is missing or meson failed (its output is in the message).
    """
    missing = [t for t in ("meson", "ninja", "cc", "pkg-config") if not shutil.which(t)]
    if missing:
        raise CBuildError(
            f"cannot build libmsgq: missing {', '.join(missing)} (Debian: apt-get install "
            "gcc meson ninja-build pkg-config libcbor-dev libjansson-dev)"
        )
    out = build_dir()
    steps = [["meson", "compile", "-C", str(out), TARGET]]
    if not (out / "build.ninja").exists():
        steps.insert(0, ["meson", "setup", str(out), str(C_DIR)])
    for argv in steps:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT, check=False)
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-15:])
            raise CBuildError(f"{' '.join(argv)} failed ({r.returncode}):\n{tail}")
    return str(out / TARGET)
