"""Layering: the sans-I/O protocol, the pure core and the storage backends never import
trio or the I/O layer; the client's sans-I/O session (its value types, reconnect and
busy-poll rules) imports no event loop, no socket, no thread and none of its drivers;
plugins never import the broker's core, daemon or operations layer, and the core no
plugin. Checked on the source with ast (importing would hide lazy imports and would
itself import trio through the package)."""

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
#: The client's sans-I/O modules -> the package their relative imports resolve against.
CLIENT_SESSION = {
    ROOT / "msgq_trio" / "client" / "session.py": "msgq_trio.client",
    ROOT / "msgq_trio" / "client" / "message.py": "msgq_trio.client",
    ROOT / "msgq_trio" / "client" / "reconnect.py": "msgq_trio.client",
    ROOT / "msgq_trio" / "client" / "polling.py": "msgq_trio.client",
    ROOT / "msgq_trio" / "client" / "lifecycle.py": "msgq_trio.client",
    ROOT / "msgq_trio" / "client" / "calls.py": "msgq_trio.client",
    ROOT / "msgq_trio" / "client" / "handlers.py": "msgq_trio.client",
    ROOT / "msgq_trio" / "client" / "encoders.py": "msgq_trio.client",
    ROOT / "msgq_trio" / "client" / "address.py": "msgq_trio.client",
    ROOT / "msgq_trio" / "client" / "wire.py": "msgq_trio.client",
}
#: What the session may not import: an event loop, sockets, threads, the broker's I/O,
#: the socket toolkit (it imports trio) or a driver (the drivers import the session).
SESSION_FORBIDDEN = (
    "trio",
    "asyncio",
    "socket",
    "select",
    "threading",
    "msgq_trio.io",
    "msgq_trio.transport",
    "msgq_trio.client.bus",
    "msgq_trio.client.direct",
)


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


def violations(
    source: str, package: str, forbidden_modules: tuple[str, ...] = FORBIDDEN
) -> list[str]:
    bad = []
    for lineno, mod in imported_modules(source, package):
        for forbidden in forbidden_modules:
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


def test_the_client_session_modules_exist() -> None:
    """The session modules the next test checks are there (it would be vacuous)."""
    assert all(path.is_file() for path in CLIENT_SESSION)


@pytest.mark.parametrize(
    "path,package",
    list(CLIENT_SESSION.items()),
    ids=[str(p.relative_to(ROOT)) for p in CLIENT_SESSION],
)
def test_client_session_imports_no_io(path: Path, package: str) -> None:
    """The client's sans-I/O session and its value types import no trio, asyncio,
    socket, select, threading, broker I/O, socket toolkit or client driver, anywhere in
    the file: the drivers own all of that."""
    assert violations(path.read_text(), package, SESSION_FORBIDDEN) == []


@pytest.mark.parametrize(
    "source",
    [
        "import asyncio",
        "import socket",
        "from threading import Lock",
        "from ..transport.sockets import close_fds",
        "from .bus import Bus",
        "from . import direct",
        "def f():\n    import trio\n",
    ],
)
def test_session_checker_catches_violations(source: str) -> None:
    """The session checker flags an event loop, a socket, a thread, the socket toolkit
    and a driver, also by relative import."""
    assert violations(source, "msgq_trio.client", SESSION_FORBIDDEN)


@pytest.mark.parametrize(
    "source",
    [
        "from .message import Message",
        "from ..protocol.framing import Frame",
        "import socketserverx",
    ],
)
def test_session_checker_allows_the_rest(source: str) -> None:
    """The session checker does not flag the session's own imports or look-alikes."""
    assert violations(source, "msgq_trio.client", SESSION_FORBIDDEN) == []


