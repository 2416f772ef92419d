"""Packaging layout: every package directory is listed in pyproject.toml, and the mapped
top-level directories (plugins/, storage/) are only importable as msgq_trio.plugins /
msgq_trio.storage, never as generic top-level modules. scenarios/ is installed as data
(msgq_trio/scenarios/*.toml in the wheel), not as an importable package. The peer
benchmark (benchmarks/) stays out of the wheel: a wheel built from the repository holds
msgq_trio alone, with no worker or installer for another message bus."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from shared_build import shared_wheel

ROOT = Path(__file__).resolve().parent.parent
#: top-level directory -> the package name it is installed as
MAPPED = {"msgq_trio": "msgq_trio", "plugins": "msgq_trio.plugins", "storage": "msgq_trio.storage"}
#: data-only packages (no code, no __init__.py): installed name -> top-level directory
DATA_PACKAGES = {"msgq_trio.scenarios": "scenarios"}


def setuptools_config() -> dict[str, object]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]  # type: ignore[no-any-return]


def package_dirs() -> dict[str, Path]:
    """Installed package name -> directory, for every directory holding an __init__.py."""
    found = {}
    for top, name in MAPPED.items():
        for init in sorted((ROOT / top).rglob("__init__.py")):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / top)
            found[".".join([name, *rel.parts])] = init.parent
    return found


def test_every_package_directory_is_listed() -> None:
    """Each directory with an __init__.py under msgq_trio/, plugins/ and storage/ appears
    in [tool.setuptools] packages under its installed (mapped) name."""
    listed = set(setuptools_config()["packages"])  # type: ignore[arg-type]
    found = package_dirs()
    assert {"msgq_trio", "msgq_trio.protocol", "msgq_trio.core"} <= set(found)
    missing = sorted(set(found) - listed)
    assert missing == [], f"package directories missing from pyproject.toml: {missing}"


def test_listed_packages_exist() -> None:
    """Every package listed in pyproject.toml is a directory with an __init__.py."""
    listed = setuptools_config()["packages"]
    found = package_dirs()
    data = [p for p in listed if p in DATA_PACKAGES]  # type: ignore[union-attr]
    assert [p for p in listed if p not in found and p not in data] == []  # type: ignore[union-attr]
    for p in data:
        assert list((ROOT / DATA_PACKAGES[p]).glob("*.toml")), p


def test_package_dir_mapping() -> None:
    """plugins/ and storage/ are mapped to msgq_trio.plugins and msgq_trio.storage."""
    mapping = setuptools_config()["package-dir"]
    assert mapping == {
        "msgq_trio": "msgq_trio",
        "msgq_trio.plugins": "plugins",
        "msgq_trio.storage": "storage",
        **DATA_PACKAGES,
    }


def run_outside_repo(code: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd="/tmp",
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_no_generic_top_level_modules_installed() -> None:
    """From outside the repository, `import storage` / `import plugins` fail while
    msgq_trio.storage and msgq_trio.plugins import (and come from this repository)."""
    for generic in ("storage", "plugins"):
        r = run_outside_repo(f"import {generic}")
        assert r.returncode != 0, f"`import {generic}` works outside the repo"
        assert "ModuleNotFoundError" in r.stderr, r.stderr
    r = run_outside_repo(
        "import msgq_trio.storage, msgq_trio.plugins\n"
        "print(msgq_trio.storage.__file__)\nprint(msgq_trio.plugins.__file__)"
    )
    assert r.returncode == 0, r.stderr
    storage_file, plugins_file = r.stdout.split()
    assert Path(storage_file).resolve() == ROOT / "storage" / "__init__.py"
    assert Path(plugins_file).resolve() == ROOT / "plugins" / "__init__.py"


def test_every_package_imports_from_outside() -> None:
    """Every package listed in pyproject.toml imports by its installed name from /tmp."""
    packages = [
        p
        for p in setuptools_config()["packages"]  # type: ignore[union-attr]
        if p not in DATA_PACKAGES
    ]
    r = run_outside_repo(
        f"import importlib, sys\nfor p in {packages!r}:\n    importlib.import_module(p)\n"
    )
    assert r.returncode == 0, r.stderr


#: The benchmark's peer clients (benchmarks/requirements.txt): no module of the wheel
#: imports one, and the wheel's metadata requires none.
PEER_MODULES = {"nats", "redis", "zmq", "aio_pika", "aiormq"}
PEER_DISTRIBUTIONS = ("nats-py", "redis", "pyzmq", "aio-pika", "py-spy")


def installers(source: str) -> list[str]:
    """What in ``source`` runs a package installer: an argv naming ``apt-get``, or ``pip``
    followed by ``install``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.List | ast.Tuple):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if "apt-get" in words or ("pip" in words and "install" in words):
                found.append(f"line {node.lineno}: {words}")
    return found


