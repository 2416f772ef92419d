"""Across hosts: two brokers in two network namespaces joined by a veth pair,
the link between them over TLS with a token, link faults made by taking the interface
down. Needs root (CI runs as root); nothing leaves the namespaces: the veth pair is the
only interface besides each namespace's loopback, and no route leads anywhere else."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

from msgq_trio.core.access import hash_token
from msgq_trio.scenario.chain import ChainFault, run_chain, signal_broker

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="network namespaces need root (CI runs as root)"
)

Factory = Callable[..., Any]
TOKEN = "link-token-7c41e0d2a9"
A_IP, B_IP, PORT = "10.201.0.1", "10.201.0.2", 7411


def ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    subprocess.run(argv, check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    """Two fresh namespaces ``(a, b)`` with loopback up and a veth pair A_IP <-> B_IP;
    deleted (with their interfaces) at the end."""
    tag = f"{os.getpid() % 100000}"
    a, b = f"mqa{tag}", f"mqb{tag}"
    va, vb = f"mqva{tag}", f"mqvb{tag}"
    made: list[str] = []
    try:
        for ns in (a, b):
            ip("netns", "add", ns)
            made.append(ns)
            ip("link", "set", "lo", "up", ns=ns)
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        ip("link", "set", va, "netns", a)
        ip("link", "set", vb, "netns", b)
        ip("addr", "add", f"{A_IP}/30", "dev", va, ns=a)
        ip("addr", "add", f"{B_IP}/30", "dev", vb, ns=b)
        ip("link", "set", va, "up", ns=a)
        ip("link", "set", vb, "up", ns=b)
        yield a, b
    finally:
        for ns in made:  # deleting a namespace deletes the veth end in it, and its peer
            with contextlib.suppress(subprocess.CalledProcessError):
                ip("netns", "del", ns)


def _toml(v: Any) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")


def _table(name: str, values: dict[str, Any]) -> list[str]:
    return [f"[{name}]", *(f"{k} = {_toml(v)}" for k, v in values.items())]


class NetnsChain:
    """The ChainTopology of msgq_trio.scenario.chain on two namespaces: broker A (queue
    and link plugins) in ``ns_a``, broker B (queue plugin, TLS listener on B_IP with a
    token) in ``ns_b``. The test talks to both over their Unix sockets (pathname sockets
    do not belong to a network namespace); only the link crosses the veth pair."""

    def __init__(
        self,
        factory: Factory,
        tmp: Path,
        ns: tuple[str, str],
        a_queue: dict[str, Any],
        link: dict[str, Any],
    ) -> None:
        self.factory, self.ns = factory, {"a": ns[0], "b": ns[1]}
        self.veth_a = "mqva" + ns[0][3:]
        self.paths = {"a": tmp / "a.sock", "b": tmp / "b.sock"}
        self.configs = {"a": tmp / "a.toml", "b": tmp / "b.toml"}
        ca = trustme.CA()
        cert = ca.issue_cert(B_IP)
        ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
        cert.private_key_and_cert_chain_pem.write_to_path(str(tmp / "b.pem"))
        (tmp / "token").write_text(TOKEN + "\n")
        a = [
            *_table("plugins.queue", {"dir": str(tmp / "a-store")}),
            *_table('plugins.queue.queues."chain"', a_queue),
            *_table(
                "plugins.link.links.tob",
                {
                    "address": f"tls://{B_IP}:{PORT}",
                    "from_queue": "chain",
                    "token_file": str(tmp / "token"),
                    "tls": True,
                    "tls_ca": str(tmp / "ca.pem"),
                    **link,
                },
            ),
        ]
        b = [
            *_table(
                "tcp",
                {
                    "listen": [f"{B_IP}:{PORT}"],
                    "certfile": str(tmp / "b.pem"),
                    "keyfile": str(tmp / "b.pem"),
                    "tokens": {"broker-a": hash_token(TOKEN)},
                    "heartbeat_interval": 0.5,
                    "heartbeat_misses": 3,
                },
            ),
            *_table(
                "access.rule",
                {"who": ["tcp:broker-a"], "call": ["msgq-queue"], "produce": ["chain"]},
            ),
            *_table("plugins.queue", {"dir": str(tmp / "b-store")}),
            *_table('plugins.queue.queues."chain"', {}),
        ]
        b = [line.replace("[access.rule]", "[[access.rule]]") for line in b]
        self.configs["a"].write_text("\n".join(a) + "\n")
        self.configs["b"].write_text("\n".join(b) + "\n")
        self.brokers: dict[str, Any] = {}

    def start(self, broker: str) -> Any:
        b = self.factory(
            "--config",
            str(self.configs[broker]),
            path=self.paths[broker],
            prefix=("ip", "netns", "exec", self.ns[broker]),
        )
        self.brokers[broker] = b
        return b

    def address(self, broker: str) -> str:
        return str(self.paths[broker])

    async def signal(self, target: str, sig: int) -> None:
        if target == "link":
            raise AssertionError("this topology cuts the network instead")
        await signal_broker(self.brokers[target], sig)

    async def restart(self, broker: str) -> None:
        await trio.to_thread.run_sync(self.start, broker)

    async def cut(self, down: bool) -> None:
        await trio.to_thread.run_sync(
            lambda: ip("link", "set", self.veth_a, "down" if down else "up", ns=self.ns["a"])
        )


#: The faults the chain must survive: the link cut three times (no FIN, no RST: only the
#: heartbeats notice), broker A SIGKILLed and restarted once.
NETNS_FAULTS = (
    ChainFault(0.15, "cut-net", 2.0),
    ChainFault(0.35, "cut-net", 3.0),
    ChainFault(0.55, "kill-a", 0.2),
    ChainFault(0.75, "cut-net", 2.0),
)


@pytest.mark.slow
async def test_chain_across_namespaces_over_tls(
    broker_factory: Factory, short_tmp: Path, namespaces: tuple[str, str]
) -> None:
    """End to end across hosts: producer -> broker A queue -> TLS link -> broker B queue ->
    consumer, A and B in two network namespaces; 100,000 messages while the network is
    cut three times and A is SIGKILLed once. Every message the producer got ack 1 for
    reaches the consumer; duplicates (0 with dedup) and the share written at A reported."""
    c = NetnsChain(
        broker_factory, short_tmp, namespaces, a_queue={"ack_grace": 0.2}, link={"put_timeout": 3.0}
    )
    c.start("b")
    c.start("a")
    rep = await run_chain(c, n=100_000, rate=4000.0, faults=NETNS_FAULTS, timeout=600.0)
    print(rep.verdict())
    if not rep.ok:
        print(c.brokers["a"].log()[-6000:])
    assert len(rep.faults) == len(NETNS_FAULTS), rep.verdict()
    assert rep.acked == rep.n, rep.verdict()
    assert not rep.missing, f"{len(rep.missing)} acked messages lost, e.g. {rep.missing[:5]}"
    assert rep.duplicates == 0, rep.verdict()
    assert rep.ok, rep.verdict()
