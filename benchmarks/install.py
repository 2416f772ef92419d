"""Install what the peer systems need (``--peers``): Debian servers and Python clients.

Peers are optional: the benchmark installs what is missing and prints every command it
runs. Anything that cannot be installed makes that peer ``n/a (reason)`` in the results
instead of failing the run.

* NATS: Debian ``nats-server`` + ``nats-py``;
* Redis (``redis`` and ``redis-asyncio``): Debian ``redis-server`` + ``redis`` (redis-py,
  with redis.asyncio) and its optional C parser ``hiredis`` (what redis-py uses in
  production, sync and asyncio; its absence is not an error);
* ZeroMQ: ``pyzmq`` (bundles libzmq);
* RabbitMQ (durable workload only): Debian ``rabbitmq-server`` + ``aio-pika``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable

#: system -> (server binary or None, Debian package or None, [(module, pip name)])
PEER_NEEDS: dict[str, tuple[str | None, str | None, list[tuple[str, str]]]] = {
    "nats": ("nats-server", "nats-server", [("nats", "nats-py")]),
    "redis": ("redis-server", "redis-server", [("redis", "redis")]),
    "redis-asyncio": ("redis-server", "redis-server", [("redis", "redis")]),
    "zeromq": (None, None, [("zmq", "pyzmq")]),
    "rabbitmq": ("rabbitmq-server", "rabbitmq-server", [("aio_pika", "aio-pika")]),
}
#: Installed when Redis is wanted, but only nice to have.
OPTIONAL_PIP = {s: [("hiredis", "hiredis")] for s in ("redis", "redis-asyncio")}
APT_TIMEOUT = 600.0
PIP_TIMEOUT = 600.0

Printer = Callable[[str], None]


def _has_module(name: str) -> bool:
    importlib.invalidate_caches()
    return importlib.util.find_spec(name) is not None


def _run(cmd: list[str], say: Printer, timeout: float) -> str | None:
    """Run ``cmd`` (output shown); returns None on success or a one-line reason."""
    say("bench setup: $ " + " ".join(cmd))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"{cmd[0]} timed out after {timeout:.0f} s"
    except OSError as exc:
        return f"cannot run {cmd[0]}: {exc.strerror or exc}"
    return None if proc.returncode == 0 else f"{' '.join(cmd[:3])} exited {proc.returncode}"


def ensure_peers(systems: Iterable[str], say: Printer = print) -> dict[str, str]:
    """Install the servers and client libraries of the given peer systems if missing.

    Returns ``{system: reason}`` for every peer that is still unusable afterwards.
    """
    wanted = [s for s in systems if s in PEER_NEEDS]
    unusable: dict[str, str] = {}
    debs = sorted(
        {
            deb
            for s in wanted
            for binary, deb, _ in [PEER_NEEDS[s]]
            if binary is not None and deb is not None and shutil.which(binary) is None
        }
    )
    if debs:
        if os.geteuid() != 0:
            reason = f"not root: cannot apt-get install {' '.join(debs)}"
        elif shutil.which("apt-get") is None:
            reason = "no apt-get on this machine"
        else:
            say(f"bench setup: installing Debian packages: {', '.join(debs)}")
            reason = (
                _run(["apt-get", "update"], say, APT_TIMEOUT)
                or _run(
                    ["apt-get", "install", "-y", "--no-install-recommends", *debs], say, APT_TIMEOUT
                )
            ) or ""
        for s in wanted:
            binary = PEER_NEEDS[s][0]
            if binary is not None and shutil.which(binary) is None:
                unusable[s] = f"{binary} not installed" + (f": {reason}" if reason else "")

    pips: list[str] = []
    for s in wanted:
        for module, pip_name in PEER_NEEDS[s][2]:
            if not _has_module(module) and pip_name not in pips:
                pips.append(pip_name)
    if pips:
        say(f"bench setup: installing Python packages into {sys.executable}: {', '.join(pips)}")
        pip_failure = _run([sys.executable, "-m", "pip", "install", *pips], say, PIP_TIMEOUT)
        for s in wanted:
            for module, pip_name in PEER_NEEDS[s][2]:
                if not _has_module(module) and s not in unusable:
                    unusable[s] = f"Python module {module} ({pip_name}) missing" + (
                        f": {pip_failure}" if pip_failure else ""
                    )
    for s in wanted:
        for module, pip_name in OPTIONAL_PIP.get(s, []):
            if s not in unusable and not _has_module(module):
                say(f"bench setup: installing optional {pip_name} (C parser for {s})")
                if _run([sys.executable, "-m", "pip", "install", pip_name], say, PIP_TIMEOUT):
                    say(f"bench setup: {pip_name} not installed; {s} uses its pure-Python path")
    return unusable


def missing(systems: Iterable[str]) -> dict[str, str]:
    """``{system: reason}`` for the peers whose server or client library is missing."""
    out: dict[str, str] = {}
    for s in systems:
        if s not in PEER_NEEDS:
            continue
        binary, _deb, modules = PEER_NEEDS[s]
        if binary is not None and shutil.which(binary) is None:
            out[s] = f"{binary} not installed"
        else:
            for module, pip_name in modules:
                if not _has_module(module):
                    out[s] = f"Python module {module} ({pip_name}) missing"
    return out


def peer_versions() -> dict[str, str]:
    """Versions of the peer servers and client libraries that are installed."""
    out: dict[str, str] = {}
    for name, cmd in (
        ("nats-server", ["nats-server", "--version"]),
        ("redis-server", ["redis-server", "--version"]),
        ("rabbitmq-server", ["dpkg-query", "-W", "-f", "${Version}", "rabbitmq-server"]),
    ):
        if shutil.which(cmd[0]):
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
                out[name] = (res.stdout or res.stderr).strip()
            except (OSError, subprocess.TimeoutExpired) as exc:
                out[name] = f"unknown ({exc})"
    from importlib import metadata

    for dist in ("nats-py", "redis", "hiredis", "pyzmq", "aio-pika", "matplotlib", "trio", "cbor2"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if _has_module("zmq"):
        try:
            zmq = importlib.import_module("zmq")
            out["libzmq"] = str(zmq.zmq_version())
        except ImportError:
            pass
    return out
