"""Scenario-based fault runner: ``msgq-trio scenario run [PATH...|--all]``.

A scenario (``scenarios/*.toml``, validated by :mod:`.model`) names the broker's flags,
client processes and their behaviour (:mod:`.clients`, run as real processes), faults and
when they strike (:mod:`.faults`), and the expected outcome. :func:`.runner.run_scenario`
runs one against a real broker process and returns every figure and check;
:mod:`.report` writes docs/FAULTS.md from the JSON Lines records; :mod:`.cli` is the
command line. tests/test_scenario_matrix_*.py run every scenario under pytest.
"""