#: Packages around the broker's I/O -> (the dotted name they are installed as, what they
#: may not import). The socket toolkit (transport) sits under both the broker's I/O and
#: the clients, so it imports neither, nor the core; the clients stand beside the broker's
#: I/O, not above it; the broker's I/O imports no client.
SEPARATE_LAYERS = {
    ROOT / "msgq_trio" / "transport": (
        "msgq_trio.transport",
        ("msgq_trio.io", "msgq_trio.client", "msgq_trio.core"),
    ),
    ROOT / "msgq_trio" / "client": ("msgq_trio.client", ("msgq_trio.io",)),
    ROOT / "msgq_trio" / "io": ("msgq_trio.io", ("msgq_trio.client",)),
}
#: Submodules of msgq_trio (the installed plugins, storage and scenarios included): what
#: ``from msgq_trio import NAME`` may name without going through the package face.
FACE_SUBMODULES = (
    {p.stem for p in (ROOT / "msgq_trio").glob("*.py")}
    | {p.name for p in (ROOT / "msgq_trio").iterdir() if (p / "__init__.py").is_file()}
    | {"plugins", "storage", "scenarios"}
)


def layer_violations(source: str, package: str, forbidden: tuple[str, ...]) -> list[str]:
    """Imports in ``source`` (of ``package``) of a module under one of ``forbidden``."""
    return [
        f"line {lineno}: imports {mod}"
        for lineno, mod in imported_modules(source, package)
        if any(mod == f or mod.startswith(f + ".") for f in forbidden)
    ]


def face_imports(source: str, package: str) -> list[str]:
    """Imports in ``source`` of the package face ``msgq_trio/__init__.py`` itself:
    ``import msgq_trio`` or a name from it that is not a submodule
    (``from .. import __version__``, ``from msgq_trio import connect``); the face imports
    every client."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            bad += [
                f"line {node.lineno}: imports msgq_trio"
                for a in node.names
                if a.name == "msgq_trio"
            ]
        elif isinstance(node, ast.ImportFrom):
            base = imported_modules(ast.unparse(node), package)[0][1]
            if base == "msgq_trio":
                bad += [
                    f"line {node.lineno}: imports {a.name} from the package face"
                    for a in node.names
                    if a.name not in FACE_SUBMODULES
                ]
    return bad


def separate_layer_files(
    layers: dict[Path, tuple[str, tuple[str, ...]]] = SEPARATE_LAYERS,
) -> list[tuple[Path, str, tuple[str, ...]]]:
    """Every .py file under each directory of ``layers`` (subpackages included), with
    the package its relative imports resolve against and what it may not import."""
    files = []
    for directory, (package, forbidden) in layers.items():
        for path in sorted(directory.rglob("*.py")):
            parts = [
                p for p in path.relative_to(directory).with_suffix("").parts if p != "__init__"
            ]
            pkg_parts = parts if path.name == "__init__.py" else parts[:-1]
            files.append((path, ".".join([package, *pkg_parts]), forbidden))
    return files


def test_separate_layers_have_files() -> None:
    """transport/, client/ and io/ exist with their main modules (else the next test
    would be vacuous)."""
    names = {(p.parent.name, p.name) for p, _, _ in separate_layer_files()}
    assert {("transport", "sockets.py"), ("client", "bus.py"), ("io", "server.py")} <= names


@pytest.mark.parametrize(
    "path,package,forbidden",
    separate_layer_files(),
    ids=[str(p.relative_to(ROOT)) for p, _, _ in separate_layer_files()],
)
def test_transport_client_and_io_stay_apart(
    path: Path, package: str, forbidden: tuple[str, ...]
) -> None:
    """msgq_trio/transport imports neither the broker's I/O, the core nor a client;
    msgq_trio/client never imports msgq_trio.io; msgq_trio/io imports no client and
    nothing from the package face (not even ``__version__``: msgq_trio._version has it)."""
    source = path.read_text()
    assert layer_violations(source, package, forbidden) == []
    if package.startswith("msgq_trio.io"):
        assert face_imports(source, package) == []


@pytest.mark.parametrize(
    "source,package",
    [
        ("from ..io.server import Server", "msgq_trio.transport"),
        ("from ..client import bus", "msgq_trio.transport"),
        ("from ..core.peers import Peer", "msgq_trio.transport"),
        ("import msgq_trio.io.listeners", "msgq_trio.client"),
        ("def f():\n    from ..io import connection\n", "msgq_trio.client"),
        ("from .. import io", "msgq_trio.client"),
        ("from ..client.bus import Bus", "msgq_trio.io"),
    ],
)
def test_layer_checker_catches_violations(source: str, package: str) -> None:
    """The checker flags each forbidden arrow, also by relative or lazy import."""
    forbidden = next(f for d, (p, f) in SEPARATE_LAYERS.items() if p == package)
    assert layer_violations(source, package, forbidden)


@pytest.mark.parametrize(
    "source",
    ["from .. import __version__", "import msgq_trio", "from msgq_trio import connect"],
)
def test_face_checker_catches_face_imports(source: str) -> None:
    """Naming the package face from io/ is flagged in each spelling."""
    assert face_imports(source, "msgq_trio.io")


@pytest.mark.parametrize(
    "source,package",
    [
        ("from ..transport.sockets import close_fds", "msgq_trio.client"),
        ("from ..protocol.framing import FdBuffer", "msgq_trio.transport"),
        ("from .._version import __version__", "msgq_trio.io"),
        ("from .. import config", "msgq_trio.io"),
        ("from ..config import Limits", "msgq_trio.io"),
        ("import msgq_trio.iox", "msgq_trio.client"),
    ],
)
def test_layer_checkers_allow_the_rest(source: str, package: str) -> None:
    """Allowed imports and look-alikes pass both checkers."""
    forbidden = next(f for d, (p, f) in SEPARATE_LAYERS.items() if p == package)
    assert layer_violations(source, package, forbidden) == []
    assert face_imports(source, package) == []


#: The asyncio driver runs where there is no trio run context (``asyncio.run``): it
#: imports no trio, nor what imports trio (the socket toolkit's sockets and errors, the
#: trio driver and the plugin clients over it, the broker's I/O). ``transport/tls.py``
#: (ssl only) is allowed: every client builds its TLS context there; so is
#: ``transport/fdpass.py`` (descriptor passing, plain stdlib).
AIO_DRIVER = [
    ROOT / "msgq_trio" / "client" / name
    for name in ("aio.py", "asyncio_streams.py", "asyncio_transport.py")
]
AIO_FORBIDDEN = (
    "trio",
    "msgq_trio.transport.sockets",
    "msgq_trio.transport.errors",
    "msgq_trio.client.bus",
    "msgq_trio.client.pipe",
    "msgq_trio.io",
)


@pytest.mark.parametrize("path", AIO_DRIVER, ids=lambda p: p.name)
def test_the_asyncio_driver_imports_no_trio(path: Path) -> None:
    """The asyncio driver's modules import neither trio nor a module that does,
    anywhere in the file."""
    assert path.is_file()
    assert violations(path.read_text(), "msgq_trio.client", AIO_FORBIDDEN) == []


@pytest.mark.parametrize(
    "source",
    [
        "import trio",
        "def f():\n    from trio import sleep\n",
        "from ..transport.sockets import take_fds",
        "from ..transport import errors",
        "from .bus import Bus",
        "from . import pipe",
    ],
)
def test_aio_checker_catches_violations(source: str) -> None:
    """The asyncio driver's checker flags trio and each module that imports it."""
    assert violations(source, "msgq_trio.client", AIO_FORBIDDEN)


