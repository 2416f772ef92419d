"""Fixtures of the operations tests (helpers: ops_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def write_config(short_tmp: Path) -> Callable[[str], Path]:
    """``write_config(toml_text)`` writes (or rewrites) ``broker.toml``; returns its path."""
    path = short_tmp / "broker.toml"

    def write(text: str) -> Path:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # atomic, like an operator's editor
        return path

    return write
