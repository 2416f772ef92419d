"""Write tests/file_costs.json, the recorded time of each work unit of the suite, from a
``--junitxml`` report of a run (setup, call and teardown of every test, summed per file
or per shared-setup group as tests/longest_first.py groups them).

    .venv/bin/python -m pytest -n 6 --dist loadfile --junitxml=/tmp/junit.xml
    python3 tests/stress/file_costs.py /tmp/junit.xml

The figures only order the files (longest first); record them from a quiet machine so
their ratios are right, and again when a file's time changes a lot.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from longest_first import COSTS_FILE, unit_of  # noqa: E402


def unit_times(junit_xml: Path) -> dict[str, float]:
    """{unit: seconds} from a junit report: pytest's classname is the file's dotted path
    (``tests.core.test_router`` or ``tests.core.test_router.TestX`` for a class)."""
    files = {str(p.relative_to(TESTS.parent)) for p in TESTS.rglob("test_*.py")}
    dotted = {f.removesuffix(".py").replace("/", "."): f for f in files}
    out: dict[str, float] = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        path = next(
            (
                dotted[".".join(parts[:n])]
                for n in range(len(parts), 0, -1)
                if ".".join(parts[:n]) in dotted
            ),
            None,
        )
        if path is None:
            continue
        unit = unit_of(path)
        out[unit] = out.get(unit, 0.0) + float(case.get("time", "0"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit_xml", type=Path)
    ap.add_argument("--out", type=Path, default=COSTS_FILE)
    args = ap.parse_args(argv)
    times = unit_times(args.junit_xml)
    ordered = dict(sorted(((k, round(v, 1)) for k, v in times.items()), key=lambda kv: -kv[1]))
    args.out.write_text(json.dumps(ordered, indent=1) + "\n", encoding="utf-8")
    total = sum(times.values())
    print(f"{len(times)} units, {total:.0f} s in all, longest {next(iter(ordered.items()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
