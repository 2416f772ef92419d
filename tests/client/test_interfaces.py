"""Declared interfaces: a handler's signature and type hints as its declaration, keyword
handlers, the callee-side check (``bad-request`` naming the parameter before the handler
runs) and ``msgq.introspect``, answered alike by the trio, asyncio and blocking drivers
against a real broker process."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Optional

import pytest
import trio
from driver_harness import asyncio_bus

import msgq_trio
import msgq_trio.sync
from msgq_trio import CommandFailed, RemoteError, Reply, UsageError
from msgq_trio.client.interface import (
    INTROSPECT,
    CommandDecl,
    Param,
    check_params,
    check_value,
    compile_check,
    declare_command,
    parse_type,
    type_name,
)
from msgq_trio.client.message import Message
from msgq_trio.protocol.codes import ErrorCode


# -- signature -> declaration -------------------------------------------------------------
class Custom:
    pass


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        (str, "str"),
        (int, "int"),
        (float, "float"),
        (bool, "bool"),
        (bytes, "bytes"),
        (None, "null"),
        (Optional[str], "str | null"),  # noqa: UP045 (the typing spelling is declared too)
        (int | None, "int | null"),
        (list[int], "list[int]"),
        (list[Any], "list"),
        (dict[str, float], "dict[str, float]"),
        (dict[str, list[str | None]], "dict[str, list[str | null]]"),
        (dict[int, str], "dict"),
        (Any, "any"),
        (Custom, "any"),
        (int | Custom, "any"),
        ("list[str]", "list[str]"),
        ("not a type", "any"),
    ],
)
def test_annotations_map_to_the_wire_types(annotation: object, expected: str) -> None:
    assert type_name(annotation) == expected
    parse_type(expected)  # what is declared parses back


def test_values_are_checked_against_declared_types() -> None:
    """bool is not an int (Python's subclass is not the wire's); an integral number is
    a float's value (JSON writes 1); containers are checked item by item."""
    assert check_value("int", 3) and not check_value("int", True)
    assert check_value("float", 1) and check_value("float", 1.5) and not check_value("float", "1")
    assert check_value("str | null", None) and not check_value("str | null", 1)
    assert check_value("list[int]", [1, 2]) and not check_value("list[int]", [1, "2"])
    assert check_value("dict[str, bool]", {"a": True}) and not check_value(
        "dict[str, bool]", {"a": 1}
    )
    assert check_value("bytes", b"x") and not check_value("bytes", "x")
    assert check_value("any", object())
    assert check_value("newer-grammar<T>", 1)  # a reader never refuses what it cannot read
    for bad in ("lst", "list[int", "dict[int, str]", "int |", "str extra"):
        with pytest.raises(ValueError, match="type"):
            parse_type(bad)


def test_a_keyword_handler_is_declared_from_its_signature() -> None:
    async def get_zone_count(
        *, zone_class: str = "IN", verbose: bool = False, request: Message
    ) -> int:
        """Count the zones of a class.

        Details that stay out of the one-line doc."""
        return 0

    d = declare_command("get_zone_count", get_zone_count, raises=[ErrorCode.BAD_REQUEST])
    assert d.keywords and d.check and d.request_arg == "request" and not d.open
    assert d.params == (
        Param("zone_class", "str", required=False, default="IN"),
        Param("verbose", "bool", required=False, default=False),
    )
    assert d.result == "int" and d.doc == "Count the zones of a class."
    assert d.to_wire() == {
        "name": "get_zone_count",
        "doc": "Count the zones of a class.",
        "params": [
            {"name": "zone_class", "type": "str", "required": False, "default": "IN"},
            {"name": "verbose", "type": "bool", "required": False, "default": False},
        ],
        "result": "int",
        "raises": ["bad-request"],
    }


def test_explicit_declarations_for_params_handlers() -> None:
    """``fn(params)`` declares nothing unless told; ``params=`` maps names to types or
    :class:`Param`; a default the wire cannot carry is left out of the description."""
    d = declare_command("old", lambda p: p)
    assert d.params is None and not d.check and not d.keywords
    assert check_params(d, "anything") is None
    d = declare_command(
        "put",
        lambda p, r: p,
        params={"key": str, "ttl": Param(type="int | null", required=False), "x": "list[int]"},
        result=bool,
        doc="Put one key.",
    )
    assert d.check and d.result == "bool" and d.doc == "Put one key."
    assert [p.to_wire() for p in d.params or ()] == [
        {"name": "key", "type": "str", "required": True},
        {"name": "ttl", "type": "int | null", "required": False, "default": None},
        {"name": "x", "type": "list[int]", "required": True},
    ]

    def odd(*, when: object = object()) -> Reply:
        raise AssertionError

    d = declare_command("odd", odd)
    assert d.attachments and d.result == "any" and d.params is not None
    assert "default" not in d.params[0].to_wire()

    def open_ended(*, a: int, **rest: Any) -> None:
        pass

    assert declare_command("o", open_ended).open


