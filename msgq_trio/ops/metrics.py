"""Prometheus text exposition (format 0.0.4) over a minimal trio HTTP responder.

Opt-in (``serve --metrics HOST:PORT`` / ``metrics.listen``): it opens a TCP port. One
``GET /metrics`` per connection, answered and closed; anything else gets 404/405. The
request is read with a 5 s deadline and an 8 KiB cap, so a stuck scraper costs one task.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import trio

from ..core.peers import Peer

log = logging.getLogger("msgq_trio.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MAX_REQUEST = 8192
_REQUEST_TIMEOUT = 5.0


class TrafficTotals:
    """Lifetime message and byte counters: live peers' counters plus those of every peer
    that has left (folded in by the broker's ``on_disconnect`` hook), and disconnects by
    reason. Bytes a leaving client is still owed and receives after its GOODBYE are not
    counted."""

    def __init__(self) -> None:
        self.msgs_in = self.msgs_out = self.bytes_in = self.bytes_out = 0
        self.disconnects: Counter[str] = Counter()

    def peer_gone(self, peer: Peer, reason: str) -> None:
        self.msgs_in += peer.msgs_in
        self.msgs_out += peer.msgs_out
        self.bytes_in += peer.bytes_in
        self.bytes_out += peer.bytes_out
        self.disconnects[reason] += 1

    def totals(self, live: Iterable[Peer]) -> dict[str, int]:
        out = {
            "messages_in": self.msgs_in,
            "messages_out": self.msgs_out,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
        }
        for p in live:
            out["messages_in"] += p.msgs_in
            out["messages_out"] += p.msgs_out
            out["bytes_in"] += p.bytes_in
            out["bytes_out"] += p.bytes_out
        return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class Exposition:
    """Builds the text: one HELP and TYPE line per family, then its samples."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(
        self,
        name: str,
        mtype: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, str], float]] | float,
    ) -> None:
        # Counters are named ``..._total`` in HELP/TYPE and samples alike (what
        # prometheus_client itself writes in format 0.0.4).
        sample_name = name + "_total" if mtype == "counter" else name
        self.lines.append(f"# HELP {sample_name} {help_text}")
        self.lines.append(f"# TYPE {sample_name} {mtype}")
        if isinstance(samples, (int, float)):
            samples = [({}, samples)]
        for labels, value in samples:
            if labels:
                lbl = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                self.lines.append(f"{sample_name}{{{lbl}}} {_number(value)}")
            else:
                self.lines.append(f"{sample_name} {_number(value)}")

    def histogram(
        self,
        name: str,
        help_text: str,
        bounds: Sequence[float],
        counts: Sequence[int],
        total: float,
        labels: dict[str, str] | None = None,
    ) -> None:
        """One histogram family: ``counts[i]`` observations fell in bucket ``i`` (values
        ``<= bounds[i]``, above the previous bound; ``counts`` has one more entry, for
        ``+Inf``); ``total`` is their sum. Written cumulatively, as Prometheus wants."""
        if len(counts) != len(bounds) + 1:
            raise ValueError("a histogram needs one count per bound plus one for +Inf")
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} histogram")
        base = ",".join(f'{k}="{_escape(v)}"' for k, v in (labels or {}).items())
        sep = "," if base else ""
        running = 0
        for bound, n in zip([*bounds, math.inf], counts, strict=True):
            running += n
            le = "+Inf" if math.isinf(bound) else _number(float(bound))
            self.lines.append(f'{name}_bucket{{{base}{sep}le="{le}"}} {running}')
        suffix = f"{{{base}}}" if base else ""
        self.lines.append(f"{name}_sum{suffix} {_number(float(total))}")
        self.lines.append(f"{name}_count{suffix} {running}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def parse_listen(spec: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9100`` for IPv6) -> (host, port). Raises ValueError."""
    host, sep, port = spec.rpartition(":")
    if not sep or not host:
        raise ValueError(f"metrics address must be HOST:PORT, got {spec!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        n = int(port)
    except ValueError:
        raise ValueError(f"metrics port must be a number, got {port!r}") from None
    if not 0 <= n <= 65535:
        raise ValueError(f"metrics port must be 0..65535, got {n}")
    return host, n


async def open_listeners(spec: str) -> tuple[list[trio.SocketListener], str]:
    """Bind the endpoint now (so a bad address fails the start); returns the listeners
    and the address actually bound (``HOST:PORT``, the real port when 0 was asked)."""
    host, port = parse_listen(spec)
    listeners = await trio.open_tcp_listeners(port, host=host)
    addr = listeners[0].socket.getsockname()
    shown = f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"
    return listeners, shown


async def open_plugin_listeners(plugin: str, spec: str
                                ) -> tuple[list[trio.SocketListener], str]:
    """:func:`open_listeners` for a plugin's ``metrics`` setting (none if ``spec`` is
    empty). Called before the plugin is ready, so a port in use or a host not of this
    machine fails the plugin's start, and so the broker's, instead of a plugin running
    without its metrics.

    Raises:
        OSError: naming ``[plugins.<plugin>] metrics`` and why it cannot listen.
    """
    if not spec:
        return [], ""
    try:
        return await open_listeners(spec)
    except OSError as exc:
        raise OSError(f"[plugins.{plugin}] metrics = {spec!r}: cannot listen: {exc}") from None


class MetricsServer:
    """Serves ``render()`` at ``/metrics`` on already-bound listeners."""

    def __init__(self, listeners: list[trio.SocketListener], render: Callable[[], str]) -> None:
        self.listeners = listeners
        self.render = render
        self.scrapes = 0

    async def serve(self) -> None:
        await trio.serve_listeners(self._handle, self.listeners)

    async def _handle(self, stream: trio.abc.Stream) -> None:
        try:
            with trio.move_on_after(_REQUEST_TIMEOUT):
                data = b""
                while b"\r\n\r\n" not in data and b"\n\n" not in data:
                    if len(data) > _MAX_REQUEST:
                        await self._respond(stream, 431, "request too large\n")
                        return
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    data += chunk
                parts = data.split(b"\n", 1)[0].split()
                if len(parts) < 2:
                    await self._respond(stream, 400, "bad request\n")
                    return
                method, target = parts[0], parts[1].split(b"?", 1)[0]
                if method not in (b"GET", b"HEAD"):
                    await self._respond(stream, 405, "only GET\n", head=False)
                elif target == b"/metrics":
                    self.scrapes += 1
                    await self._respond(stream, 200, self.render(), head=method == b"HEAD",
                                        ctype=CONTENT_TYPE)
                elif target == b"/":
                    await self._respond(stream, 200, "msgq-trio broker: see /metrics\n",
                                        head=method == b"HEAD")
                else:
                    await self._respond(stream, 404, "not found: try /metrics\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the scraper went away
        except Exception:
            log.exception("internal error while answering a metrics request")
        finally:
            await trio.aclose_forcefully(stream)

    @staticmethod
    async def _respond(
        stream: trio.abc.Stream,
        status: int,
        body: str,
        *,
        head: bool = False,
        ctype: str = "text/plain; charset=utf-8",
    ) -> None:
        reasons = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                   431: "Request Header Fields Too Large"}
        payload = body.encode()
        head_bytes = (
            f"HTTP/1.1 {status} {reasons.get(status, 'Error')}\r\n"
            f"Content-Type: {ctype}\r\n"
            f"Content-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        await stream.send_all(head_bytes if head else head_bytes + payload)


def process_figures() -> dict[str, Any]:
    """Open fds and resident memory of this process (-1 where /proc is unavailable)."""
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = -1
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        rss = -1
    return {"fds": fds, "rss": rss}
