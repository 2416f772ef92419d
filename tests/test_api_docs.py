"""The API reference (docs/api) builds with Sphinx, warnings as errors, and documents
the public client API: a docstring Sphinx cannot parse, or a documented name that no
longer exists, fails this test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("sphinx", reason="sphinx is in the dev extra: pip install -e '.[dev]'")

#: Objects the reference must describe (anchors in the HTML), one per public area.
EXPECTED = {
    "client.html": [
        "msgq_trio.connect",
        "msgq_trio.Bus.call",
        "msgq_trio.Bus.subscribe",
        "msgq_trio.Message.body",
        "msgq_trio.connect_direct",
        "msgq_trio.DirectBus.call",
        "msgq_trio.Reconnect",
        "msgq_trio.Bus.wait_connected",
    ],
    "sync.html": [
        "msgq_trio.sync.connect",
        "msgq_trio.sync.SyncBus",
        "msgq_trio.sync.SyncBus.call",
    ],
    "aio.html": [
        "msgq_trio.aio.connect",
        "msgq_trio.aio.AioBus",
        "msgq_trio.aio.AioBus.call",
        "msgq_trio.aio.AioBus.queue",
        "msgq_trio.aio.AioPipeReader.read",
    ],
    "queue.html": ["msgq_trio.client.queue.Queue", "msgq_trio.client.queue.QueueMessage"],
    "pipe.html": [
        "msgq_trio.client.pipe.PipeReader",
        "msgq_trio.client.pipe.PipeReader.read",
        "msgq_trio.client.pipe.PipeWriter",
        "msgq_trio.client.pipe.PipeWriter.write",
    ],
    "tracing.html": [
        "msgq_trio.client.tracing.start_trace",
        "msgq_trio.client.tracing.continued",
    ],
    "errors.html": [
        "msgq_trio.errors.RpcError",
        "msgq_trio.errors.NoRecipient",
        "msgq_trio.errors.ConnectError",
    ],
}


def test_api_reference_builds_without_warnings(tmp_path: Path) -> None:
    """``python -m sphinx -W -b html docs/api OUT`` exits 0 (any warning fails it, and
    ``--keep-going`` lists them all) and the pages hold the public names."""
    out = tmp_path / "html"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-d",
            str(tmp_path / "doctrees"),
            str(ROOT / "docs" / "api"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-5000:]
    for page, names in EXPECTED.items():
        html = (out / page).read_text()
        missing = [n for n in names if f'id="{n}"' not in html]
        assert not missing, f"{page} lacks {missing}"