def test_the_transport_helpers_the_asyncio_driver_uses_import_no_trio() -> None:
    """msgq_trio/transport/tls.py, transport/fdpass.py and the transport package's
    __init__ (all imported by the asyncio driver) import no trio."""
    for path in (
        ROOT / "msgq_trio" / "transport" / "tls.py",
        ROOT / "msgq_trio" / "transport" / "fdpass.py",
        ROOT / "msgq_trio" / "transport" / "__init__.py",
    ):
        assert violations(path.read_text(), "msgq_trio.transport", AIO_FORBIDDEN) == []


#: The API both asynchronous drivers share (client/async_bus.py, over
#: client/async_driver.py and client/loop.py) is imported by the trio and the asyncio
#: driver, so it imports neither event loop, nothing that does, and no driver (the
#: drivers import it).
CLIENT_API = [
    ROOT / "msgq_trio" / "client" / name
    for name in ("async_bus.py", "async_driver.py", "loop.py", "lifecycle.py", "address.py")
]
API_FORBIDDEN = (
    "trio",
    "asyncio",
    "msgq_trio.transport.sockets",
    "msgq_trio.transport.errors",
    "msgq_trio.client.bus",
    "msgq_trio.client.aio",
    "msgq_trio.client.aio_pipe",
    "msgq_trio.client.direct",
    "msgq_trio.client.pipe",
    "msgq_trio.io",
)


