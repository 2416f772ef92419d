"""``msgq-trio scenario run|list|check|report|new``: the command line of the fault runner.

``run`` prints one line per scenario (verdict, duration, key figures, seed), the failed
checks of a failing one, appends JSON records with ``--results``, writes JUnit XML with
``--junit`` and regenerates docs/FAULTS.md with ``--faults-md``; ``--repeat N`` runs each
N times with seeds ``--seed``, +1, ... ``new NAME`` writes a commented template. A
scenario this machine cannot run (network namespaces without root, TLS without openssl)
is printed as SKIP with the reason and is neither passed nor failed. Exit status: 0 none
failed, 1 a scenario failed, 2 invalid scenario file or usage, 128 + the signal when
SIGINT (Ctrl-C), SIGTERM or SIGHUP stopped the run (after it killed what it started).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .model import ScenarioError, is_slow, load_scenario, with_params
from .report import faults_markdown, latest_records, long_haul_section, machine_info
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


def resolve(arg: Path, directory: Path | None = None) -> Path:
    """The scenario file ``arg`` names: the file itself if it exists, else the scenario of
    that name (``NAME`` or ``NAME.toml``, as ``msgq-trio scenario list`` shows it) in
    ``directory`` (default :func:`default_dir`).

    Raises:
        ScenarioError: neither a file nor a known scenario name.
    """
    if arg.exists() or arg.parent != Path("."):
        return arg  # a path: read (and its errors reported) as given
    where = directory or default_dir()
    name = arg.name.removesuffix(".toml")
    candidate = where / f"{name}.toml"
    if candidate.is_file():
        return candidate
    known = [p.stem for p in all_scenarios(where)]
    raise ScenarioError(
        f"{arg}: no such file, and no scenario of that name in {where} "
        f"({len(known)} there; msgq-trio scenario list shows them)"
    )


def _unrun(records: Sequence[dict[str, Any]]) -> list[str]:
    """The shipped scenarios with no run among ``records`` (skipped on that machine:
    a skipped run writes no record; or not run at all)."""
    ran = {r["scenario"] for r in records if not r.get("skipped")}
    return [p.stem for p in all_scenarios() if p.stem not in ran]


def _build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="msgq-trio scenario", description=(__doc__ or "").replace("``", "")
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run scenarios")
    p.add_argument(
        "paths",
        nargs="*",
        type=Path,
        help="scenario files, or names as 'msgq-trio scenario list' shows them",
    )
    p.add_argument("--all", action="store_true", help="every scenario in --dir")
    p.add_argument("--fast", action="store_true", help="every scenario not marked slow")
    p.add_argument("--dir", type=Path, default=None, help="scenario directory (scenarios/)")
    p.add_argument("--results", type=Path, default=None, help="append JSON Lines records")
    p.add_argument("--faults-md", type=Path, default=None, help="regenerate this FAULTS.md")
    p.add_argument("--keep", action="store_true", help="keep temporary directories")
    p.add_argument(
        "--repeat",
        type=_positive,
        default=1,
        metavar="N",
        help="run each scenario N times (seeds --seed, --seed + 1, ...)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="MSGQ_TRIO_SEED of the first run (default: random, printed)",
    )
    p.add_argument(
        "--junit",
        type=Path,
        default=None,
        metavar="FILE",
        help="write JUnit XML (one testcase per run) for CI systems",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long a soak scenario runs (its [soak] duration by default)",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        metavar="FILE",
        help="append a soak's broker samples (RSS, fds, faults so far) to FILE as taken",
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="CLIENT.KEY=VALUE",
        help="replace a client's parameter (e.g. a long-haul run's size), repeatable",
    )
    p.add_argument(
        "--latency-scale",
        type=float,
        default=1.0,
        metavar="K",
        help="multiply the latency bounds by K (>= 1) on a machine busy with other work",
    )
    p = sub.add_parser("new", help="write a commented scenario template")
    p.add_argument("name", help="scenario name (NAME.toml)")
    p.add_argument("--dir", type=Path, default=Path("."), help="where to write it (.)")
    p = sub.add_parser("list", help="list scenarios")
    p.add_argument("--dir", type=Path, default=None)
    p = sub.add_parser("check", help="validate scenario files without running them")
    p.add_argument("paths", nargs="+", type=Path, help="scenario files or names")
    p.add_argument("--dir", type=Path, default=None, help="where names are looked up")
    p = sub.add_parser("report", help="write FAULTS.md from a results file")
    p.add_argument("results", type=Path)
    p.add_argument("--faults-md", type=Path, required=True)
    return ap


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``msgq-trio scenario``; returns the exit status."""
    args = _build_parser().parse_args(argv)
    if args.cmd == "new":
        return _new(args.name, args.dir)
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
                load_scenario(resolve(path, args.dir))
            except ScenarioError as exc:
                print(exc, file=sys.stderr)
                status = 2
            else:
                print(f"{path}: ok")
        return status
    if args.cmd == "report":
        records = _read_records(args.results)
        latest = latest_records(records)
        args.faults_md.write_text(
            faults_markdown(latest, unrun=_unrun(latest), kept=_kept(args.faults_md))
        )
        print(f"wrote {args.faults_md} from {len(records)} records")
        return 0
    return _run(args)


