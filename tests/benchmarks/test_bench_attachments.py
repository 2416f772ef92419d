"""Smoke run of the attachment benchmark (blob and descriptor throughput, fairness) with
tiny counts: every workload completes through real broker and client processes and
reports its figures; a broken workload makes the run exit non-zero."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import child_env


def test_attachment_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "attach.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.attachments",
            "--blobs",
            "2",
            "--fds",
            "50",
            "--repeat",
            "1",
            "--fair",
            "--timeout",
            "60",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert set(res) == {"blob", "fair", "fds"}
    assert res["blob"]["median"] > 0 and res["blob"]["unit"] == "MB/s"
    assert res["fds"]["median"] > 0 and res["fds"]["n"] == 50
    assert res["fair"]["calls"]["min"] >= 1
    assert 0 < res["fair"]["p50_us"]["median"] <= res["fair"]["p99_us"]["median"]
    assert "small calls alongside" in proc.stdout
