"""Every ```python example in README.md runs as written against a real broker, and the
README's test command is the one CI and the loaded-machine helper run."""

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
    2: ["Auth accepted a connection on the socket it was handed (asyncio)"],
    3: ["There are 42 zones"],
    4: ["There are 42 zones", "Bad luck happened: no-recipient"],
    5: ["line 0", "line 1", "line 2"],
    6: ["There are 42 zones", "Bad luck happened: no-recipient", "message from ZoneMgr"],
    7: ["line 0", "line 1", "line 2"],
    8: ["connected; reconnects so far: 0"],
    9: ["asyncio: connected; reconnects so far: 0"],
    10: ["stats saw Zone.added example.com", "stats saw Zone.removed example.org"],
    11: [
        "There are 42 zones",
        "bad-request {'param': 'zone_class'}",
        "get_zone_count ['zone_class: str', 'verbose: bool'] -> int",
    ],
    12: [
        "There are 42 zones",
        "request loadzones cmdctl -> Auth",
        "request get_zone_count Auth -> ZoneMgr",
        "reply - ZoneMgr -> l.",
    ],
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
        [sys.executable, "-c", EXAMPLES[index]],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for line in EXPECTED[index]:
        assert line in result.stdout, result.stdout


def test_ci_and_the_stress_helper_run_the_readmes_test_command() -> None:
    """.ci/run calls the README's test command verbatim (a user and CI run the same
    suite, the same way); tests/stress/loaded.py takes its pytest part from the README."""
    sys.path.insert(0, str(README.parent / "tests" / "stress"))
    try:
        import loaded
    finally:
        sys.path.pop(0)
    command = loaded.readme_test_command(README.read_text())
    assert "-m pytest" in command.split("&&")[-1]
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert command in ci, f".ci/run does not run the README's command {command!r}"
    cwd = os.getcwd()
    os.chdir(README.parent)
    try:
        assert loaded.default_command() == ["bash", "-c", command.split("&&")[-1].strip()]
    finally:
        os.chdir(cwd)
