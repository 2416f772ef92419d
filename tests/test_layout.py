"""Packaging layout: every package directory is listed in pyproject.toml, and the mapped
top-level directories (plugins/, storage/) are only importable as msgq_trio.plugins /
msgq_trio.storage, never as generic top-level modules. scenarios/ is installed as data
(msgq_trio/scenarios/*.toml in the wheel), not as an importable package."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

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
