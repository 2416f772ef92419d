"""What a broker's start loads: a broker without a metrics endpoint does not import the
metrics library, and reading the installed plugins' access declarations (done at every
start, plugins/loader.py) does not import what the queue plugin runs (its store, LMDB).
Every broker, plugin host and CLI command pays for its imports at each start."""

from __future__ import annotations

import json
import subprocess
import sys

#: The modules ``serve`` imports on its way to listening, and the start's own call that
#: loads every installed plugin's entry object.
START = """
import json, sys
import msgq_trio.cli
from msgq_trio.io.server import Server
from msgq_trio.ops import control, serve
from msgq_trio.plugins.loader import access_declarations, installed_plugins
assert "queue" in installed_plugins()
access_declarations([])
print(json.dumps(sorted(sys.modules)))
"""


def test_a_broker_start_loads_neither_prometheus_nor_the_queue_store() -> None:
    out = subprocess.run(
        [sys.executable, "-c", START], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = set(json.loads(out.stdout))
    assert "msgq_trio.plugins.queue" in loaded  # the declaration was read
    heavy = {"prometheus_client", "msgq_trio.exposition", "lmdb", "msgq_trio.plugins.queue.runner"}
    assert loaded & heavy == set()
