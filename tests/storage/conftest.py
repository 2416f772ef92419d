"""Makes ``conformance`` importable from the backend test modules of this directory."""

from __future__ import annotations

import sys
from pathlib import Path

# pytest's default "prepend" import mode already puts this directory on sys.path before
# importing a test module here; doing it in the conftest as well keeps the import working
# under --import-mode=importlib, which does not.
_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
