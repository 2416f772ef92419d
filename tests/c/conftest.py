"""Builds of libmsgq and msgq-c (clients/c) for the tests in this folder.

The build is part of the test run: ``meson setup`` + ``meson compile`` into a temporary
directory once per session (per xdist worker), a plain build and one with
``-fsanitize=address,undefined``; every behaviour test runs against both. A missing
compiler, meson or libcbor FAILS the tests with the reason (CI installs them: .ci/run),
it never skips them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from libmsgq_build import SANITIZER_ENV, CBuild, CProcess, meson_build


@pytest.fixture(scope="session")
def c_plain(tmp_path_factory: pytest.TempPathFactory) -> CBuild:
    """The plain build (warnings are errors: -Wall -Wextra -Werror)."""
    d = tmp_path_factory.mktemp("libmsgq") / "plain"
    meson_build(d)
    return CBuild("plain", d, {})


@pytest.fixture(scope="session")
def c_sanitized(tmp_path_factory: pytest.TempPathFactory) -> CBuild:
    """The build with AddressSanitizer (leaks included) and UndefinedBehaviorSanitizer."""
    d = tmp_path_factory.mktemp("libmsgq") / "asan"
    meson_build(d, "-Db_sanitize=address,undefined", "-Db_lundef=false")
    return CBuild("asan", d, SANITIZER_ENV)


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
