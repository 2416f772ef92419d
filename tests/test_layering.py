"""Layering of the whole house, declared once and checked on the source with ast
(importing would hide lazy imports and would itself import trio through the package).

Every module of msgq_trio/, plugins/ (installed as msgq_trio.plugins), storage/
(msgq_trio.storage) and benchmarks/ (the peer comparison, top level, not installed)
belongs to one layer of :data:`LAYERS`, and :data:`RANK` orders the layers, lowest
first. A module may import its own layer and the layers of lower ranks, never a layer of
its own rank (siblings stay apart: the broker's I/O and the client know nothing of each
other) nor of a higher one. Because every import points downwards, no chain of imports
can point upwards either: the rule holds transitively. Some layers must not reach a
lower one at all (:data:`NEVER_REACHES`: plugins are clients of the broker, not parts of
it), and some modules must not reach an event loop, a socket or a thread through any
chain of imports (:data:`NO_REACH`): those two are checked on the transitive closure.
There are no import cycles between files (Tarjan's strongly connected components).

What counts as an import: every ``import`` and ``from ... import`` anywhere in a file,
at module level, inside a function (a lazy import) and under ``if TYPE_CHECKING:``. A
lazy import is still a dependency, and moving an import into a function is the usual way
to hide a cycle, so counting only module-level imports would make both rules trivially
dodgeable. Not counted: the implicit import of a module's parent packages (importing
``msgq_trio.client.bus`` runs ``msgq_trio/__init__.py`` first; every module would
otherwise depend on the package face).

Known violations in code under rework are listed in :data:`ALLOWED_IMPORTS` and
:data:`ALLOWED_CYCLES`, each with its reason; an entry that no longer matches anything
fails the test, so it is removed once the code is fixed.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Source directory -> the dotted name its modules are imported by.
SOURCES = {
    ROOT / "msgq_trio": "msgq_trio",
    ROOT / "plugins": "msgq_trio.plugins",
    ROOT / "storage": "msgq_trio.storage",
    ROOT / "benchmarks": "benchmarks",
}

#: Layer -> the modules (and their submodules) it is made of. ``msgq_trio`` itself, the
#: package face, counts as the client (it re-exports the client); any other module
#: directly under msgq_trio/ must be named here, or the test fails.
LAYERS: dict[str, tuple[str, ...]] = {
    # standard library only: version string, process helpers, daemon tuning
    "base": ("msgq_trio._version", "msgq_trio._procs", "msgq_trio.runtime"),
    "protocol": ("msgq_trio.protocol",),
    "errors": ("msgq_trio.errors",),
    "transport": ("msgq_trio.transport",),
    "config": ("msgq_trio.config",),
    "exposition": ("msgq_trio.exposition",),
    "core": ("msgq_trio.core",),
    "storage": ("msgq_trio.storage",),
    "io": ("msgq_trio.io",),
    "client": ("msgq_trio", "msgq_trio.client", "msgq_trio.aio", "msgq_trio.sync"),
    "plugins": ("msgq_trio.plugins",),
    "ops": ("msgq_trio.ops",),
    "scenario": ("msgq_trio.scenario",),
    "demo": ("msgq_trio.demo",),
    "analytics": ("msgq_trio.analytics",),
    "console": ("msgq_trio.console",),
    "cli": ("msgq_trio.cli", "msgq_trio.__main__"),
    "benchmarks": ("benchmarks",),
}

#: The layers, lowest first; a set holds siblings, which do not import each other.
#: analytics sits under the command line alone (``msgq-trio analyze`` wires it) and the
#: benchmark above everything: nothing in the package imports either.
RANK: list[set[str]] = [
    {"base"},
    {"protocol"},  # the sans-I/O wire codec
    {"errors"},  # the exceptions, keyed by the protocol's error codes
    {"transport", "config", "exposition"},  # socket toolkit, settings, metrics endpoint
    {"core", "storage"},  # the broker's logic and the queue stores: pure, no trio
    {"io", "client"},  # the broker's daemon layer and the clients
    {"plugins"},  # plugins are clients of the broker
    {"ops", "scenario", "demo"},  # running the broker, fault scenarios, the demo
    {"analytics"},
    {"console"},  # the web console: a client process above the ops tools
    {"cli"},
    {"benchmarks"},
]

#: Layer -> lower layers it must not reach through any chain of imports.
NEVER_REACHES: dict[str, set[str]] = {
    # Plugins talk to the broker through the client and the plugin API only.
    "plugins": {"core", "io"},
}

#: Modules (with their submodules) -> what no chain of imports from them may reach: an
#: external top-level module (``trio``) or a module of the house (``msgq_trio.client.bus``).
NO_REACH: dict[str, tuple[str, ...]] = {
    # The pure layers: the sans-I/O protocol, the broker's core, the queue stores.
    "msgq_trio.protocol": ("trio",),
    "msgq_trio.core": ("trio",),
    "msgq_trio.storage": ("trio",),
    # The client's sans-I/O session and its value types: no event loop, socket, thread,
    # socket toolkit or driver (the drivers import the session).
    **{
        f"msgq_trio.client.{m}": (
            "trio",
            "asyncio",
            "socket",
            "select",
            "threading",
            "msgq_trio.transport",
            "msgq_trio.client.bus",
            "msgq_trio.client.direct",
        )
        for m in (
            "session",
            "message",
            "reconnect",
            "polling",
            "lifecycle",
            "calls",
            "handlers",
            "interface",
            "encoders",
            "address",
            "wire",
            "inbox",
        )
    },
    # The asyncio driver runs without a trio run context.
    **{
        f"msgq_trio.client.{m}": (
            "trio",
            "msgq_trio.transport.sockets",
            "msgq_trio.transport.errors",
            "msgq_trio.client.bus",
            "msgq_trio.client.pipe",
            "msgq_trio.io",
        )
        for m in ("aio", "aio_pipe", "asyncio_streams", "asyncio_transport")
    },
    # The API both asynchronous drivers share, and the plugin clients' logic over it.
    **{
        f"msgq_trio.client.{m}": (
            "trio",
            "asyncio",
            "msgq_trio.client.bus",
            "msgq_trio.client.aio",
            "msgq_trio.client.aio_pipe",
            "msgq_trio.client.direct",
            "msgq_trio.client.pipe",
        )
        for m in (
            "async_bus",
            "async_driver",
            "loop",
            "queue",
            "queue_consumer",
            "queue_message",
            "queue_bus",
            "pipe_core",
            "mailbox",
        )
    },
}

#: Known upward or sideways imports: (importing module, imported module) -> why it is
#: tolerated for now. Empty: the house has none.
ALLOWED_IMPORTS: dict[tuple[str, str], str] = {}

#: Known import cycles (the modules of one strongly connected component) -> why.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


@dataclass
class Module:
    """One source file: its dotted name, and what it imports (line, dotted name)."""

    name: str
    path: Path | None
    imports: list[tuple[int, str]] = field(default_factory=list)


def imported_names(source: str, package: str) -> list[tuple[int, str]]:
    """Every module an ``import`` / ``from ... import`` anywhere in ``source`` names (in
    functions and ``if TYPE_CHECKING:`` too), with relative imports resolved against
    ``package`` (the package the file belongs to). ``from X import a`` is reported as
    ``X.a``: :func:`resolve` makes it the submodule ``X.a`` if there is one, else ``X``
    (``a`` is a name in X)."""
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
            out.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return out


def parse_modules(files: Iterable[tuple[str, bool, str, Path | None]]) -> dict[str, Module]:
    """(dotted name, is a package's ``__init__``, source, path) -> the modules."""
    modules = {}
    for name, is_package, source, path in files:
        package = name if is_package else name.rpartition(".")[0]
        modules[name] = Module(name, path, imported_names(source, package))
    return modules


def house() -> dict[str, Module]:
    """Every module of the house, by its dotted (installed) name."""
    files = []
    for directory, prefix in SOURCES.items():
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            files.append((".".join([prefix, *parts]), is_package, path.read_text(), path))
    return parse_modules(files)


def resolve(name: str, modules: Mapping[str, Module]) -> str | None:
    """The module of the house ``name`` is, or is in (``msgq_trio.client.bus.connect`` ->
    ``msgq_trio.client.bus``); None for an outside module."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name if name in modules else None


def edges(modules: Mapping[str, Module]) -> dict[str, dict[str, int]]:
    """Module -> the modules of the house it imports -> the line of the first import."""
    graph: dict[str, dict[str, int]] = {}
    for mod in modules.values():
        out = graph.setdefault(mod.name, {})
        for lineno, name in mod.imports:
            target = resolve(name, modules)
            if target is not None and target != mod.name:
                out.setdefault(target, lineno)
    return graph


def layer_of(module: str) -> str | None:
    """The layer of ``module``: its longest declared prefix (``msgq_trio`` matches only the
    face itself, so a new top-level module must be declared); None if undeclared."""
    best, best_len = None, -1
    for layer, prefixes in LAYERS.items():
        for p in prefixes:
            exact_only = p == "msgq_trio"
            if (module == p or (not exact_only and module.startswith(p + "."))) and len(
                p
            ) > best_len:
                best, best_len = layer, len(p)
    return best


def rank_of(layer: str) -> int:
    return next(i for i, layers in enumerate(RANK) if layer in layers)


def layer_violations(
    modules: Mapping[str, Module], allowed: Mapping[tuple[str, str], str] = ALLOWED_IMPORTS
) -> list[str]:
    """Every import of a sibling or a higher layer, not in ``allowed``."""
    bad = []
    for src, targets in sorted(edges(modules).items()):
        a = layer_of(src)
        for dst, lineno in sorted(targets.items()):
            b = layer_of(dst)
            if a is None or b is None or a == b or (src, dst) in allowed:
                continue
            if rank_of(b) >= rank_of(a):
                how = "a sibling" if rank_of(b) == rank_of(a) else "a higher layer"
                bad.append(f"{src} (line {lineno}, {a}) imports {dst}: {b} is {how}")
    return bad


def reach_path(
    graph: Mapping[str, Mapping[str, int]], start: str, stop: Iterable[str]
) -> list[str] | None:
    """The shortest chain of imports from ``start`` to a module in ``stop``, or None."""
    stop = set(stop)
    seen, queue = {start: [start]}, [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph.get(node, {})):
            if nxt not in seen:
                seen[nxt] = [*seen[node], nxt]
                if nxt in stop:
                    return seen[nxt]
                queue.append(nxt)
    return None


def reach_violations(modules: Mapping[str, Module]) -> list[str]:
    """Every layer of NEVER_REACHES reaching a forbidden layer, and every module of NO_REACH
    reaching a forbidden module or an importer of a forbidden outside module, with the
    chain of imports."""
    graph = edges(modules)
    bad = []
    for layer, forbidden in NEVER_REACHES.items():
        targets = {m for m in modules if layer_of(m) in forbidden}
        for src in sorted(m for m in modules if layer_of(m) == layer):
            path = reach_path(graph, src, targets)
            if path:
                bad.append(f"{layer} reaches {layer_of(path[-1])}: {' -> '.join(path)}")
    for prefix, banned in NO_REACH.items():
        internal = {m for m in modules if any(m == b or m.startswith(b + ".") for b in banned)}
        # modules that import a banned outside module themselves, and what they import
        external = {}
        for mod in modules.values():
            for lineno, name in mod.imports:
                top = name.split(".")[0]
                if resolve(name, modules) is None and top in banned:
                    external.setdefault(mod.name, f"{top} (line {lineno})")
        sources = [m for m in sorted(modules) if m == prefix or m.startswith(prefix + ".")]
        for src in sources:
            if src in external:
                bad.append(f"{src} imports {external[src]}")
                continue
            path = reach_path(graph, src, internal | set(external))
            if path:
                last = path[-1]
                what = external.get(last, last)
                bad.append(f"{src} reaches {what}: {' -> '.join(path)}")
    return bad


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        # Iterative, so a deep import chain cannot hit the recursion limit.
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


# -- the house ---------------------------------------------------------------------------
HOUSE = house()


def test_the_house_is_read() -> None:
    """Every source tree is found with its main modules (else the checks are vacuous)."""
    for name in (
        "msgq_trio.protocol.framing",
        "msgq_trio.core.broker",
        "msgq_trio.io.server",
        "msgq_trio.client.bus",
        "msgq_trio.plugins.queue",
        "msgq_trio.storage",
        "msgq_trio.cli",
        "benchmarks.run",
        *NO_REACH,
    ):
        assert name in HOUSE, name
    assert sum(len(t) for t in edges(HOUSE).values()) > 300


def test_every_module_has_a_layer() -> None:
    """Each module belongs to a declared layer, and each layer has a rank."""
    assert [m for m in sorted(HOUSE) if layer_of(m) is None] == []
    ranked = [layer for layers in RANK for layer in layers]
    assert sorted(ranked) == sorted(LAYERS), "every layer is ranked exactly once"


def test_no_module_imports_a_sibling_or_a_higher_layer() -> None:
    """No import anywhere in the house (lazy and type-only ones included) points to a
    sibling layer or a higher one."""
    bad = layer_violations(HOUSE)
    assert not bad, "\n".join(bad)


def test_forbidden_layers_and_modules_are_not_reached() -> None:
    """Plugins reach neither the broker's core nor its I/O; protocol, core and storage
    reach no trio; the client's sans-I/O session reaches no event loop, socket, thread or
    driver; the asyncio driver no trio; the shared async API and the plugin clients'
    logic neither event loop nor a driver: through any chain of imports."""
    bad = reach_violations(HOUSE)
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    """No two files import each other, directly or through others (lazy and type-only
    imports count), apart from the known cycles listed with their reason."""
    found = {frozenset(c) for c in cycles(edges(HOUSE))}
    new = [" <-> ".join(sorted(c)) for c in found - set(ALLOWED_CYCLES)]
    assert not new, "import cycles:\n" + "\n".join(sorted(new))


def test_allow_lists_are_still_needed() -> None:
    """Every allowed violation still exists: fixed ones are removed from the lists."""
    graph = edges(HOUSE)
    gone = [pair for pair in ALLOWED_IMPORTS if pair[1] not in graph.get(pair[0], {})]
    found = {frozenset(c) for c in cycles(graph)}
    gone += [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert gone == [], f"remove these fixed entries from the allow lists: {gone}"


# -- the checkers on made-up modules -----------------------------------------------------
def fake(sources: dict[str, str]) -> dict[str, Module]:
    """Modules from sources; a name ending in ``/`` is a package's ``__init__``."""
    return parse_modules(
        (name.rstrip("/"), name.endswith("/"), src, None) for name, src in sources.items()
    )


BASE = {
    "msgq_trio/": "",
    "msgq_trio.protocol/": "",
    "msgq_trio.protocol.framing": "",
    "msgq_trio.core/": "",
    "msgq_trio.core.router": "",
    "msgq_trio.config": "from .protocol.framing import X\n",
    "msgq_trio.io/": "",
    "msgq_trio.io.server": "",
    "msgq_trio.client/": "",
    "msgq_trio.client.bus": "import trio\n",
    "msgq_trio.client.session": "",
    "msgq_trio.plugins/": "",
    "msgq_trio.plugins.api": "",
    "msgq_trio.cli": "",
    "msgq_trio.analytics/": "",
    "benchmarks/": "",
}


@pytest.mark.parametrize(
    "module,source",
    [
        ("msgq_trio.core.router", "from ..io import server"),
        ("msgq_trio.core.router", "from ..io.server import Server"),
        ("msgq_trio.core.router", "import msgq_trio.client.bus as b"),
        ("msgq_trio.core.router", "def f():\n    from ..client import bus\n"),
        ("msgq_trio.core.router", "if TYPE_CHECKING:\n    from ..plugins.api import X\n"),
        ("msgq_trio.protocol.framing", "from .. import config"),
        ("msgq_trio.io.server", "from ..client.bus import Bus"),  # sibling
        ("msgq_trio.client.bus", "from .. import io"),  # sibling
        ("msgq_trio.io.server", "from .. import __version__"),  # the face is the client
        ("msgq_trio.plugins.api", "from msgq_trio.cli import main"),
        ("msgq_trio.cli", "import benchmarks"),
        ("msgq_trio.protocol.framing", "import msgq_trio.analytics"),
    ],
)
def test_the_layer_checker_catches(module: str, source: str) -> None:
    """An upward or sideways import is flagged in each spelling: absolute, relative,
    ``from .. import``, lazy, type-only."""
    sources = {**BASE, module: source}
    assert layer_violations(fake(sources), {}) != []


@pytest.mark.parametrize(
    "module,source",
    [
        ("msgq_trio.core.router", "from ..protocol.framing import Frame"),
        ("msgq_trio.core.router", "import trio_websocket"),  # outside the house
        ("msgq_trio.client.bus", "from .session import Session"),
        ("msgq_trio.cli", "from .analytics import cli"),
        ("benchmarks/", "from msgq_trio.cli import main"),
        ("msgq_trio.plugins.api", "from msgq_trio.client.bus import connect"),
    ],
)
def test_the_layer_checker_allows(module: str, source: str) -> None:
    """Downward imports, imports in the own layer and look-alikes pass."""
    sources = {**BASE, module: source}
    assert layer_violations(fake(sources), {}) == []


@pytest.mark.parametrize(
    "sources",
    [
        # core -> config -> a module importing trio
        {"msgq_trio.core.router": "from ..config import X", "msgq_trio.config": "import trio"},
        {"msgq_trio.core.router": "def f():\n    import trio.lowlevel\n"},
        {"msgq_trio.client.session": "from . import bus"},  # a driver, which imports trio
        {"msgq_trio.client.session": "import socket"},
        # plugins -> the client -> ... -> core
        {
            "msgq_trio.plugins.api": "from msgq_trio.client import bus",
            "msgq_trio.client.bus": "from ..core import router",
        },
    ],
)
def test_the_reach_checker_catches(sources: dict[str, str]) -> None:
    """A forbidden module or layer is found at the end of a chain of imports."""
    assert reach_violations(fake({**BASE, **sources})) != []


@pytest.mark.parametrize(
    "sources",
    [
        {},  # the base: trio only in the trio driver
        {"msgq_trio.core.router": "import trio_websocket"},  # a look-alike of trio
        {"msgq_trio.client.session": "from ..protocol.framing import Frame"},
        {"msgq_trio.plugins.api": "from msgq_trio.client import session"},
    ],
)
def test_the_reach_checker_allows(sources: dict[str, str]) -> None:
    """Chains that end nowhere forbidden pass."""
    assert reach_violations(fake({**BASE, **sources})) == []


def test_the_cycle_checker() -> None:
    """Cycles of two and three modules are found, also through a lazy import; a chain
    without a way back is none."""
    modules = fake(
        {
            "p/": "",
            "p.a": "from .b import x",
            "p.b": "def f():\n    from . import a\n",
            "p.c": "from .d import y",
            "p.d": "if TYPE_CHECKING:\n    from .e import z\n",
            "p.e": "import p.c",
            "p.f": "from .a import x",
        }
    )
    assert cycles(edges(modules)) == [["p.a", "p.b"], ["p.c", "p.d", "p.e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
