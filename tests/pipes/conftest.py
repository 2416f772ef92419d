"""Fixtures for the pipe plugin: brokers started with ``[plugins.pipe]`` configured, and
pipe client processes (``pipe_peer.py``) a test can SIGKILL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

PEER = Path(__file__).with_name("pipe_peer.py")


def write_pipe_config(path: Path, **settings: Any) -> Path:
    """``[plugins.pipe]`` with ``settings``; ``pipes={NAME: {key: value}}`` becomes
    ``[plugins.pipe.pipes.NAME]`` tables."""
    pipes = settings.pop("pipes", {})
    lines = ["[plugins.pipe]"] + [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    for name, table in pipes.items():
        lines.append(f"[plugins.pipe.pipes.{json.dumps(name)}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def pipe_broker(broker_factory: Callable[..., Any], short_tmp: Path) -> Callable[..., Any]:
    """``start(**settings)``: a broker running the pipe plugin with those settings."""

    def start(**settings: Any) -> Any:
        cfg = write_pipe_config(short_tmp / "pipe.toml", **settings)
        return broker_factory("--config", str(cfg))

    return start


@pytest.fixture
def spawn_peer() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """``spawn(socket, role, name, *args)``: start a pipe client process (killed at
    teardown if still running)."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(
        socket: Path, role: str, name: str, *args: str, stdin: Any = subprocess.DEVNULL
    ) -> subprocess.Popen[bytes]:
        env = dict(os.environ, MSGQ_TRIO_SOCKET=str(socket))
        p = subprocess.Popen(
            [sys.executable, str(PEER), role, name, *args],
            env=env,
            stdout=subprocess.PIPE,
            stdin=stdin,
        )
        procs.append(p)
        return p

    yield spawn
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
        if p.stdout is not None:
            p.stdout.close()
