"""Helpers of the cross-broker pipe tests: a set of brokers on this machine (each on its
own Unix socket, or TCP for the link-cut tests), each running the pipe plugin with the
others as peers, and a wait until every broker is connected to every other."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

import msgq_trio


def _toml(v: object) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return json.dumps(v)


def write_config(path: Path, peers: Sequence[object], **settings: Any) -> Path:
    """``[plugins.pipe]`` with ``peers`` (addresses or tables) and ``settings``."""
    lines = ["[plugins.pipe]", f"peers = {_toml(list(peers))}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


async def federation(socket: Path | str) -> dict[str, Any]:
    async with msgq_trio.connect(socket, "stats") as bus:
        stats = await bus.call("msgq-pipe", "pipe.stats", {})
        return dict(stats["federation"])


async def wait_connected(sockets: Sequence[Path | str], timeout: float = 20.0) -> None:
    """Until every broker's pipe service is connected to all its peers, both ways."""
    deadline = time.monotonic() + timeout
    n = len(sockets) - 1
    while True:
        try:
            feds = [await federation(s) for s in sockets]
            if all(
                sum(p["state"] == "up" for p in f["peers"]) == n and len(f["links_in"]) == n
                for f in feds
            ):
                return
        except msgq_trio.MsgqError:
            feds = []
        if time.monotonic() > deadline:
            raise TimeoutError(f"brokers not connected: {feds}")
        await trio.sleep(0.05)


async def start_brokers(
    broker_factory: Callable[..., Any], short_tmp: Path, n: int, **settings: Any
) -> list[Any]:
    """``n`` brokers on Unix sockets, each with every other as a peer, connected."""
    paths = [short_tmp / f"p{i}.sock" for i in range(n)]
    brokers = []
    for i, p in enumerate(paths):
        cfg = write_config(
            short_tmp / f"p{i}.toml",
            [str(q) for q in paths if q != p],
            node=f"n{i}",
            **settings,
        )
        brokers.append(broker_factory("--config", str(cfg), path=p))
    await wait_connected(paths)
    return brokers
