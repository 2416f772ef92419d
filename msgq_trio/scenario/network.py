"""The network around a scenario's brokers: TLS material, and network
namespaces joined to the runner's by a veth pair, with the faults on that pair.

Blocking calls (``openssl``, ``ip``, ``tc``), each bounded by a timeout; the runner calls
them from a thread or before its trio loop. Every failure is :class:`NetworkError` with
the command and its stderr, so a scenario that cannot build its network fails (or is
skipped, where :func:`missing_tools` says so first) with the reason, never runs on a
different topology.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

#: Bound on one ``ip``/``tc``/``openssl`` command (they take milliseconds).
COMMAND_TIMEOUT = 20.0
#: The TCP port of a broker in a namespace (the namespace has no other listener).
NETNS_PORT = 7411


class NetworkError(RuntimeError):
    """A command building or changing the scenario's network failed; says which."""


def _run(argv: Sequence[str]) -> None:
    try:
        subprocess.run(argv, check=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except subprocess.CalledProcessError as exc:
        raise NetworkError(f"{' '.join(argv)}: {exc.stderr.strip() or exc}") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkError(f"{' '.join(argv)}: {exc}") from None


def missing_tools(*, tls: bool, netns: bool) -> str | None:
    """Why this machine cannot build such a network (None: it can): TLS material needs
    ``openssl``; namespaces need root, ``ip`` (iproute2) and ``tc``."""
    if tls and shutil.which("openssl") is None:
        return "TLS needs the openssl command (Debian: openssl)"
    if netns:
        if os.geteuid() != 0:
            return "network namespaces need root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"network namespaces need the {tool} command (Debian: iproute2)"
    return None


def make_tls(directory: Path, ips: Sequence[str]) -> tuple[Path, Path]:
    """A self-signed P-256 certificate for ``ips`` (its own CA: clients trust exactly it)
    and its key, in ``directory``; returns ``(cert, key)``. Also the benchmark's TLS
    broker's.

    Raises:
        NetworkError: openssl failed or is missing (:func:`missing_tools` says first).
    """
    cert, key = directory / "tls-cert.pem", directory / "tls-key.pem"
    san = ",".join(f"IP:{ip}" for ip in ips)
    _run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "2",
            "-subj",
            "/CN=msgq-trio-scenario",
            "-addext",
            f"subjectAltName={san}",
        ]
    )
    return cert, key


def new_token() -> str:
    """A random TCP token for the run's clients and links."""
    return secrets.token_hex(16)


class Namespace:
    """A network namespace joined to the runner's by a veth pair: the runner's end is
    ``outer_ip``, the namespace's ``inner_ip`` (a /30 of 10.203.0.0/16 chosen at random,
    so parallel runs do not collide); the namespace has nothing else but its loopback,
    so nothing in it reaches any other network. :meth:`delete` removes the namespace and
    with it both ends of the pair."""

    def __init__(self, tag: str) -> None:
        self.name = f"mqs-{tag}"
        self.outer, self.inner = f"mqso{tag}"[:15], f"mqsi{tag}"[:15]
        block = secrets.randbelow(16384) * 4
        base = f"10.203.{block // 256}."
        self.outer_ip, self.inner_ip = base + str(block % 256 + 1), base + str(block % 256 + 2)
        self.created = False

    def create(self) -> None:
        """Make the namespace and the pair, addresses up (NetworkError if not)."""
        _run(["ip", "netns", "add", self.name])
        self.created = True
        self._ip("link", "set", "lo", "up")
        _run(["ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner])
        _run(["ip", "link", "set", self.inner, "netns", self.name])
        _run(["ip", "addr", "add", f"{self.outer_ip}/30", "dev", self.outer])
        _run(["ip", "link", "set", self.outer, "up"])
        self._ip("addr", "add", f"{self.inner_ip}/30", "dev", self.inner)
        self._ip("link", "set", self.inner, "up")

    def exec_prefix(self) -> list[str]:
        """The argv prefix that runs a program inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def cut(self, down: bool) -> None:
        """Take the namespace's end of the pair down (no FIN, no RST reaches anyone), or
        up again."""
        self._ip("link", "set", self.inner, "down" if down else "up")

    def netem(self, setting: str | None) -> None:
        """Put ``setting`` (tc-netem words: ``delay 200ms loss 5%``) on both ends'
        egress, so both directions suffer it; None removes it."""
        for prefix, dev in ((["ip", "netns", "exec", self.name], self.inner), ([], self.outer)):
            if setting is None:
                with contextlib.suppress(NetworkError):  # nothing there: already clear
                    _run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"])
            else:
                netem = ["tc", "qdisc", "replace", "dev", dev, "root", "netem", *setting.split()]
                _run([*prefix, *netem])

    def has_netem(self) -> bool:
        """Whether the kernel has netem (some VMs' kernels lack it): tried on the
        namespace's loopback, then removed."""
        try:
            self._tc("qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
        except NetworkError:
            return False
        self._tc("qdisc", "del", "dev", "lo", "root")
        return True

    def delete(self) -> None:
        """Remove the namespace (and the pair); never raises."""
        if self.created:
            with contextlib.suppress(NetworkError):
                _run(["ip", "netns", "del", self.name])
            # The pair goes with the namespace's end; if the namespace was not made
            # that far, the runner's end may be left.
            with contextlib.suppress(NetworkError):
                _run(["ip", "link", "del", self.outer])
            self.created = False

    def _ip(self, *args: str) -> None:
        _run(["ip", "netns", "exec", self.name, "ip", *args])

    def _tc(self, *args: str) -> None:
        _run(["ip", "netns", "exec", self.name, "tc", *args])
