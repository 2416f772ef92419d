"""benchmarks/instr.py runs on this tree with tiny counts and produces its figures (what
they are worth is for BENCHMARKS.md; nothing here asserts a speed)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks import instr

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_round_trip_syscalls_per_call(tmp_path: Path) -> None:
    """A real broker, responder and requester under strace: every role's system calls per
    call are reported, and each side of a round trip reads, writes and waits at least
    once per call."""
    out = tmp_path / "figures.json"
    rc = instr.main(
        [
            "--checkout",
            str(ROOT),
            "--workloads",
            "req-reply",
            "--tools",
            "strace",
            "--n",
            "30",
            "--base",
            "5",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    figures = json.loads(out.read_text())
    assert figures["n"] == 30
    per_role = figures["workloads"]["req-reply"]["strace"]
    assert set(per_role) == {"broker", "req", "resp"}
    for role, calls in per_role.items():
        # The broker reads the request and the answer and writes each on: two of each.
        least = 2 if role == "broker" else 1
        for name in ("epoll_wait", "write"):
            assert calls.get(name, 0) >= least * 0.9, (role, calls)
        assert calls["total"] > 0


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_instructions_read_from_callgrind_output(tmp_path: Path) -> None:
    """The instruction count is read from callgrind's own output file (a tiny program,
    so the test stays fast; the workloads' runs take minutes under valgrind)."""
    cg = tmp_path / "true.cg"
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={cg}",
            "--log-file=/dev/null",
            "true",
        ],
        check=True,
    )
    assert instr._instructions(cg) > 1000


def test_unknown_workload_or_tool_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["--workloads", "nope"], ["--tools", "perf"]):
        with pytest.raises(SystemExit) as exc:
            instr.main(args)
        assert exc.value.code == 2
        assert "unknown" in capsys.readouterr().err


def test_python_calls_read_from_a_profile(tmp_path: Path) -> None:
    """The calls figures are cProfile's counts per function, built-ins named without
    their address (so that the processes of one role add up)."""
    import cProfile

    def leaf() -> int:
        return len(object.__new__(object).__class__.__name__)

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(7):
        leaf()
    prof.disable()
    path = tmp_path / "p.prof"
    prof.dump_stats(path)
    calls = instr._calls(path)
    assert calls[next(k for k in calls if k.endswith(":leaf"))] == 7
    assert calls["<built-in method builtins.len>"] == 7
    assert not any(" at 0x" in k for k in calls)
