"""Sphinx configuration of the API reference (``python -m sphinx -W -b html docs/api OUT``).

Built by tests/test_api_docs.py with warnings as errors: a docstring that Sphinx cannot
parse fails the test suite. The package is imported from the checkout (or wherever it is
installed), so the reference always shows the docstrings of the code next to it.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The checkout's root, so an uninstalled tree documents itself.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgq_trio

project = "msgq_trio"
author = "msgq_trio contributors"
release = version = msgq_trio.__version__
copyright = "msgq_trio contributors, MIT licence"

extensions = [
    "sphinx.ext.autodoc",
    # The docstrings use Google style (Args:, Returns:, Raises:).
    "sphinx.ext.napoleon",
]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# Show the signatures as written (``from __future__ import annotations`` strings).
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_custom_sections = [("Resource handling", "notes_style"), ("Error handling", "notes_style")]
exclude_patterns = ["_build"]
html_theme = "alabaster"
