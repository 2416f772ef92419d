"""The package as a user gets it: a non-editable wheel installed in a fresh virtualenv
(no system site-packages) outside the checkout, then ``msgq-trio serve --plugin queue``,
``msgq-trio scenario list`` and ``run`` of a listed name, and ``mypy --strict`` on a
small user script that uses Bus; and the sdist, which carries the docs, the scenarios
and the whole test suite.

The wheel is built once for the test run (``pip wheel --no-deps``; setuptools comes from
the package index into pip's isolated build environment; tests/shared_build.py, shared
with tests/test_layout.py) and its dependencies are
installed from the package index (pip's cache makes a second run quick). Without
network access the module is skipped, saying so.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from shared_build import WheelBuildFailed, shared_wheel, source_copy

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300.0
#: What pip prints when it cannot reach the package index (then the test is skipped).
OFFLINE = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "No matching distribution found",
)


def _pip(*argv: str, python: str = sys.executable, cwd: Path) -> None:
    r = subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        cwd=cwd,
    )
    if r.returncode != 0:
        if any(m in r.stdout + r.stderr for m in OFFLINE):
            pytest.skip(f"no package index reachable for pip {argv[0]}: {r.stderr[-300:]}")
        raise AssertionError(f"pip {' '.join(argv)} failed:\n{r.stdout[-3000:]}\n{r.stderr}")


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtualenv under /tmp with the wheel built from this checkout installed
    (not editable); its bin/ directory."""
    top = Path(tempfile.mkdtemp(prefix="mqwheel", dir="/tmp"))
    try:
        try:
            wheel = shared_wheel(tmp_path_factory)
        except WheelBuildFailed as exc:
            if any(m in exc.output for m in OFFLINE):
                pytest.skip(f"no package index reachable for pip wheel: {exc.output[-300:]}")
            raise
        subprocess.run(
            [sys.executable, "-m", "venv", str(top / "venv")], check=True, timeout=TIMEOUT, cwd=top
        )
        _pip("install", str(wheel), python=str(top / "venv" / "bin" / "python"), cwd=top)
        yield top / "venv" / "bin"
    finally:
        shutil.rmtree(top, ignore_errors=True)


def clean_env(**extra: str) -> dict[str, str]:
    """An environment that cannot see the checkout (no PYTHONPATH, no virtualenv)."""
    keep = {
        k: v for k, v in os.environ.items() if k in ("HOME", "LANG", "LC_ALL", "TMPDIR", "USER")
    }
    return {"PATH": "/usr/bin:/bin", **keep, **extra}


