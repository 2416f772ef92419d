"""The suite compiles the checkout's bytecode before its workers start (tests/conftest.py
``pytest_configure``, tests/precompile.py), so the processes it starts read cached
bytecode instead of each compiling the package from source where
``PYTHONDONTWRITEBYTECODE`` is set."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

from precompile import ROOT, SOURCE_DIRS


def _valid_cache(source: Path) -> bool:
    """A timestamp-checked cache that the import system would use for ``source``."""
    cache = Path(importlib.util.cache_from_source(str(source)))
    try:
        header = cache.read_bytes()[:16]
    except OSError:
        return False
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    flags, mtime, size = struct.unpack("<III", header[4:16])
    st = source.stat()
    return flags == 0 and mtime == int(st.st_mtime) & 0xFFFFFFFF and size == st.st_size & 0xFFFFFFFF


def test_every_source_of_the_checkout_has_current_bytecode() -> None:
    sources = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(sources) > 100  # the folders were found
    stale = [str(p.relative_to(ROOT)) for p in sources if not _valid_cache(p)]
    assert stale == []
