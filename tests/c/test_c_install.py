"""libmsgq as a C library: meson installs libmsgq.so, the headers and a pkg-config file,
and a program builds against the installed copy with pkg-config alone; the C++ example
in docs/C-CLIENT.md is the one the tests build and run."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from libmsgq_build import C_DIR, meson_build

DOC = C_DIR.parents[1] / "docs" / "C-CLIENT.md"

PROGRAM = r"""
#include <stdio.h>
#include <msgq/msgq.h>

int main(void) {
    msgq_options o;
    msgq_options_init(&o);
    printf("%s %u\n", msgq_code_name(MSGQ_CODE_NO_RECIPIENT), o.max_frame_size);
    return msgq_code_from_name("recipient-gone") == MSGQ_CODE_RECIPIENT_GONE ? 0 : 1;
}
"""


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    prefix = tmp_path_factory.mktemp("prefix")
    build = tmp_path_factory.mktemp("libmsgq") / "install"
    meson_build(build, f"--prefix={prefix}", "--libdir=lib")
    r = subprocess.run(
        ["meson", "install", "-C", str(build)], capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        pytest.fail(f"meson install failed:\n{r.stdout}\n{r.stderr}")
    return prefix


def test_install_layout(installed: Path) -> None:
    """The shared library (with its soname link), both headers, the pkg-config file and
    msgq-c are installed."""
    for rel in (
        "lib/libmsgq.so",
        "lib/libmsgq.so.0",
        "include/msgq/msgq.h",
        "include/msgq/msgq.hpp",
        "lib/pkgconfig/libmsgq.pc",
        "bin/msgq-c",
    ):
        assert (installed / rel).exists(), rel


def test_program_builds_with_pkg_config(installed: Path, tmp_path: Path) -> None:
    """``cc app.c $(pkg-config --cflags --libs libmsgq)`` against the installed copy."""
    env = {**os.environ, "PKG_CONFIG_PATH": str(installed / "lib" / "pkgconfig")}
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "libmsgq"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.split()
    src = tmp_path / "app.c"
    src.write_text(PROGRAM)
    exe = tmp_path / "app"
    subprocess.run(
        ["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", str(src), "-o", str(exe), *flags],
        check=True,
        env=env,
    )
    r = subprocess.run(
        [str(exe)],
        capture_output=True,
        text=True,
        env={**env, "LD_LIBRARY_PATH": str(installed / "lib")},
        check=False,
    )
    assert (r.returncode, r.stdout) == (0, f"no-recipient {64 * 1024 * 1024}\n")


def test_doc_example_is_the_built_one() -> None:
    """docs/C-CLIENT.md shows clients/c/examples/component.cpp verbatim."""
    blocks = re.findall(r"```cpp\n(.*?)```", DOC.read_text(), re.S)
    assert blocks == [(C_DIR / "examples" / "component.cpp").read_text()]