def test_declarations_that_cannot_be_refused_at_registration() -> None:
    async def kw(*, a: int) -> None:
        pass

    with pytest.raises(UsageError, match="declared by its signature"):
        declare_command("kw", kw, params={"a": int})
    with pytest.raises(UsageError, match="parameter 'a'"):
        declare_command("p", lambda p: p, params={"a": "integer"})
    with pytest.raises(UsageError, match=r"\(params\) or \(params, request\)"):
        declare_command("three", lambda a, b, c: None)


def test_params_that_do_not_fit_are_named() -> None:
    def f(*, zone: str, n: int = 1) -> None:
        pass

    d = declare_command("f", f)
    assert check_params(d, {"zone": "a"}) is None
    assert check_params(d, {"zone": "a", "n": "2"}) == (
        "n",
        "parameter 'n' must be int, got str '2'",
    )
    assert check_params(d, {}) == ("zone", "missing required parameter 'zone' (str)")
    assert check_params(d, None) == ("zone", "missing required parameter 'zone' (str)")
    assert check_params(d, {"zone": "a", "zonee": 1}) == (
        "zonee",
        "unknown parameter 'zonee' (declared: zone, n)",
    )
    wrong = check_params(d, [1])
    assert wrong is not None and wrong[0] == "" and "map of named parameters" in wrong[1]


# -- the acceptance component on the three drivers ------------------------------------------
def component(asynchronous: bool) -> dict[str, Callable[..., Any]]:
    """Three annotated handlers: one async (plain on the blocking driver, which runs
    only plain functions: the same declaration), one returning a descriptor, one
    raising ``CommandFailed``."""

    async def get_zone_count_async(*, zone_class: str = "IN", verbose: bool = False) -> int:
        """Count the zones of a class."""
        return {"IN": 3, "CH": 1}.get(zone_class, 0) + (100 if verbose else 0)

    def get_zone_count_plain(*, zone_class: str = "IN", verbose: bool = False) -> int:
        """Count the zones of a class."""
        return {"IN": 3, "CH": 1}.get(zone_class, 0) + (100 if verbose else 0)

    def open_log(*, name: str, append: bool = True) -> Reply:
        """Open a zone's log and hand over its descriptor."""
        r, w = os.pipe()
        try:
            return Reply({"name": name}, fds=[r])
        finally:
            os.close(r)
            os.close(w)

    def remove_zone(*, zone: str, force: bool = False) -> None:
        """Remove a zone."""
        raise CommandFailed("not-found", f"no zone {zone!r}", {"zone": zone})

    return {
        "get_zone_count": get_zone_count_async if asynchronous else get_zone_count_plain,
        "open_log": open_log,
        "remove_zone": remove_zone,
    }


def register(bus: Any, asynchronous: bool) -> None:
    for name, fn in component(asynchronous).items():
        # the synchronous facade has the decorator only
        bus.command(name, raises=["not-found"] if name == "remove_zone" else ())(fn)
    bus.declare_event(
        "zone_added", group="Zones.events", params={"zone": str}, doc="A zone was added."
    )


@asynccontextmanager
async def zones(driver: str, path: Path) -> AsyncIterator[None]:
    """The component named ``zonemgr`` in group ``Zones`` on ``driver``."""
    if driver == "trio":
        async with msgq_trio.connect(path, "zonemgr") as bus:
            register(bus, True)
            await bus.subscribe("Zones")
            yield
        return
    if driver == "asyncio":

        async def setup(bus: Any) -> None:
            register(bus, True)
            await bus.subscribe("Zones")

        async with asyncio_bus(path, "zonemgr", setup):
            yield
        return
    if driver == "sync":  # the blocking facade over the trio client (worker threads)

        def start() -> Any:
            bus = msgq_trio.sync.connect(path, "zonemgr")
            register(bus, False)
            bus.subscribe("Zones")
            return bus

        facade = await trio.to_thread.run_sync(start)
        try:
            yield
        finally:
            await trio.to_thread.run_sync(facade.close)
        return
    direct = msgq_trio.connect_direct(path, "zonemgr")
    register(direct, False)
    direct.subscribe("Zones")
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                direct.serve(0.02)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        await trio.to_thread.run_sync(thread.join, 10)
        direct.close()
    assert not thread.is_alive() and errors == []


