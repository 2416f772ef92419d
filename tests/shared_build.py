"""Build products shared by every worker of one test run (imported as ``shared_build``).

A session-scoped fixture is per process: under ``-n 6 --dist loadfile`` the files that
need the same wheel or the same C build run on different workers, and each worker made
its own copy. :func:`shared_dir` makes it once per run: in the directory the workers'
temporary directories share (pytest's base temporary directory of the run), under an
exclusive ``flock``, so a second worker that asks while the first builds waits for that
build instead of starting its own. What is built comes from the checkout as it is when
the run builds it, as before; a build that fails leaves nothing behind, so the next
test that asks builds again and fails with its own output.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

#: Written last into a finished build directory: without it the directory is the remains
#: of a build that failed or was interrupted.
DONE = ".complete"


def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary directory every worker of this run shares: the base directory itself
    without xdist, its parent under xdist (each worker gets ``popen-gwN`` below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_dir(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> Path:
    """The directory ``name`` of this run, filled once by ``build(directory)`` (given an
    empty directory); later calls, in any worker, get the finished directory at once.
    An exception from ``build`` (a failure, a skip) propagates and leaves no directory."""
    root = run_root(tmp_path_factory)
    target = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / DONE).exists():
            return target
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        try:
            build(target)
        except BaseException:
            shutil.rmtree(target, ignore_errors=True)
            raise
        (target / DONE).touch()
    return target


# -- the wheel ------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent
WHEEL_TIMEOUT = 600.0


class WheelBuildFailed(AssertionError):
    """``pip wheel`` failed; ``output`` is what it printed (stdout, then stderr)."""

    def __init__(self, output: str) -> None:
        super().__init__(f"pip wheel failed:\n{output[-5000:]}")
        self.output = output


def source_copy(dest: Path) -> Path:
    """The checkout's files as git sees them in the working tree (tracked, and new files
    not ignored), copied to ``dest``, as .ci/run copies them: a build in the checkout
    itself would also pick up its leftovers (build/lib, msgq_trio.egg-info/SOURCES.txt
    lists every file once seen), and hide a file missing from the package data or
    MANIFEST.in."""
    names = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    for name in names.stdout.splitlines():
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _build_wheel(d: Path) -> None:
    src = source_copy(d / "src")
    # Build isolation, as a user's `pip wheel` and .ci/run build: the build backend
    # pyproject.toml asks for comes from the package index, not from the test environment.
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps"]
    r = subprocess.run(
        [*pip, "-w", str(d / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=WHEEL_TIMEOUT,
        check=False,
        cwd=d,
    )
    shutil.rmtree(src, ignore_errors=True)
    if r.returncode != 0:
        raise WheelBuildFailed(r.stdout + r.stderr)


def shared_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The msgq_trio wheel built once per run from a copy of the checkout (``pip wheel
    --no-deps``, isolated); raises :class:`WheelBuildFailed` when pip fails."""
    (wheel,) = (shared_dir(tmp_path_factory, "wheel", _build_wheel) / "dist").glob(
        "msgq_trio-*.whl"
    )
    return wheel