def test_installed_from_the_wheel(venv: Path, short_tmp: Path) -> None:
    """The package comes from the venv, not the checkout; ``serve --plugin queue``
    starts without a configuration file (store under $STATE_DIRECTORY/queue) and its
    queue plugin answers ``queue ls``; ``scenario list`` lists the shipped scenarios
    from a directory without scenarios/, and one of them runs by its name; mypy
    --strict accepts a user script."""
    env = clean_env()
    r = subprocess.run(
        [str(venv / "python"), "-c", "import msgq_trio, sys; print(msgq_trio.__file__)"],
        capture_output=True,
        text=True,
        cwd=short_tmp,
        env=env,
        check=True,
    )
    assert r.stdout.startswith(str(venv.parent)), r.stdout
    # The license as an SPDX expression (PEP 639), with the LICENSE file in the metadata.
    r = subprocess.run(
        [
            str(venv / "python"),
            "-c",
            "from importlib.metadata import metadata, files\n"
            "m = metadata('msgq-trio')\n"
            "print(m['License-Expression'], m.get_all('License-File'))\n"
            "print(sorted(str(f) for f in files('msgq-trio') "
            "if f.name == 'LICENSE'))",
        ],
        capture_output=True,
        text=True,
        cwd=short_tmp,
        env=env,
        check=True,
    )
    expression, licenses = r.stdout.splitlines()
    assert expression == "MIT ['LICENSE']", r.stdout
    assert licenses.endswith(".dist-info/licenses/LICENSE']"), r.stdout

    sock = short_tmp / "bus.sock"
    log = short_tmp / "serve.log"
    with open(log, "w") as err:
        serve = subprocess.Popen(
            [str(venv / "msgq-trio"), "serve", "--plugin", "queue", "-s", str(sock)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=short_tmp,
            env=clean_env(STATE_DIRECTORY=str(short_tmp / "state")),
        )
    try:
        assert serve.stdout is not None
        assert "listening" in serve.stdout.readline(), log.read_text()
        q = subprocess.run(
            [str(venv / "msgq-trio"), "queue", "ls", "-s", str(sock)],
            capture_output=True,
            text=True,
            cwd=short_tmp,
            env=env,
            timeout=TIMEOUT,
            check=False,
        )
        assert (q.returncode, q.stdout.strip()) == (0, "no queues"), (q, log.read_text())
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.communicate(timeout=TIMEOUT)
    assert serve.returncode == 0, log.read_text()
    assert (short_tmp / "state" / "queue" / "data.mdb").exists()

    s = subprocess.run(
        [str(venv / "msgq-trio"), "scenario", "list"],
        capture_output=True,
        text=True,
        cwd=short_tmp,
        env=env,
        timeout=TIMEOUT,
        check=False,
    )
    assert s.returncode == 0, s
    names = [line.split()[0] for line in s.stdout.splitlines()]
    assert len(names) >= 15 and "broker-sigkill-restart" in names, s.stdout
    # A listed name runs (the scenario files are the wheel's package data).
    junit = short_tmp / "out.xml"
    s = subprocess.run(
        [
            str(venv / "msgq-trio"),
            "scenario",
            "run",
            "--repeat",
            "2",
            "--seed",
            "1",
            # The suite's latency scale (tests/test_scenarios.py SUITE_LATENCY_SCALE):
            # this is about running a shipped name from the wheel, and the scenario's
            # p99 bound is for a machine that runs it alone (a loaded one exceeded it).
            "--latency-scale",
            "5",
            "--junit",
            str(junit),
            "limit-subscriptions",
        ],
        capture_output=True,
        text=True,
        cwd=short_tmp,
        env=env,
        timeout=TIMEOUT,
        check=False,
    )
    assert s.returncode == 0, f"{s.args}\n{s.stdout}\n{s.stderr}"  # whole, not a repr cut short
    assert s.stdout.count("PASS  limit-subscriptions") == 2, s.stdout
    assert junit.read_text().count("<testcase") == 2

    user = short_tmp / "user.py"
    user.write_text(
        textwrap.dedent('''
        """A component as a user writes it."""
        import trio

        import msgq_trio
        from msgq_trio import Bus


        async def ping(bus: Bus) -> str:
            result = await bus.call("msgq", "ping")
            return str(result)


        async def main() -> None:
            async with msgq_trio.connect(name="user") as bus:
                print(await ping(bus))


        if __name__ == "__main__":
            trio.run(main)
    ''')
    )
    # This checkout's mypy, looking only at the fresh venv's packages (PEP 561).
    m = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--python-executable",
            str(venv / "python"),
            "--cache-dir",
            str(short_tmp / ".mypy"),
            str(user),
        ],
        capture_output=True,
        text=True,
        cwd=short_tmp,
        timeout=TIMEOUT,
        check=False,
        env={**env, "PATH": os.environ["PATH"]},
    )
    assert m.returncode == 0, m.stdout + m.stderr
    assert "Success" in m.stdout


def test_sdist_carries_docs_scenarios_and_the_whole_test_suite(short_tmp: Path) -> None:
    """``python -m build --sdist`` (pypa's build, in its own venv): every tracked file
    under docs/, scenarios/ and tests/ (conftest files included), LICENSE and py.typed
    are in the archive."""
    subprocess.run(
        [sys.executable, "-m", "venv", str(short_tmp / "bv")], check=True, timeout=TIMEOUT
    )
    python = str(short_tmp / "bv" / "bin" / "python")
    _pip("install", "build", python=python, cwd=short_tmp)
    src = source_copy(short_tmp / "src")
    r = subprocess.run(
        [python, "-m", "build", "--sdist", "-o", str(short_tmp / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        cwd=short_tmp,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    (sdist,) = (short_tmp / "dist").glob("msgq_trio-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.partition("/")[2] for n in tar.getnames()}
    tracked = [
        str(p.relative_to(src))
        for d in ("docs", "scenarios", "tests")
        for p in (src / d).rglob("*")
        if p.is_file()
    ]
    assert len(tracked) > 50
    missing = sorted(set(tracked) - names)
    assert missing == [], missing
    assert {"LICENSE", "msgq_trio/py.typed", "tests/conftest.py"} <= names