def test_installer_checker() -> None:
    """The installer check recognises the argv shapes an installer uses, and not text."""
    assert installers('subprocess.run(["apt-get", "install", "-y", "x"])')
    assert installers('cmd = [sys.executable, "-m", "pip", "install", *names]')
    assert installers('("sudo", "apt-get", "update")')
    assert installers('print("apt-get install nats-server")') == []


def test_the_wheel_holds_no_benchmark(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A wheel built from the repository contains msgq_trio's packages only: nothing from
    benchmarks/ (no peer worker, no installer), no module importing a peer's client or
    running apt-get or pip, and no dependency or extra for the peers. The wheel is the
    run's one build from a copy of the checkout, the way .ci/run builds the one it
    installs (tests/shared_build.py; tests/ops/test_cli_wheel.py installs the same)."""
    wheel = shared_wheel(tmp_path_factory)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        sources = {n: zf.read(n).decode() for n in names if n.endswith(".py")}
        metadata = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert "msgq_trio/protocol/framing.py" in names and len(sources) > 80
    assert [n for n in names if not n.startswith("msgq_trio/") and ".dist-info/" not in n] == []
    assert [n for n in names if "/bench/" in n or "benchmarks" in n or "/worker_" in n] == []
    peer_imports = []
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                mods = [node.module or ""]
            peer_imports += [f"{name}: {m}" for m in mods if m.split(".")[0] in PEER_MODULES]
    assert peer_imports == []
    assert {n: found for n, s in sources.items() if (found := installers(s))} == {}
    requires = [
        line for line in metadata.splitlines() if line.startswith(("Requires-Dist:", "Provides"))
    ]
    assert "Provides-Extra: bench" not in requires
    assert [r for r in requires if r.split()[1].startswith(PEER_DISTRIBUTIONS)] == [], requires


def test_mypy_sees_mapped_packages_under_installed_names() -> None:
    """mypy checks each mapped top-level directory (plugins/, storage/) through a symlink
    at its installed path under .typecheck/, so imports of msgq_trio.plugins.* and
    msgq_trio.storage.* resolve to the checked sources instead of Any. Each mapping of
    package-dir other than msgq_trio itself and the data packages has its link, the link
    leads to the mapped directory, and mypy is given the files through it."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        mypy = tomllib.load(f)["tool"]["mypy"]
    mapping = setuptools_config()["package-dir"]
    assert isinstance(mapping, dict)
    code = {k: v for k, v in mapping.items() if k != "msgq_trio" and k not in DATA_PACKAGES}
    assert code, "no mapped code packages"
    assert mypy["mypy_path"] == [".typecheck"]
    for name, directory in code.items():
        link = ROOT / ".typecheck" / Path(*name.split("."))
        assert link.is_symlink(), f"{link} is not a symlink"
        assert link.resolve() == (ROOT / directory).resolve(), f"{link} -> {link.resolve()}"
        assert str(link.relative_to(ROOT)) in mypy["files"], f"{link} missing from mypy files"
        assert directory not in mypy["files"], f"{directory} checked under its directory name"
    overridden = [m for o in mypy.get("overrides", []) for m in o["module"]]
    assert not [m for m in overridden if m.startswith(("msgq_trio.plugins", "msgq_trio.storage"))]
