"""The benchmark harness is a top-level package of the checkout (benchmarks/), not part of
the installed msgq_trio: put the checkout on sys.path, whatever started pytest."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
