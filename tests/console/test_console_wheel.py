"""``msgq-trio console`` from a wheel, in a fresh virtualenv, with no network: the page,
its static files and the web stack (Starlette, hypercorn) come with a plain install.

Nothing is fetched: the wheel is built without build isolation (setuptools and wheel of
the running interpreter) and its runtime dependencies are installed with ``--no-index``
from a wheelhouse made here by packing the distributions this interpreter has installed
(their files as their RECORD lists them). pip therefore resolves ``msgq-trio``'s declared
dependencies on its own: a dependency missing from pyproject.toml fails the install or
the console's start.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from console_helpers import first_line
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from shared_build import shared_wheel

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 300.0


def wheel_requires(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a built wheel's METADATA (what pip will resolve)."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    return [
        line.split(":", 1)[1].strip()
        for line in text.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def runtime_closure(requires: list[str]) -> list[metadata.Distribution]:
    """The installed distributions that ``requires`` needs at run time (no extras),
    following each one's own requirements."""
    seen: dict[str, metadata.Distribution] = {}
    todo = list(requires)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        dist = metadata.distribution(req.name)
        seen[name] = dist
        todo.extend(dist.requires or ())
    return list(seen.values())


def pack_wheel(dist: metadata.Distribution, out: Path) -> Path:
    """An installed distribution as a wheel again: the files its RECORD lists under
    site-packages (scripts elsewhere are left out), with a fresh RECORD."""
    name = str(dist.metadata["Name"]).replace("-", "_")
    wheel = out / f"{name}-{dist.version}-py3-none-any.whl"
    base = Path(str(dist.locate_file("")))
    files = [f for f in dist.files or () if not str(f).startswith("..")]
    record_name = next(str(f) for f in files if str(f).endswith(".dist-info/RECORD"))
    lines = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            path = base / f
            if str(f) == record_name or "__pycache__" in str(f) or not path.is_file():
                continue
            data = path.read_bytes()
            z.writestr(str(f), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            lines.append(f"{f},sha256={digest.decode()},{len(data)}")
        lines.append(f"{record_name},,")
        z.writestr(record_name, "\n".join(lines) + "\n")
    return wheel


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh virtualenv (no system site-packages) with msgq-trio installed from its
    wheel (the run's one build, tests/shared_build.py) and the wheelhouse, offline; its
    bin/ directory."""
    top = Path(tempfile.mkdtemp(prefix="mqconsole", dir="/tmp"))
    try:
        house = top / "house"
        house.mkdir()
        env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        wheel = Path(shutil.copy2(shared_wheel(tmp_path_factory), house))
        for dist in runtime_closure(wheel_requires(wheel)):
            pack_wheel(dist, house)
        subprocess.run(
            [sys.executable, "-m", "venv", str(top / "venv")], check=True, timeout=TIMEOUT
        )
        pip = [str(top / "venv" / "bin" / "python"), "-m", "pip"]
        r = subprocess.run(
            [*pip, "install", "--no-index", "--find-links", str(house), "msgq-trio"],
            capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=top, check=False,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        yield top / "venv" / "bin"
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_console_from_the_wheel_offline(venv: Path, broker: object, short_tmp: Path) -> None:
    """The installed ``msgq-trio console`` prints its URL and serves the page and its
    static files (package data) from the venv, not from the checkout."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(short_tmp), "PIP_NO_INDEX": "1"}
    proc = subprocess.Popen(
        [str(venv / "msgq-trio"), "console", "-s", str(broker.path), "--listen", "127.0.0.1:0"],  # type: ignore[attr-defined]
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=short_tmp,
        env=env,
    )
    try:
        assert proc.stdout is not None
        url = first_line(proc.stdout.fileno(), 60.0)
        assert url and url.startswith("http://127.0.0.1:"), url
        with urllib.request.urlopen(url, timeout=30) as resp:
            page = resp.read().decode()
        assert "msgq-trio console" in page and "/static/app.js" in page
        for name in ("app.js", "style.css", "icon.svg"):
            with urllib.request.urlopen(url + "static/" + name, timeout=30) as resp:
                assert resp.status == 200 and resp.read()
        r = subprocess.run(
            [str(venv / "python"), "-c", "import msgq_trio.console as c; print(c.__file__)"],
            capture_output=True, text=True, env=env, cwd=short_tmp, check=True,
        )  # fmt: skip
        assert r.stdout.startswith(str(venv.parent)), r.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
        assert "Traceback" not in err, err
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()
