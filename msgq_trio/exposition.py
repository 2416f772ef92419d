"""Prometheus exposition over HTTP: families built with prometheus_client, served over trio.

Shared by the broker's metrics endpoint (``serve --metrics``, ops/control.py) and the
plugins' (a plugin's ``metrics`` setting), so both speak one implementation; it depends
on neither the broker's core nor its operations layer, so plugins may import it (the
plugin API's rule, plugins/api.py).

Opt-in everywhere: it opens a TCP port. prometheus_client names, checks and encodes the
families (text 0.0.4, or OpenMetrics when the scraper's ``Accept`` asks for it) and adds
its process collector; the families' figures are read from the caller's state on its
trio thread, once per scrape.

The HTTP side stays a small trio handler rather than prometheus_client's
``start_http_server``: that one runs in its own thread, so every scrape would read the
broker's state (peers, router, queues) from another thread while the trio thread changes
it. Here collection and the state it reads share one thread. One ``GET /metrics`` (or
``HEAD``) per connection, answered and closed; anything else gets 404/405. The request
is read with a 5 s deadline and an 8 KiB cap, so a stuck scraper costs one task.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence

import trio
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "CONTENT_TYPE",
    "Exposition",
    "MetricsServer",
    "Rendered",
    "open_listeners",
    "open_plugin_listeners",
    "parse_listen",
]

log = logging.getLogger("msgq_trio.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MAX_REQUEST = 8192
_REQUEST_TIMEOUT = 5.0


class Rendered(str):
    """The text an :class:`Exposition` renders (Prometheus format 0.0.4) that also
    carries the families it was made from, so :class:`MetricsServer` can encode the
    same figures in the format a scraper asks for (OpenMetrics) and add the process
    collector's, without the callers of :meth:`Exposition.text` changing type."""

    families: tuple[Metric, ...] = ()


class _Families(Collector):
    """A fixed list of families as a prometheus_client collector."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def _registry(*collectors: Collector) -> CollectorRegistry:
    # auto_describe=False: registering does not collect (nothing is read twice), and a
    # fresh registry per scrape holds no state between scrapes.
    registry = CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)
    return registry


class Exposition:
    """Collects metric families (prometheus_client ``Metric`` objects) and renders them.

    The figures come from the caller's own state on its own thread (the broker's trio
    thread); prometheus_client only names, checks and encodes them. A family is a
    ``counter`` or a ``gauge`` (:meth:`family`) or a ``histogram`` (:meth:`histogram`, or
    :meth:`histograms` for one with a series per label set).
    """

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def family(
        self,
        name: str,
        mtype: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, str], float]] | float,
    ) -> None:
        """Add one family of ``mtype`` ``"counter"`` or ``"gauge"``: ``samples`` is one
        value (no labels) or ``(labels, value)`` pairs. A counter's samples are named
        ``NAME_total`` (what the 0.0.4 text and OpenMetrics both write).

        Raises:
            ValueError: an unknown ``mtype`` or a name Prometheus does not allow.
        """
        if mtype not in ("counter", "gauge"):
            raise ValueError(f"metric type must be counter or gauge, got {mtype!r}")
        metric = Metric(name, help_text, mtype)
        sample_name = name + "_total" if mtype == "counter" else name
        if isinstance(samples, (int, float)):
            samples = [({}, samples)]
        for labels, value in samples:
            metric.add_sample(sample_name, dict(labels), float(value))
        self.families.append(metric)

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
        ``+Inf``); ``total`` is their sum. Written cumulatively, as Prometheus wants.

        Raises:
            ValueError: ``counts`` is not one longer than ``bounds``.
        """
        if len(counts) != len(bounds) + 1:
            raise ValueError("a histogram needs one count per bound plus one for +Inf")
        keys = sorted(labels or {})
        fam = HistogramMetricFamily(name, help_text, labels=keys)
        running = 0
        buckets: list[tuple[str, float]] = []
        for bound, n in zip([*bounds, math.inf], counts, strict=True):
            running += n
            le = "+Inf" if math.isinf(bound) else repr(float(bound))
            buckets.append((le, float(running)))
        fam.add_metric([(labels or {})[k] for k in keys], buckets, float(total))
        self.families.append(fam)

    def histograms(
        self,
        name: str,
        help_text: str,
        label_names: Sequence[str],
        bounds: Sequence[float],
        series: Iterable[tuple[Sequence[str], Sequence[int], float]],
    ) -> None:
        """One histogram family with a series per label set: each of ``series`` is
        ``(label values in the order of label_names, counts, total)``, ``counts`` as in
        :meth:`histogram` (per bucket, one more than ``bounds``).

        Raises:
            ValueError: a ``counts`` not one longer than ``bounds``.
        """
        fam = HistogramMetricFamily(name, help_text, labels=list(label_names))
        les = [repr(float(b)) for b in bounds] + ["+Inf"]
        for values, counts, total in series:
            if len(counts) != len(les):
                raise ValueError("a histogram needs one count per bound plus one for +Inf")
            running = 0
            buckets: list[tuple[str, float]] = []
            for le, n in zip(les, counts, strict=True):
                running += n
                buckets.append((le, float(running)))
            fam.add_metric(list(values), buckets, float(total))
        self.families.append(fam)

    def text(self) -> Rendered:
        """The families as Prometheus text format 0.0.4 (``generate_latest``)."""
        out = Rendered(generate_latest(_registry(_Families(self.families))).decode())
        out.families = tuple(self.families)
        return out


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