@pytest.mark.parametrize("path", CLIENT_API, ids=lambda p: p.name)
def test_the_shared_client_api_imports_no_event_loop(path: Path) -> None:
    """The shared client API's modules import neither trio nor asyncio nor a driver,
    anywhere in the file."""
    assert path.is_file()
    assert violations(path.read_text(), "msgq_trio.client", API_FORBIDDEN) == []


@pytest.mark.parametrize(
    "source",
    [
        "import asyncio",
        "def f():\n    import trio\n",
        "from ..transport.sockets import close_fds",
        "from .bus import Bus",
        "from . import aio",
    ],
)
def test_api_checker_catches_violations(source: str) -> None:
    """The shared API's checker flags either event loop, the trio socket toolkit and a
    driver."""
    assert violations(source, "msgq_trio.client", API_FORBIDDEN)


#: The plugin clients' logic, shared by the trio and the asyncio driver (the queue
#: client, the pipe client's core, the mailbox the queue client hands deliveries over
#: in): written against the shared API, so it imports neither event loop, nothing that
#: does, and no driver. The trio pipe face (client/pipe.py) is the one that imports
#: trio.
DRIVER_NEUTRAL = [
    ROOT / "msgq_trio" / "client" / "queue.py",
    ROOT / "msgq_trio" / "client" / "queue_consumer.py",
    ROOT / "msgq_trio" / "client" / "queue_message.py",
    ROOT / "msgq_trio" / "client" / "pipe_core.py",
    ROOT / "msgq_trio" / "client" / "mailbox.py",
]


@pytest.mark.parametrize("path", DRIVER_NEUTRAL, ids=lambda p: p.name)
def test_the_plugin_clients_logic_imports_no_event_loop(path: Path) -> None:
    """The queue client, the pipe client's core and the mailbox import neither trio nor
    asyncio nor a driver, anywhere in the file."""
    assert path.is_file()
    assert violations(path.read_text(), "msgq_trio.client", API_FORBIDDEN) == []


def test_the_asyncio_pipe_face_imports_no_trio() -> None:
    """msgq_trio/client/aio_pipe.py (imported by the asyncio face) imports no trio."""
    path = ROOT / "msgq_trio" / "client" / "aio_pipe.py"
    assert violations(path.read_text(), "msgq_trio.client", AIO_FORBIDDEN) == []


#: Plugins are clients of the broker, not parts of it (plugins/api.py): they import the
#: plugin API, the clients, the protocol, the errors, the configuration's value types,
#: storage and the shared metrics endpoint, never the broker's core, daemon or operations
#: layer. The core in turn knows no plugin: what a plugin's commands need from the access
#: policy reaches it as data (``Policy.commands``), read by the loader.
PLUGIN_LAYERS = {
    ROOT / "plugins": ("msgq_trio.plugins", ("msgq_trio.core", "msgq_trio.io", "msgq_trio.ops")),
    ROOT / "msgq_trio" / "core": ("msgq_trio.core", ("msgq_trio.plugins", "msgq_trio.ops")),
}


def plugin_layer_forbidden(package: str) -> tuple[str, ...]:
    """What a module of ``package`` (``msgq_trio.plugins.queue``, ``msgq_trio.core``) may
    not import under PLUGIN_LAYERS."""
    return next(f for p, f in PLUGIN_LAYERS.values() if package == p or package.startswith(p + "."))


def test_plugin_layers_have_files() -> None:
    """plugins/ with each shipped plugin's package, and core/, are found (else the next
    test would be vacuous)."""
    found = {(p.parent.name, p.name, pkg) for p, pkg, _ in separate_layer_files(PLUGIN_LAYERS)}
    for plugin in ("queue", "pipe", "link"):
        assert (plugin, "settings.py", f"msgq_trio.plugins.{plugin}") in found
    assert ("plugins", "api.py", "msgq_trio.plugins") in found
    assert ("core", "access.py", "msgq_trio.core") in found


