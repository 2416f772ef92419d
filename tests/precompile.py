"""The checkout's bytecode, compiled once before the suite's workers start.

The suite starts many Python processes (brokers, plugins, CLI commands, helper
clients). An editable install leaves the package's sources without bytecode, and where
``PYTHONDONTWRITEBYTECODE`` is set (as in CI sandboxes) no process writes any, so every
one of them compiled each module it imports from source: a large part of each start's
CPU, and so of the suite's. Compiling once writes the caches those processes then only
read. A source changed later is recompiled by the import system's timestamp check, so a
stale cache cannot change what runs.
"""

from __future__ import annotations

import compileall
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The checkout's Python folders: the package (with its plugins, storage and scenarios
#: folders) and the benchmark and test helpers that tests run as scripts.
SOURCE_DIRS = ("msgq_trio", "plugins", "storage", "scenarios", "benchmarks", "tests")


def compile_checkout(root: Path = ROOT) -> None:
    """Write the bytecode of every source under ``root``'s :data:`SOURCE_DIRS`; a folder
    that cannot be written (a read-only checkout) is left as it is."""
    for name in SOURCE_DIRS:
        if (root / name).is_dir():
            compileall.compile_dir(root / name, quiet=2, workers=0)
