"""tests/shared_build.py: a build shared by the workers of a run is made once, by
whichever asks first, and a failed build leaves nothing a later caller would take for
finished."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
from shared_build import DONE, shared_dir


class _Factory:
    """The one method of pytest's TempPathFactory that shared_dir uses."""

    def __init__(self, base: Path) -> None:
        self.base = base

    def getbasetemp(self) -> Path:
        return self.base


def _build_slowly(d: Path) -> None:
    import time

    with open(d.parent / "builds.log", "a") as log:
        log.write("build\n")
    time.sleep(0.3)  # long enough for the other process to ask meanwhile
    (d / "product").write_text("made")


def _ask(base: str) -> str:
    d = shared_dir(_Factory(Path(base)), "x", _build_slowly)
    return (d / "product").read_text()


@pytest.fixture(autouse=True)
def _not_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's root is then the factory's base directory itself (this test's tmp_path),
    also in the processes the test starts, which inherit the environment."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


def test_two_processes_asking_at_once_get_one_build(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        got = pool.map(_ask, [str(tmp_path)] * 2)
    assert got == ["made", "made"]
    assert (tmp_path / "builds.log").read_text() == "build\n"
    assert (tmp_path / "shared-x" / DONE).exists()


def test_a_failed_build_leaves_nothing_and_the_next_caller_builds(tmp_path: Path) -> None:
    factory = _Factory(tmp_path)

    def fail(d: Path) -> None:
        (d / "half").write_text("")
        pytest.fail("the build failed")

    with pytest.raises(pytest.fail.Exception, match="the build failed"):
        shared_dir(factory, "y", fail)
    assert not (tmp_path / "shared-y").exists()
    d = shared_dir(factory, "y", lambda d: (d / "product").write_text("made"))
    assert (d / "product").read_text() == "made" and not (d / "half").exists()
    # a finished build is handed out again without building
    again = shared_dir(factory, "y", lambda d: pytest.fail("built twice"))
    assert again == d
