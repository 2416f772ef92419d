"""Fixtures of the web console's tests (defined in console_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from console_helpers import component, console_factory, viewer

__all__ = ["component", "console_factory", "viewer", "write_config"]


@pytest.fixture
def write_config(short_tmp: Path) -> Callable[[str], Path]:
    """``write_config(toml_text)`` writes ``broker.toml``; returns its path."""
    path = short_tmp / "broker.toml"

    def write(text: str) -> Path:
        path.write_text(text)
        return path

    return write