def junit_xml(records: Sequence[dict[str, Any]]) -> str:
    """JUnit XML for CI systems: one ``testcase`` per run (name with its seed), a
    ``failure`` with the failed checks and the runner's problems."""
    failures = sum(not r.get("passed") and not r.get("skipped") for r in records)
    suite = ET.Element(
        "testsuite",
        name="msgq-trio scenarios",
        tests=str(len(records)),
        failures=str(failures),
        skipped=str(sum(bool(r.get("skipped")) for r in records)),
        errors="0",
        time=f"{sum(float(r.get('duration_s', 0)) for r in records):.3f}",
    )
    for r in records:
        case = ET.SubElement(
            suite,
            "testcase",
            classname="msgq_trio.scenarios",
            name=f"{r['scenario']}[seed={r.get('seed')}]",
            time=f"{float(r.get('duration_s', 0)):.3f}",
        )
        if r.get("skipped"):
            ET.SubElement(case, "skipped", message=str(r["skipped"])[:200])
        elif not r.get("passed"):
            bad = [
                f"check failed: {c['check']} (expected {c['expected']}, got {c['actual']})"
                for c in r.get("checks", [])
                if not c.get("ok")
            ]
            bad += list(r.get("problems", []))
            fail = ET.SubElement(case, "failure", message=(bad or ["failed"])[0][:200])
            fail.text = "\n".join(bad)
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


TEMPLATE = """\
# A fault scenario (docs/FAULTS.md, "Testing your own system"). Check it with
#   msgq-trio scenario check {name}.toml
# and run it with
#   msgq-trio scenario run {name}.toml --keep
summary = "What happens and what must hold, in one line."
fault = "The fault, in a few words"
broker_does = "What the system does about it"
timeout = 60

[broker]
# plugins = ["queue"]                  # queue, pipe, link
# [broker.plugin.queue.queues.jobs]    # their settings ([plugins.NAME] of the broker)

[[clients]]
name = "service"
role = "exec"                          # your program; {{python}} is this Python
[clients.params]                       # ready once it joined its group; runs until the
ready = "member:Service"               # scenario ends (SIGTERM)
service = true
command = ["{{python}}", "-c", '''
import trio, msgq_trio
async def main():
    async with msgq_trio.connect(name="service") as bus:   # MSGQ_TRIO_SOCKET
        bus.add_command("ping", lambda params: "pong")
        await bus.subscribe("Service")
        await trio.sleep_forever()
trio.run(main)
''']

[[clients]]
name = "caller"
role = "caller"                        # a built-in role: calls Service at a steady rate
params = {{ target = "Service", command = "ping", rate = 100.0, duration = 3.0, reconnect = true }}

[[faults]]
at = 1.0
action = "restart"                     # SIGKILL the program and start it again
target = "service"

[expect.counts]
"caller.ok" = ">= 100"
"service.restarts" = "== 1"

# [expect.history]                     # if your programs append their operations to
# lost = true                          # $MSGQ_TRIO_HISTORY (docs/FAULTS.md)
# silence = 10
"""


