"""The Prometheus endpoint of a real broker, read over TCP and parsed with
prometheus_client's own text parser."""

from __future__ import annotations

import trio
from ops_helpers import http_get
from prometheus_client.parser import text_string_to_metric_families

import msgq_trio
from msgq_trio.protocol.codes import FrameType


async def test_metrics_endpoint_parses_and_counts(broker_factory, raw_peer) -> None:
    """``serve --metrics 127.0.0.1:0``: ``GET /metrics`` is valid exposition text whose
    figures follow the traffic: connections, messages and bytes both ways (including
    clients that left), disconnects by reason, messages dropped for want of a recipient,
    pending requests, capture drops."""
    b = broker_factory("--metrics", "127.0.0.1:0")
    async with (
        msgq_trio.connect(b.path, name="m") as bus,
        msgq_trio.connect(b.path, name="n") as other,
    ):
        address = (await bus.call("msgq", "stats"))["metrics"]["address"]
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        await other.subscribe("G")
        for i in range(25):
            await bus.send("G", {"i": i})
        for _ in range(25):
            await other.receive(timeout=10)
        for i in range(3):  # a group nobody is in: counted as dropped, no-recipient
            await bus.send("Nobody", i)
        await bus.call("msgq", "ping")  # after the three in the broker's order
        async with raw_peer(b.path) as raw:
            assert (await raw.hello("vandal")).type == FrameType.WELCOME
            await raw.send_bytes(b"\x00\x00\x00\x1c" + b"\xee" * 28)
            await raw.frames_until_eof(timeout=5)

        async def scrape() -> dict[str, dict]:
            status, headers, body = await http_get(address)
            assert status == 200
            assert headers["content-type"].startswith("text/plain; version=0.0.4")
            out: dict[str, dict] = {}
            for fam in text_string_to_metric_families(body):
                out[fam.name] = {"type": fam.type, "samples": fam.samples}
            return out

        fams = await scrape()
        with trio.fail_after(5):
            while fams["msgq_disconnects"]["samples"] == []:
                fams = await scrape()

        def value(name: str, **labels: str) -> float:
            for s in fams[name]["samples"]:
                if all(s.labels.get(k) == v for k, v in labels.items()):
                    return float(s.value)
            raise AssertionError(f"no sample {name} {labels}: {fams[name]['samples']}")

        assert fams["msgq_connections"]["type"] == "gauge"
        assert value("msgq_connections") == 2
        assert fams["msgq_messages_received"]["type"] == "counter"
        assert value("msgq_messages_received") >= 27
        assert value("msgq_messages_sent") >= 25
        assert value("msgq_bytes_received") > 0 and value("msgq_bytes_sent") > 0
        assert value("msgq_connections_accepted") == 3
        assert value("msgq_disconnects", reason="protocol-error") == 1
        assert value("msgq_pending_requests") == 0
        assert value("msgq_capture_records_dropped") == 0
        assert value("msgq_messages_dropped", reason="no-recipient") == 3
        assert value("msgq_messages_dropped", reason="sender-gone") == 0
        assert value("msgq_paused_readers") == 0
        assert value("msgq_build_info", version=msgq_trio.__version__) == 1
        for name in (
            "msgq_queued_bytes",
            "msgq_request_timeouts",
            "msgq_control_refusals",
            "msgq_uptime_seconds",
            "process_open_fds",
            "msgq_dump_clients",
        ):
            assert name in fams, name
        status, _, _ = await http_get(address, "/elsewhere")
        assert status == 404
        assert (await bus.call("msgq", "stats"))["metrics"]["scrapes"] >= 1