async def open_plugin_listeners(plugin: str, spec: str) -> tuple[list[trio.SocketListener], str]:
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
    """Serves ``render()`` at ``/metrics`` on already-bound listeners, with the process
    collector's families (``process_cpu_seconds_total``, ``process_resident_memory_bytes``,
    ``process_open_fds``, ...) of this process added.

    The format follows the scraper's ``Accept`` header (prometheus_client's
    ``choose_encoder``): OpenMetrics 1.0 when asked for, else text 0.0.4. A family of
    ``render()`` that the process collector also yields (same name) is left out in favour
    of the collector's, so each name appears once; where /proc is missing the collector
    yields nothing and ``render()``'s own stand in.

    Args:
        listeners: bound TCP listeners (:func:`open_listeners`).
        render: called on the trio thread once per scrape; an :meth:`Exposition.text`
            result (a plain string is served as it is, format 0.0.4 whatever was asked).
        process: add the process collector (default True).
    """

    def __init__(
        self,
        listeners: list[trio.SocketListener],
        render: Callable[[], str],
        *,
        process: bool = True,
    ) -> None:
        self.listeners = listeners
        self.render = render
        self.scrapes = 0
        # Not registered anywhere: read only when a scrape asks (ProcessCollector reads
        # /proc/self, a few small files; the trio thread can afford that per scrape).
        self._process = ProcessCollector(registry=None) if process else None

    async def serve(self) -> None:
        await trio.serve_listeners(self._handle, self.listeners)

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """One scrape: the body and its content type for an ``Accept`` header value."""
        self.scrapes += 1
        rendered = self.render()
        families: tuple[Metric, ...] | None = getattr(rendered, "families", None)
        if families is None:
            return rendered.encode(), CONTENT_TYPE
        collectors: list[Collector] = []
        names: set[str] = set()
        if self._process is not None:
            process = list(self._process.collect())
            names = {m.name for m in process}
            collectors.append(_Families(process))
        collectors.insert(0, _Families(m for m in families if m.name not in names))
        encoder, ctype = choose_encoder(accept or "")
        return encoder(_registry(*collectors)), ctype

    async def _handle(self, stream: trio.abc.Stream) -> None:
        try:
            with trio.move_on_after(_REQUEST_TIMEOUT):
                data = b""
                while b"\r\n\r\n" not in data and b"\n\n" not in data:
                    if len(data) > _MAX_REQUEST:
                        await self._respond(stream, 431, b"request too large\n")
                        return
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    data += chunk
                request_line, _, rest = data.partition(b"\n")
                parts = request_line.split()
                if len(parts) < 2:
                    await self._respond(stream, 400, b"bad request\n")
                    return
                method, target = parts[0], parts[1].split(b"?", 1)[0]
                if method not in (b"GET", b"HEAD"):
                    await self._respond(stream, 405, b"only GET\n", head=False)
                elif target == b"/metrics":
                    body, ctype = self.exposition(_header(rest, b"accept"))
                    await self._respond(stream, 200, body, head=method == b"HEAD", ctype=ctype)
                elif target == b"/":
                    await self._respond(
                        stream, 200, b"msgq-trio: see /metrics\n", head=method == b"HEAD"
                    )
                else:
                    await self._respond(stream, 404, b"not found: try /metrics\n")
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
        body: bytes,
        *,
        head: bool = False,
        ctype: str = "text/plain; charset=utf-8",
    ) -> None:
        reasons = {
            200: "OK",
            400: "Bad Request",
            404: "Not Found",
            405: "Method Not Allowed",
            431: "Request Header Fields Too Large",
        }
        head_bytes = (
            f"HTTP/1.1 {status} {reasons.get(status, 'Error')}\r\n"
            f"Content-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        await stream.send_all(head_bytes if head else head_bytes + body)


def _header(headers: bytes, name: bytes) -> str | None:
    """The value of header ``name`` (lower case) in a raw header block, or None."""
    for line in headers.split(b"\n"):
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip().decode("latin-1")
    return None
