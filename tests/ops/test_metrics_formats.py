"""The broker's metrics endpoint through prometheus_client: the format follows the
scraper's ``Accept`` header (OpenMetrics or text 0.0.4), the process collector's families
are there, and each family appears once (the broker's own ``process_*`` figures give way
to the collector's)."""

from __future__ import annotations

import urllib.request

import trio
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

import msgq_trio

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def get(address: str, accept: str | None) -> tuple[str, str]:
    """GET http://ADDRESS/metrics with an ``Accept`` header (or none): (type, body)."""
    req = urllib.request.Request(f"http://{address}/metrics")
    if accept is not None:
        req.add_header("Accept", accept)
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
        return r.headers["Content-Type"], r.read().decode()


def type_lines(text: str) -> list[str]:
    return [ln.split()[2] for ln in text.splitlines() if ln.startswith("# TYPE ")]


async def test_openmetrics_on_request_and_process_collector(broker_factory) -> None:
    """``Accept: application/openmetrics-text``: an OpenMetrics body (``# EOF``, parsed
    by prometheus_client's strict OpenMetrics parser) with the broker's counters, named
    without ``_total`` as OpenMetrics wants, and the process collector's families of the
    broker process; without the header the same figures come as text 0.0.4. Either way
    no family name appears twice."""
    b = broker_factory("--metrics", "127.0.0.1:0")
    async with msgq_trio.connect(b.path, name="m") as bus:
        address = (await bus.call("msgq", "stats"))["metrics"]["address"]
        for i in range(3):  # a group nobody is in: three no-recipient drops
            await bus.send("Nobody", i)
        await bus.call("msgq", "ping")
        ctype, om = await trio.to_thread.run_sync(get, address, OPENMETRICS)
        plain_type, plain = await trio.to_thread.run_sync(get, address, None)

    assert ctype.startswith("application/openmetrics-text; version=1.0.0"), ctype
    assert om.endswith("# EOF\n")
    fams = {f.name: f for f in openmetrics_families(om)}
    dropped = fams["msgq_messages_dropped"]
    assert dropped.type == "counter"
    assert {
        s.labels["reason"]: s.value
        for s in dropped.samples
        if s.name == "msgq_messages_dropped_total"
    }["no-recipient"] == 3
    assert fams["msgq_connections"].type == "gauge"
    assert fams["msgq_connections"].samples[0].value == 1
    rss = fams["process_resident_memory_bytes"].samples[0].value
    assert rss > 1 << 20  # a Python broker holds more than a MiB
    assert fams["process_open_fds"].samples[0].value > 3
    assert "process_cpu_seconds" in fams and "process_start_time_seconds" in fams
    assert len(type_lines(om)) == len(set(type_lines(om))), type_lines(om)

    assert plain_type.startswith("text/plain; version=0.0.4"), plain_type
    assert len(type_lines(plain)) == len(set(type_lines(plain))), type_lines(plain)
    plain_fams = {f.name: f for f in text_string_to_metric_families(plain)}
    assert set(plain_fams) == set(fams)
    assert plain_fams["process_virtual_memory_bytes"].samples[0].value > 0
