"""Layering: the sans-I/O protocol, the pure core and the storage backends never import
trio or the I/O layer. Checked on the source with ast (importing would hide lazy imports
and would itself import trio through the package)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: directory -> the dotted package name it is installed as
PURE_LAYERS = {
    ROOT / "msgq_trio" / "protocol": "msgq_trio.protocol",
    ROOT / "msgq_trio" / "core": "msgq_trio.core",
    ROOT / "storage": "msgq_trio.storage",
}
FORBIDDEN = ("trio", "msgq_trio.io")


def imported_modules(source: str, package: str) -> list[tuple[int, str]]:
    """Every module an ``import`` / ``from ... import`` in ``source`` names, with relative
    imports resolved against ``package`` (the package the file belongs to). For
    ``from X import a, b`` both X and X.a, X.b are reported (a, b may be submodules)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level > 1:
                    parts = parts[: -(node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((node.lineno, base))
            out.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return out


def violations(source: str, package: str) -> list[str]:
    bad = []
    for lineno, mod in imported_modules(source, package):
        for forbidden in FORBIDDEN:
            if mod == forbidden or mod.startswith(forbidden + "."):
                bad.append(f"line {lineno}: imports {mod}")
    return bad


def source_files() -> list[tuple[Path, str]]:
    files = []
    for directory, package in PURE_LAYERS.items():
        for path in sorted(directory.rglob("*.py")):
            rel = path.relative_to(directory).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            # The package a module's relative imports are resolved against.
            pkg = (
                ".".join([package, *parts[:-1]])
                if path.name != "__init__.py"
                else ".".join([package, *parts])
            )
            files.append((path, pkg))
    return files


def test_there_are_files_to_check() -> None:
    """The checked layers exist and contain Python files (the test would be vacuous)."""
    checked = {p.parent.name for p, _ in source_files()}
    assert {"protocol", "core"} <= checked
    assert any(p.name == "framing.py" for p, _ in source_files())


@pytest.mark.parametrize(
    "path,package", source_files(), ids=[str(p.relative_to(ROOT)) for p, _ in source_files()]
)
def test_pure_layers_do_not_import_trio_or_io(path: Path, package: str) -> None:
    """No module of msgq_trio/protocol, msgq_trio/core or storage/ imports trio or
    msgq_trio.io, directly or by a relative import, anywhere in the file."""
    assert violations(path.read_text(), package) == []


@pytest.mark.parametrize(
    "source,package",
    [
        ("import trio", "msgq_trio.core"),
        ("import trio.lowlevel as ll", "msgq_trio.core"),
        ("from trio import sleep", "msgq_trio.protocol"),
        ("def f():\n    import trio\n", "msgq_trio.core"),
        ("from ..io import server", "msgq_trio.core"),
        ("from ..io.server import Server", "msgq_trio.protocol"),
        ("from .. import io", "msgq_trio.core"),
        ("from msgq_trio.io.errors import coalesce", "msgq_trio.storage"),
        ("from ..io import x", "msgq_trio.storage"),
        ("import msgq_trio.io", "msgq_trio.storage"),
    ],
)
def test_checker_catches_violations(source: str, package: str) -> None:
    """The checker itself flags every spelling of a forbidden import."""
    assert violations(source, package)


@pytest.mark.parametrize(
    "source,package",
    [
        ("import trio_websocket", "msgq_trio.core"),
        ("from ..protocol import framing", "msgq_trio.core"),
        ("from .rpc import PendingReplies", "msgq_trio.core"),
        ("import msgq_trio.iox", "msgq_trio.core"),
        ("from . import codes", "msgq_trio.protocol"),
    ],
)
def test_checker_allows_the_rest(source: str, package: str) -> None:
    """The checker does not flag look-alike or allowed imports."""
    assert violations(source, package) == []
