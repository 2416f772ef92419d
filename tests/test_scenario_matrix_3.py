"""Part 3 of the fault scenario matrix: one test per scenario file (every
``MATRIX_PARTS``-th of scenarios/*.toml; test_scenarios.py says why it is split).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_scenarios import check_scenario, matrix_part


@pytest.mark.parametrize("path", matrix_part(3))
def test_scenario(path: Path) -> None:
    check_scenario(path)