def _new(name: str, directory: Path) -> int:
    path = directory / f"{name}.toml"
    if path.exists():
        print(f"msgq-trio scenario new: {path} exists; not overwritten", file=sys.stderr)
        return 2
    path.write_text(TEMPLATE.format(name=name))
    print(f"wrote {path}")
    return 0


def _kept(path: Path) -> str:
    """The long-haul section of the FAULTS.md about to be rewritten (kept in the new)."""
    try:
        return long_haul_section(path.read_text())
    except OSError:
        return ""


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
    try:
        paths = [resolve(p, args.dir) for p in args.paths]
    except ScenarioError as exc:
        print(f"msgq-trio scenario run: {exc}", file=sys.stderr)
        return 2
    if args.all or args.fast:
        paths += [p for p in all_scenarios(args.dir) if not (args.fast and is_slow(p))]
    if not paths:
        print(
            "msgq-trio scenario run: give scenario files or names, --all or --fast",
            file=sys.stderr,
        )
        return 2
    # Validate everything first: a typo in the last file should not cost a full run.
    try:
        for p in paths:
            with_params(load_scenario(p), args.param)
    except ScenarioError as exc:
        print(f"msgq-trio scenario run: {exc}", file=sys.stderr)
        return 2
    machine = machine_info()
    records: list[dict[str, Any]] = []
    failed: list[str] = []
    skipped: list[str] = []
    t = time.monotonic()
    print(
        f"running {len(paths)} scenario(s) on {machine['hostname']} "
        f"({machine['nproc']} x {machine['cpu_model']}, {machine['python']})",
        flush=True,
    )
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big") >> 1
    runs = [(p, seed + k) for p in paths for k in range(args.repeat)]
    for p, run_seed in runs:
        try:
            result = run_scenario(
                p,
                keep_tmp=args.keep,
                seed=run_seed,
                duration=args.duration,
                checkpoint=args.checkpoint,
                params=args.param,
                latency_scale=args.latency_scale,
            )
        except ScenarioError as exc:
            print(f"msgq-trio scenario run: {exc}", file=sys.stderr)
            return 2
        except Interrupted as exc:
            print(f"msgq-trio scenario run: interrupted ({exc}); cleaned up", flush=True)
            return 128 + exc.signum  # as a shell reports a program the signal ended
        rec = result.record(machine)
        records.append(rec)
        print(result.line(), flush=True)
        if result.skipped is not None:
            skipped.append(result.scenario.name)
            continue  # not a run: nothing for the results file
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
        f"{len(runs) - len(failed) - len(skipped)} passed, {len(failed)} failed"
        + (f" ({', '.join(failed)})" if failed else "")
        + (f", {len(skipped)} skipped ({', '.join(skipped)})" if skipped else "")
        + f" in {elapsed:.0f} s"
    )
    if args.junit is not None:
        args.junit.write_text(junit_xml(records))
        print(f"wrote {args.junit}")
    if args.faults_md is not None:
        if args.all:
            md_records = records
        else:
            # A partial run: keep the other scenarios' newest rows from the results file.
            old = _read_records(args.results) if args.results is not None else []
            md_records = latest_records(old + records)
        args.faults_md.write_text(
            faults_markdown(md_records, unrun=_unrun(md_records), kept=_kept(args.faults_md))
        )
        print(f"wrote {args.faults_md}")
    return 1 if failed else 0
