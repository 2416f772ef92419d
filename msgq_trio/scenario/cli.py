"""``msgq-trio scenario run|list|check|report``: the command line of the fault runner.

``run`` prints one line per scenario (verdict, duration, key figures), the failed checks
of a failing one, appends JSON records with ``--results`` and regenerates docs/FAULTS.md
with ``--faults-md``. Exit status: 0 all passed, 1 a scenario failed, 2 invalid
scenario file or usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .model import ScenarioError, is_slow, load_scenario
from .report import faults_markdown, latest_records, machine_info
from .runner import Interrupted, run_scenario


def default_dir() -> Path:
    """``scenarios/`` in the current directory, else the scenarios installed with the
    package (``msgq_trio/scenarios/``, package data of a wheel), else the ``scenarios/``
    of the source checkout this package runs from (an editable install)."""
    here = Path("scenarios")
    if here.is_dir():
        return here
    package = Path(__file__).resolve().parents[1]
    installed = package / "scenarios"
    if installed.is_dir():
        return installed
    return package.parent / "scenarios"


def all_scenarios(directory: Path | None = None) -> list[Path]:
    """Every ``*.toml`` in the scenario directory, sorted by name."""
    return sorted((directory or default_dir()).glob("*.toml"))


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="msgq-trio scenario",
                                 description=(__doc__ or "").replace("``", ""))
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run scenarios")
    p.add_argument("paths", nargs="*", type=Path, help="scenario files")
    p.add_argument("--all", action="store_true", help="every scenario in --dir")
    p.add_argument("--fast", action="store_true", help="every scenario not marked slow")
    p.add_argument("--dir", type=Path, default=None, help="scenario directory (scenarios/)")
    p.add_argument("--results", type=Path, default=None, help="append JSON Lines records")
    p.add_argument("--faults-md", type=Path, default=None, help="regenerate this FAULTS.md")
    p.add_argument("--keep", action="store_true", help="keep temporary directories")
    p = sub.add_parser("list", help="list scenarios")
    p.add_argument("--dir", type=Path, default=None)
    p = sub.add_parser("check", help="validate scenario files without running them")
    p.add_argument("paths", nargs="+", type=Path)
    p = sub.add_parser("report", help="write FAULTS.md from a results file")
    p.add_argument("results", type=Path)
    p.add_argument("--faults-md", type=Path, required=True)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``msgq-trio scenario``; returns the exit status."""
    args = _build_parser().parse_args(argv)
    if args.cmd == "list":
        for path in all_scenarios(args.dir):
            try:
                sc = load_scenario(path)
            except ScenarioError as exc:
                print(f"{path.stem:<36} INVALID {exc}")
                continue
            summary = sc.summary if len(sc.summary) <= 90 else sc.summary[:87] + "..."
            print(f"{sc.name:<36} {'slow' if sc.slow else 'fast'}  {summary}")
        return 0
    if args.cmd == "check":
        status = 0
        for path in args.paths:
            try:
                load_scenario(path)
            except ScenarioError as exc:
                print(exc, file=sys.stderr)
                status = 2
            else:
                print(f"{path}: ok")
        return status
    if args.cmd == "report":
        records = _read_records(args.results)
        args.faults_md.write_text(faults_markdown(latest_records(records)))
        print(f"wrote {args.faults_md} from {len(records)} records")
        return 0
    return _run(args)


def _read_records(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for raw in text.splitlines():
        line = raw.strip()
        if line:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


def _run(args: argparse.Namespace) -> int:
    paths: list[Path] = list(args.paths)
    if args.all or args.fast:
        paths += [p for p in all_scenarios(args.dir) if not (args.fast and is_slow(p))]
    if not paths:
        print("msgq-trio scenario run: give scenario files, --all or --fast", file=sys.stderr)
        return 2
    # Validate everything first: a typo in the last file should not cost a full run.
    try:
        for p in paths:
            load_scenario(p)
    except ScenarioError as exc:
        print(f"msgq-trio scenario run: {exc}", file=sys.stderr)
        return 2
    machine = machine_info()
    records: list[dict[str, Any]] = []
    failed: list[str] = []
    t = time.monotonic()
    print(
        f"running {len(paths)} scenario(s) on {machine['hostname']} "
        f"({machine['nproc']} x {machine['cpu_model']}, {machine['python']})",
        flush=True,
    )
    for p in paths:
        try:
            result = run_scenario(p, keep_tmp=args.keep)
        except Interrupted as exc:
            print(f"msgq-trio scenario run: interrupted ({exc}); cleaned up", flush=True)
            return 143
        rec = result.record(machine)
        records.append(rec)
        print(result.line(), flush=True)
        if not result.passed:
            failed.append(result.scenario.name)
            for f in result.failures:
                print("    " + f.replace("\n", "\n      "), flush=True)
            print("    --- broker log (tail) ---", flush=True)
            for line in result.broker_log_tail.splitlines()[-15:]:
                print("      " + line, flush=True)
        if args.results is not None:
            with open(args.results, "a") as out:
                out.write(json.dumps(rec) + "\n")
    elapsed = time.monotonic() - t
    print(
        f"{len(paths) - len(failed)} passed, {len(failed)} failed in {elapsed:.0f} s"
        + (f": {', '.join(failed)}" if failed else "")
    )
    if args.faults_md is not None:
        if args.all:
            md_records = records
        else:
            # A partial run: keep the other scenarios' newest rows from the results file.
            old = _read_records(args.results) if args.results is not None else []
            md_records = latest_records(old + records)
        args.faults_md.write_text(faults_markdown(md_records))
        print(f"wrote {args.faults_md}")
    return 1 if failed else 0
