"""Builds of libmsgq and msgq-c (clients/c) for the tests in this folder.

The build is part of the test run: ``meson setup`` + ``meson compile`` into a temporary
directory once per run (shared by the xdist workers: tests/shared_build.py), a plain
build and one with ``-fsanitize=address,undefined``; every behaviour test runs against
both. A missing compiler, meson or libcbor FAILS the tests with the reason (CI installs
them: .ci/run), it never skips them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from libmsgq_build import SANITIZER_ENV, CBuild, CProcess, meson_build
from shared_build import shared_dir


@pytest.fixture(scope="session")
def c_plain(tmp_path_factory: pytest.TempPathFactory) -> CBuild:
    """The plain build (warnings are errors: -Wall -Wextra -Werror)."""
    d = shared_dir(tmp_path_factory, "libmsgq-plain", lambda d: meson_build(d / "build"))
    return CBuild("plain", d / "build", {})


@pytest.fixture(scope="session")
def c_sanitized(tmp_path_factory: pytest.TempPathFactory) -> CBuild:
    """The build with AddressSanitizer (leaks included) and UndefinedBehaviorSanitizer."""
    d = shared_dir(
        tmp_path_factory,
        "libmsgq-asan",
        lambda d: meson_build(d / "build", "-Db_sanitize=address,undefined", "-Db_lundef=false"),
    )
    return CBuild("asan", d / "build", SANITIZER_ENV)


@pytest.fixture(params=["plain", "asan"])
def cbuild(request: pytest.FixtureRequest) -> CBuild:
    """Each behaviour test runs with the plain and with the sanitized build."""
    name = "c_plain" if request.param == "plain" else "c_sanitized"
    build: CBuild = request.getfixturevalue(name)
    return build


@pytest.fixture
def c_process(broker_factory: object, short_tmp: Path) -> Iterator[Callable[..., CProcess]]:
    """``c_process(build, *args, **popen_kw)`` starts a long-running msgq-c; killed at
    teardown if the test left it running (before the brokers are stopped)."""
    procs: list[CProcess] = []

    def start(build: CBuild, *args: str, **kw: object) -> CProcess:
        p = CProcess([build.msgq_c, *args], build.env, short_tmp / f"c{len(procs)}.err", **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
