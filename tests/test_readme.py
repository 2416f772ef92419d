"""Every ```python example in README.md runs as written against a real broker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)

# What each example must print (by its position in the README).
EXPECTED = {
    0: ["There are 42 zones", "Bad luck happened: no-recipient", "message from ZoneMgr"],
    1: ["Auth accepted a connection on the socket it was handed"],
    2: ["There are 42 zones"],
    3: ["There are 42 zones", "Bad luck happened: no-recipient"],
    4: ["line 0", "line 1", "line 2"],
}


def test_readme_has_the_examples_we_check() -> None:
    """The README keeps its examples, and each has expectations here."""
    assert len(EXAMPLES) == len(EXPECTED)


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(broker_factory: Any, index: int) -> None:
    """Run example ``index`` in a fresh interpreter with $MSGQ_TRIO_SOCKET set (against a
    broker running the pipe plugin for the named-pipe examples)."""
    broker = broker_factory(*(("--plugin", "pipe") if ".pipe(" in EXAMPLES[index] else ()))
    env = dict(os.environ, MSGQ_TRIO_SOCKET=str(broker.path))
    result = subprocess.run(
        [sys.executable, "-c", EXAMPLES[index]], env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    for line in EXPECTED[index]:
        assert line in result.stdout, result.stdout