DRIVERS = ["trio", "asyncio", "direct", "sync"]


async def test_the_component_is_introspected_identically_on_every_driver(broker: Any) -> None:
    """The same three handlers on the trio, asyncio and blocking drivers (and the
    synchronous facade) answer ``msgq.introspect`` with the same description (only the
    lname differs)."""
    seen = []
    async with msgq_trio.connect(broker.path, "caller") as caller:
        for driver in DRIVERS:
            async with zones(driver, broker.path):
                desc = await caller.call("Zones", INTROSPECT)
            assert desc.pop("lname").startswith("l.")
            seen.append(desc)
    assert all(desc == seen[0] for desc in seen)
    assert seen[0]["version"] == 1 and seen[0]["name"] == "zonemgr"
    assert seen[0]["groups"] == ["Zones"]
    commands = {c["name"]: c for c in seen[0]["commands"]}
    assert list(commands) == ["get_zone_count", "open_log", "remove_zone"]
    assert commands["get_zone_count"] == {
        "name": "get_zone_count",
        "doc": "Count the zones of a class.",
        "params": [
            {"name": "zone_class", "type": "str", "required": False, "default": "IN"},
            {"name": "verbose", "type": "bool", "required": False, "default": False},
        ],
        "result": "int",
        "raises": [],
    }
    assert commands["open_log"]["attachments"] is True
    assert commands["remove_zone"]["raises"] == ["not-found"]
    assert seen[0]["events"] == [
        {
            "name": "zone_added",
            "group": "Zones.events",
            "doc": "A zone was added.",
            "params": [{"name": "zone", "type": "str", "required": True}],
        }
    ]


@pytest.mark.parametrize("driver", DRIVERS)
async def test_keyword_handlers_and_the_callee_side_check(driver: str, broker: Any) -> None:
    """Params arrive as keyword arguments; a wrong type, a missing required or an
    unknown parameter is answered ``bad-request`` naming it (``data`` ``{"param"}``)
    before the handler runs; the handler's own ``CommandFailed`` keeps its code."""
    async with zones(driver, broker.path), msgq_trio.connect(broker.path, "caller") as c:
        assert await c.call("Zones", "get_zone_count") == 3
        assert await c.call("Zones", "get_zone_count", {"zone_class": "CH", "verbose": True}) == 101
        for params, name in [
            ({"zone_class": 5}, "zone_class"),
            ({"verbose": "yes"}, "verbose"),
            ({"zone_clas": "IN"}, "zone_clas"),
        ]:
            with pytest.raises(RemoteError) as info:
                await c.call("Zones", "get_zone_count", params)
            assert info.value.code == ErrorCode.BAD_REQUEST
            assert f"parameter {name!r}" in info.value.message
            assert info.value.message.startswith("get_zone_count: ")
            assert info.value.data == {"param": name}
        with pytest.raises(RemoteError, match="missing required parameter 'zone'") as info:
            await c.call("Zones", "remove_zone", {})
        assert info.value.code == ErrorCode.BAD_REQUEST
        with pytest.raises(RemoteError, match="map of named parameters") as info:
            await c.call("Zones", "get_zone_count", [1])
        assert info.value.code == ErrorCode.BAD_REQUEST
        with pytest.raises(RemoteError, match="no zone 'a'") as info:
            await c.call("Zones", "remove_zone", {"zone": "a"})
        assert info.value.code == "not-found" and info.value.data == {"zone": "a"}
        if driver != "direct":  # the direct driver passes no descriptors
            with await c.request("Zones", "open_log", {"name": "z"}) as answer:
                assert answer.body == {"name": "z"} and len(answer.fds) == 1


async def test_the_check_runs_before_the_handler_and_can_be_turned_off(broker: Any) -> None:
    """With ``check=False`` the handler runs with what came (here a TypeError from the
    call answers ``bad-request``); with the check it never runs for bad params."""
    ran: list[object] = []

    def put(*, key: str) -> str:
        ran.append(key)
        return key

    async with msgq_trio.connect(broker.path, "svc") as svc:
        svc.add_command("checked", put)
        svc.add_command("unchecked", put, check=False)
        svc.add_command("old", ran.append, params={"n": int})
        async with msgq_trio.connect(broker.path, "caller") as c:
            with pytest.raises(RemoteError, match="parameter 'key' must be str"):
                await c.call(svc.lname, "checked", {"key": 1})
            assert ran == []
            assert await c.call(svc.lname, "unchecked", {"key": 1}) == 1
            assert ran == [1]
            with pytest.raises(RemoteError, match="TypeError") as info:
                await c.call(svc.lname, "unchecked", {"nope": 1})
            assert info.value.code == ErrorCode.BAD_REQUEST
            with pytest.raises(RemoteError, match="parameter 'n' must be int"):
                await c.call(svc.lname, "old", {"n": "1"})
            await c.call(svc.lname, "old", {"n": 2})
            assert ran == [1, {"n": 2}]


