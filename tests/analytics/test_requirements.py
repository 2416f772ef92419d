"""The bus never needs pyspark; ``msgq-trio analyze`` says what to install when pyspark or
Java is missing (exit status 3) instead of a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
        stdin=subprocess.DEVNULL,
    )


def test_importing_the_bus_does_not_import_pyspark() -> None:
    r = _run(
        "import json, sys, msgq_trio, msgq_trio.cli, msgq_trio.analytics, "
        "msgq_trio.analytics.cli; print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('pyspark', 'py4j', 'pyarrow'))))"
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_missing_pyspark_is_explained(short_tmp: Path) -> None:
    (short_tmp / "capture-000001.jsonl").write_text("{}\n")
    r = _run(
        "import sys; sys.modules['pyspark'] = None\n"  # makes `import pyspark` fail
        "from msgq_trio.cli import main\n"
        f"sys.exit(main(['analyze', 'capture', {str(short_tmp)!r}, '--out', "
        f"{str(short_tmp / 'out')!r}]))"
    )
    assert r.returncode == 3, r.stderr
    assert "pyspark not installed" in r.stderr and "msgq-trio[spark]" in r.stderr
    assert "openjdk-17-jre-headless" in r.stderr and "Traceback" not in r.stderr


def test_missing_java_is_explained(short_tmp: Path) -> None:
    (short_tmp / "capture-000001.jsonl").write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(short_tmp)  # no java there
    r = _run(
        "import sys\nfrom msgq_trio.cli import main\n"
        f"sys.exit(main(['analyze', 'scenarios', {str(short_tmp)!r}, '--out', "
        f"{str(short_tmp / 'out')!r}]))",
        env=env,
    )
    assert r.returncode == 3, r.stderr
    assert "no 'java' on PATH" in r.stderr and "openjdk-17-jre-headless" in r.stderr
