"""Building clients/c with meson and running msgq-c (helpers of tests/c/conftest.py)."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

C_DIR = Path(__file__).resolve().parents[2] / "clients" / "c"
BUILD_TIMEOUT = 600.0

#: Sanitizer settings for the instrumented build: any report fails the process with a
#: status of its own (86/87), which the tests check like any other exit status.
SANITIZER_ENV = {
    "ASAN_OPTIONS": "detect_leaks=1:exitcode=86:abort_on_error=0",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=87",
}


def _missing_tools() -> list[str]:
    missing = [t for t in ("meson", "ninja", "cc", "c++", "pkg-config") if not shutil.which(t)]
    if not missing:
        for lib in ("libcbor", "jansson"):
            if subprocess.run(["pkg-config", "--exists", lib], check=False).returncode != 0:
                missing.append(f"{lib} (pkg-config)")
    return missing


def meson_build(build_dir: Path, *options: str, env: dict[str, str] | None = None) -> None:
    """``meson setup`` + ``meson compile`` of clients/c into ``build_dir``; fails the test
    (with the build's output) if either fails."""
    missing = _missing_tools()
    if missing:
        pytest.fail(
            "cannot build libmsgq: missing "
            + ", ".join(missing)
            + " (Debian: apt-get install gcc g++ meson ninja-build pkg-config libcbor-dev "
            "libjansson-dev)"
        )
    full_env = {**os.environ, **(env or {})}
    for argv in (
        ["meson", "setup", str(build_dir), str(C_DIR), *options],
        ["meson", "compile", "-C", str(build_dir)],
    ):
        r = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env=full_env,
            timeout=BUILD_TIMEOUT,
            check=False,
        )
        if r.returncode != 0:
            pytest.fail(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")


class CBuild:
    """One build of clients/c: where msgq-c is and the environment to run it in."""

    def __init__(self, name: str, build_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.dir = build_dir
        self.msgq_c = str(build_dir / "msgq-c")
        self.example = str(build_dir / "msgq-cxx-example")
        self.env = {**os.environ, **env}

    def __repr__(self) -> str:
        return f"CBuild({self.name})"


def check_clean(stderr: str) -> None:
    """No sanitizer report and no crash message in a C process's stderr."""
    for marker in ("AddressSanitizer", "LeakSanitizer", "runtime error:", "Assertion"):
        assert marker not in stderr, f"{marker} in msgq-c's stderr:\n{stderr}"


class CProcess:
    """A long-running msgq-c (echo, listen): stdout lines, stderr collected to a file."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path, **kw: object) -> None:
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
                **kw,  # type: ignore[call-overload]
            )
        self._buf = b""

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 20.0) -> str:
        """Wait for ``msgq-c: ready LNAME`` on stderr; returns the lname."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.stderr().splitlines():
                if line.startswith("msgq-c: ready "):
                    return line.split()[-1]
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(
            f"msgq-c did not get ready (status {self.proc.poll()}):\n{self.stderr()}"
        )

    def readline(self, timeout: float = 10.0) -> str:
        """The next stdout line; fails the test after ``timeout`` or at EOF."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line from msgq-c within {timeout} s:\n{self.stderr()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(f"msgq-c closed stdout:\n{self.stderr()}")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(15)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