async def test_a_client_declaring_nothing_still_describes_itself(broker: Any) -> None:
    """Every client answers ``msgq.introspect``: ``fn(params)`` handlers appear with
    ``params`` null; the standard command is reserved and not listed."""

    def peek(store: dict[str, int], params: Any) -> Any:
        """Show a stored value."""
        return store.get(params)

    def put(request: Message) -> None:
        """Store in arrival order."""

    async with msgq_trio.connect(broker.path, "plain") as svc:
        svc.add_command("echo", lambda p: p)
        svc.add_command("peek", functools.partial(peek, {"a": 1}))
        svc.add_inline_command("put", put)
        with pytest.raises(UsageError, match="reserved"):
            svc.add_command("msgq.introspect", lambda p: p)
        async with msgq_trio.connect(broker.path, "caller") as c:
            desc = await c.call(svc.lname, INTROSPECT)
            undeclared = {"params": None, "result": "any", "raises": []}
            assert desc["commands"] == [
                {"name": "echo", "doc": "", **undeclared},
                {"name": "peek", "doc": "Show a stored value.", **undeclared},
                {"name": "put", "doc": "Store in arrival order.", **undeclared},
            ]
            assert desc["groups"] == [] and desc["events"] == []
            with pytest.raises(RemoteError) as info:
                await c.call(svc.lname, "nope")
            assert info.value.data == ["echo", "peek"]
            assert await c.call(svc.lname, "peek", "a") == 1


async def test_an_async_keyword_handler_that_awaits_runs_in_its_task(broker: Any) -> None:
    """A keyword handler that suspends gets its task like any async handler; the check
    still runs before it (in the reader)."""
    started: list[int] = []

    async def slow(*, n: int, request: Message) -> list[Any]:
        started.append(n)
        await trio.sleep(0.01)
        return [n, request.sender_name]

    async with msgq_trio.connect(broker.path, "svc") as svc:
        svc.add_command("slow", slow)
        async with msgq_trio.connect(broker.path, "caller") as c:
            assert await c.call(svc.lname, "slow", {"n": 2}) == [2, "caller"]
            with pytest.raises(RemoteError, match="parameter 'n' must be int"):
                await c.call(svc.lname, "slow", {"n": "2"})
            desc = await c.call(svc.lname, INTROSPECT)
            assert desc["commands"][0]["params"] == [{"name": "n", "type": "int", "required": True}]
    assert started == [2]


def test_declarations_are_plain_values() -> None:
    """A declaration is a frozen value: registering twice gives equal declarations."""

    def f(*, a: int) -> None:
        pass

    assert declare_command("f", f) == declare_command("f", f)
    assert isinstance(declare_command("f", f), CommandDecl)


def test_the_compiled_check_agrees_with_check_params() -> None:
    """The per-request fast path (:func:`compile_check`) refuses exactly what
    :func:`check_params` refuses, for every type of the grammar."""

    def f(
        *,
        s: str = "",
        i: int = 0,
        x: float = 0.0,
        b: bool = False,
        raw: bytes = b"",
        n: None = None,
        o: int | None = None,
        li: list[int] | None = None,
        d: dict[str, str] | None = None,
        a: Any = None,
    ) -> None:
        pass

    decl = declare_command("f", f)
    fast = compile_check(decl)
    values: list[object] = ["s", 1, 1.5, True, False, b"r", None, [1], ["1"], {"k": "v"}, {"k": 1}]
    names = [p.name for p in decl.params or ()]
    for name in names:
        for value in values:
            params = {name: value}
            assert fast(params) == check_params(decl, params), (name, value)
    for params in [None, [], "x", {"zz": 1}, {1: 2}]:
        assert fast(params) == check_params(decl, params), params

    def g(*, need: str) -> None:
        pass

    decl = declare_command("g", g)
    assert compile_check(decl)(None) == check_params(decl, None) is not None