@pytest.mark.parametrize(
    "path,package,forbidden",
    separate_layer_files(PLUGIN_LAYERS),
    ids=[str(p.relative_to(ROOT)) for p, _, _ in separate_layer_files(PLUGIN_LAYERS)],
)
def test_plugins_never_import_core_io_or_ops_and_core_no_plugin(
    path: Path, package: str, forbidden: tuple[str, ...]
) -> None:
    """No module under plugins/ imports msgq_trio.core, msgq_trio.io or msgq_trio.ops,
    and no module of msgq_trio/core imports msgq_trio.plugins or msgq_trio.ops, anywhere
    in the file (lazy imports included), absolutely or relatively."""
    assert layer_violations(path.read_text(), package, forbidden) == []


@pytest.mark.parametrize(
    "source,package",
    [
        ("from msgq_trio.core.router import valid_group_name", "msgq_trio.plugins.queue"),
        ("from msgq_trio.ops.metrics import parse_listen", "msgq_trio.plugins.link"),
        ("def f():\n    from ...core import access\n", "msgq_trio.plugins.queue"),
        ("from ... import ops", "msgq_trio.plugins.pipe"),
        ("from .. import core", "msgq_trio.plugins"),
        ("import msgq_trio.io.server", "msgq_trio.plugins"),
        ("from ..plugins.queue import ACCESS", "msgq_trio.core"),
        ("def f():\n    import msgq_trio.plugins.loader\n", "msgq_trio.core"),
        ("from ..ops.metrics import TrafficTotals", "msgq_trio.core"),
    ],
)
def test_plugin_layer_checker_catches_violations(source: str, package: str) -> None:
    """The checker flags a plugin importing the core, the daemon or the operations
    layer, and the core importing a plugin, in each spelling."""
    assert layer_violations(source, package, plugin_layer_forbidden(package))


@pytest.mark.parametrize(
    "source,package",
    [
        ("from msgq_trio.protocol.names import valid_group_name", "msgq_trio.plugins.queue"),
        ("from msgq_trio.exposition import MetricsServer", "msgq_trio.plugins.link"),
        ("from ..api import CommandAccess", "msgq_trio.plugins.queue"),
        ("from msgq_trio.client.bus import connect", "msgq_trio.plugins.pipe"),
        ("import msgq_trio.coreutils", "msgq_trio.plugins"),
        ("from ..config import CommandAccess", "msgq_trio.core"),
    ],
)
def test_plugin_layer_checker_allows_the_rest(source: str, package: str) -> None:
    """What plugins and the core may import, and look-alikes, pass."""
    assert layer_violations(source, package, plugin_layer_forbidden(package)) == []


def runtime_imports(source: str, package: str) -> set[str]:
    """Modules ``source`` imports when it is imported: module-level statements only, not
    ``if TYPE_CHECKING:`` blocks nor imports inside functions (lazy ones run later, once
    every module is loaded)."""
    tree = ast.parse(source)
    top: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            top.extend(node.orelse)
        else:
            top.append(node)
    module = ast.Module(
        body=[n for n in top if isinstance(n, ast.Import | ast.ImportFrom)], type_ignores=[]
    )
    return {name for _, name in imported_modules(ast.unparse(module), package)}


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle in ``graph`` (module -> modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt in graph and not state.get(nxt):
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node):
            found = visit(node)
            if found:
                return found
    return None


def test_client_modules_import_no_cycle() -> None:
    """The client's modules import one another without a cycle at import time (a type
    imported for annotations only, or a lazy import in a function, is no edge)."""
    client = ROOT / "msgq_trio" / "client"
    names = {f"msgq_trio.client.{p.stem}" for p in client.glob("*.py")}
    graph = {
        f"msgq_trio.client.{p.stem}": runtime_imports(p.read_text(), "msgq_trio.client") & names
        for p in client.glob("*.py")
    }
    assert len(graph) > 8
    assert import_cycle(graph) is None, import_cycle(graph)


def test_cycle_checker_finds_a_cycle() -> None:
    """The checker is not vacuous: a two-module cycle and a type-only import."""
    a = runtime_imports("from .b import x\nif TYPE_CHECKING:\n    from .c import y\n", "p")
    assert a == {"p.b", "p.b.x"}
    assert import_cycle({"p.a": {"p.b"}, "p.b": {"p.a"}}) == ["p.a", "p.b", "p.a"]
    assert import_cycle({"p.a": {"p.b"}, "p.b": set()}) is None
