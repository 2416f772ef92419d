"""Declared interfaces, without I/O: what a client's commands take and answer and which
notifications it emits (:class:`CommandDecl`, :class:`EventDecl`), derived from a
handler's signature and type hints or given explicitly, the parameter check against a
declaration (:func:`check_params`), and the description the standard command
``msgq.introspect`` answers (:func:`describe`; the format is docs/PROTOCOL.md
"Interfaces and introspection").

Types are the CBOR/JSON set, written as strings so that any client (and the C library)
can read them: ``str``, ``int``, ``float``, ``bool``, ``bytes``, ``null``, ``any``,
``list[T]``, ``dict[str, T]`` and unions ``T | U`` (``str | null`` is Optional). Any
other Python annotation is declared ``any``: the declaration never promises what the
wire cannot carry.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from .message import Message, Reply

__all__ = [
    "INTERFACE_VERSION",
    "INTROSPECT",
    "CommandDecl",
    "EventDecl",
    "Param",
    "check_params",
    "check_value",
    "compile_check",
    "declare_command",
    "describe",
    "parse_type",
    "type_name",
]

#: The standard command every client answers (like D-Bus ``Introspect``).
INTROSPECT = "msgq.introspect"
#: Version of the description's format (docs/PROTOCOL.md); a reader ignores fields it does
#: not know, and a change that is not such an addition raises the version.
INTERFACE_VERSION = 1

_SCALARS = {
    str: "str",
    int: "int",
    float: "float",
    bool: "bool",
    bytes: "bytes",
    type(None): "null",
}
_NAMES = frozenset({"str", "int", "float", "bool", "bytes", "null", "any", "list", "dict"})


def type_name(annotation: object) -> str:
    """The declared type string of a Python annotation (``"any"`` where it has none).

    ``str``, ``int``, ``float``, ``bool``, ``bytes``, ``None``; ``list[T]``,
    ``dict[str, T]`` (other key types: ``dict``), ``Optional``/unions; a string already
    in the type grammar is kept; anything else (``Any``, a class, a bare TypeVar): ``any``.
    """
    if isinstance(annotation, str):
        try:
            parse_type(annotation)
        except ValueError:
            return "any"
        return annotation
    if annotation is None:
        return "null"
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    if annotation is list:
        return "list"
    if annotation is dict:
        return "dict"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        names = dict.fromkeys(type_name(a) for a in args)
        return "any" if "any" in names else " | ".join(names)
    if origin in (list, Sequence, Iterable) and len(args) == 1:
        inner = type_name(args[0])
        return "list" if inner == "any" else f"list[{inner}]"
    if origin in (dict, Mapping) and len(args) == 2:
        if args[0] is not str:
            return "dict"
        inner = type_name(args[1])
        return "dict" if inner == "any" else f"dict[str, {inner}]"
    return "any"


# -- the type grammar ------------------------------------------------------------------
#: A parsed type: ("any",), ("str",)..., ("list", item), ("dict", value), ("union", alts).
_Parsed = tuple[Any, ...]


def parse_type(text: str) -> _Parsed:
    """``text`` in the type grammar, parsed.

    Raises:
        ValueError: ``text`` is not in the grammar (names the part that is not).
    """
    parsed, rest = _parse_union(text.strip(), text)
    if rest.strip():
        raise ValueError(f"type {text!r}: unexpected {rest.strip()!r}")
    return parsed


def _parse_union(s: str, whole: str) -> tuple[_Parsed, str]:
    alts = []
    while True:
        one, s = _parse_one(s.lstrip(), whole)
        alts.append(one)
        s = s.lstrip()
        if not s.startswith("|"):
            break
        s = s[1:]
    return (alts[0] if len(alts) == 1 else ("union", tuple(alts))), s


def _parse_one(s: str, whole: str) -> tuple[_Parsed, str]:
    n = 0
    while n < len(s) and (s[n].isalpha() or s[n] == "_"):
        n += 1
    name, s = s[:n], s[n:]
    if name not in _NAMES:
        raise ValueError(f"type {whole!r}: unknown type {name or s[:10]!r}")
    if name not in ("list", "dict") or not s.startswith("["):
        return ((name,) if name not in ("list", "dict") else (name, ("any",))), s
    s = s[1:].lstrip()
    if name == "dict":
        if not s.startswith("str"):
            raise ValueError(f"type {whole!r}: a dict's keys are str")
        s = s[3:].lstrip()
        if not s.startswith(","):
            raise ValueError(f"type {whole!r}: expected ', ' after dict[str")
        s = s[1:]
    inner, s = _parse_union(s, whole)
    s = s.lstrip()
    if not s.startswith("]"):
        raise ValueError(f"type {whole!r}: missing ']'")
    return (name, inner), s[1:]


def _fits(parsed: _Parsed, value: object) -> bool:
    kind = parsed[0]
    if kind == "any":
        return True
    if kind == "union":
        return any(_fits(p, value) for p in parsed[1])
    if kind == "null":
        return value is None
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":  # an integral number is a float's value too (JSON writes 1, not 1.0)
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "bytes":
        return isinstance(value, (bytes, bytearray, memoryview))
    if kind == "list":
        return isinstance(value, (list, tuple)) and all(_fits(parsed[1], v) for v in value)
    if kind == "dict":
        return isinstance(value, dict) and all(
            isinstance(k, str) and _fits(parsed[1], v) for k, v in value.items()
        )
    return False


#: The scalar types' checks as the fast path of :func:`compile_check` (the same as
#: :func:`_fits`: bool is not an int, an int is a float's value).
_SCALAR_CHECKS: dict[str, Callable[[object], bool]] = {
    "any": lambda v: True,
    "null": lambda v: v is None,
    "bool": lambda v: v is True or v is False,
    "int": lambda v: type(v) is int or (isinstance(v, int) and not isinstance(v, bool)),
    "float": lambda v: (
        type(v) is float or (isinstance(v, (int, float)) and not isinstance(v, bool))
    ),
    "str": lambda v: isinstance(v, str),
}


def _predicate(parsed: _Parsed) -> Callable[[object], bool]:
    """A check of values against ``parsed``: a scalar's without the walk of
    :func:`_fits`, any other type through it."""
    fast = _SCALAR_CHECKS.get(parsed[0])
    if fast is not None:
        return fast
    return lambda v: _fits(parsed, v)


def _kind_of(value: object) -> str:
    if value is None:
        return "null"
    for t in (bool, int, float, str, bytes):
        if isinstance(value, t):
            return _SCALARS[t]
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


def check_value(type_text: str, value: object) -> bool:
    """Whether ``value`` (decoded CBOR) is of the declared type ``type_text``; a type
    this reader cannot parse (a newer grammar) accepts anything."""
    parsed = _parsed(type_text)
    return True if parsed is None else _fits(parsed, value)


@functools.lru_cache(maxsize=1024)  # bounded: the types of declared parameters are few
def _parsed(type_text: str) -> _Parsed | None:
    """``type_text`` parsed once (the check runs per request), None if not parsable."""
    try:
        return parse_type(type_text)
    except ValueError:
        return None


# -- declarations ----------------------------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One declared parameter: its ``name``, ``type`` (a Python annotation or a type
    string; kept as the string), whether it is ``required``, its ``default`` (when not
    required and the wire can carry it) and a one-line ``doc``.

    In ``add_command(..., params={...})`` the mapping's key is the name:
    ``{"zone": str, "verbose": Param(type=bool, required=False, default=False)}``.
    """

    name: str = ""
    type: Any = "any"
    required: bool = True
    default: Any = None
    doc: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", type_name(self.type))

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "type": self.type, "required": self.required}
        if not self.required and _wire_value(self.default):
            out["default"] = self.default
        if self.doc:
            out["doc"] = self.doc
        return out


def _wire_value(value: object) -> bool:
    """Whether CBOR (and JSON, for the command line) carries ``value`` as it is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_wire_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _wire_value(v) for k, v in value.items())
    return False


@dataclass(frozen=True)
class CommandDecl:
    """A command's declaration. ``params`` None: not declared (a ``fn(params)`` handler
    given no ``params=``), nothing is checked. ``keywords``: the handler takes the
    params as keyword arguments; ``request_arg`` names its keyword parameter that gets
    the request :class:`Message`; ``open``: it takes ``**kwargs`` (unknown parameters are
    let through). ``attachments``: the answer may carry blobs and descriptors (the
    handler returns a :class:`Reply`)."""

    name: str
    params: tuple[Param, ...] | None = None
    result: str = "any"
    raises: tuple[str, ...] = ()
    doc: str = ""
    attachments: bool = False
    keywords: bool = False
    request_arg: str | None = None
    open: bool = False
    check: bool = False

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "doc": self.doc,
            "params": None if self.params is None else [p.to_wire() for p in self.params],
            "result": self.result,
            "raises": list(self.raises),
        }
        if self.attachments:
            out["attachments"] = True
        return out


@dataclass(frozen=True)
class EventDecl:
    """A notification this client emits: ``name``, the ``group`` it goes to (None: any),
    its ``params`` (None: not declared) and a one-line ``doc``."""

    name: str
    group: str | None = None
    params: tuple[Param, ...] | None = None
    doc: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "group": self.group,
            "doc": self.doc,
            "params": None if self.params is None else [p.to_wire() for p in self.params],
        }


def first_line(doc: str | None) -> str:
    """The first line of a docstring (its summary), stripped."""
    return (inspect.cleandoc(doc).split("\n", 1)[0].strip()) if doc else ""


def doc_of(fn: object) -> str:
    """The first docstring line of a handler: of the function a ``functools.partial``
    wraps; none for other callables (a builtin's or a class's docstring is not about the
    command)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        return first_line(fn.__doc__)
    return ""


def explicit_params(
    params: Mapping[str, Any] | Sequence[Param] | None,
) -> tuple[Param, ...] | None:
    """``params=`` of ``add_command``/``declare_event`` as declarations: a mapping of
    name to a type (required) or a :class:`Param`, or a sequence of named ``Param``.

    Raises:
        UsageError: a parameter without a name, or a type string not in the grammar.
    """
    if params is None:
        return None
    out: list[Param] = []
    items = params.items() if isinstance(params, Mapping) else ((p.name, p) for p in params)
    for name, spec in items:
        p = spec if isinstance(spec, Param) else Param(name, spec)
        if isinstance(spec, str):
            try:
                parse_type(spec)
            except ValueError as exc:
                raise UsageError(f"parameter {name!r}: {exc}") from None
        if not name or not isinstance(name, str):
            raise UsageError(f"a declared parameter needs a name: {spec!r}")
        out.append(Param(name, p.type, p.required, p.default, p.doc))
    return tuple(out)


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: declared "any"
        return {}


def declare_command(
    name: str,
    fn: Callable[..., Any],
    *,
    params: Mapping[str, Any] | Sequence[Param] | None = None,
    result: Any = None,
    doc: str | None = None,
    raises: Iterable[str] = (),
    check: bool | None = None,
) -> CommandDecl:
    """The declaration of ``fn`` answering ``name``.

    A handler whose parameters are all keyword-only (``async def f(*, zone: str,
    verbose: bool = False) -> int``, or none at all) takes the params as keyword
    arguments and is declared from its signature and type hints; a keyword-only
    parameter annotated :class:`Message` gets the request and is not declared. Any other
    handler is ``fn(params)`` or ``fn(params, request)``, declared by ``params=`` (or not
    at all). ``result``, ``doc`` and ``raises`` override what the signature and
    docstring say. ``check`` (default: on where parameters are declared) makes the
    client answer ``bad-request`` naming the parameter before the handler runs.

    Raises:
        UsageError: ``fn``'s signature fits neither form, or ``params=`` is given for a
            keyword handler (its signature is the declaration) or is malformed.
    """
    sig = inspect.signature(fn)
    ps = list(sig.parameters.values())
    keyword = all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in ps)
    hints = _hints(fn)
    ret = hints.get("return", sig.return_annotation)
    attachments = ret is Reply
    if result is None:
        result = "any" if ret is sig.empty or attachments else type_name(ret)
    declared: tuple[Param, ...] | None
    request_arg = None
    is_open = False
    if keyword:
        if params is not None:
            raise UsageError(
                f"command {name!r}: a keyword handler is declared by its signature, not params="
            )
        found = []
        for p in ps:
            if p.kind == p.VAR_KEYWORD:
                is_open = True
                continue
            hint = hints.get(p.name, p.annotation)
            if hint is Message:
                request_arg = p.name
                continue
            required = p.default is p.empty
            found.append(
                Param(
                    p.name,
                    "any" if hint is p.empty else type_name(hint),
                    required,
                    None if required else p.default,
                )
            )
        declared = tuple(found)
    else:
        if len(ps) not in (1, 2):
            raise UsageError(
                "a command handler takes (params) or (params, request), or keyword-only "
                "parameters (*, name: type = default)"
            )
        declared = explicit_params(params)
    return CommandDecl(
        name=name,
        params=declared,
        result=type_name(result),
        raises=tuple(str(r) for r in raises),
        doc=doc_of(fn) if doc is None else doc,
        attachments=attachments,
        keywords=keyword,
        request_arg=request_arg,
        open=is_open,
        check=(declared is not None) if check is None else (check and declared is not None),
    )


def check_params(decl: CommandDecl | EventDecl, params: object) -> tuple[str, str] | None:
    """What is wrong with ``params`` for ``decl``: (parameter name, reason), or None.

    Checks that ``params`` is a map (or null, for no parameters), that every required
    parameter is there, that none is unknown (unless the handler takes ``**kwargs``) and
    that each declared one has its declared type. The parameter name is ``""`` when the
    whole params are wrong.
    """
    declared = decl.params
    if declared is None:
        return None
    if params is None:
        params = {}
    if not isinstance(params, dict):
        names = ", ".join(p.name for p in declared) or "none"
        return "", f"params must be a map of named parameters ({names}), not {_kind_of(params)}"
    by_name = {p.name: p for p in declared}
    for p in declared:
        if p.required and p.name not in params:
            return p.name, f"missing required parameter {p.name!r} ({p.type})"
    for key, value in params.items():
        found = by_name.get(key)
        if found is None:
            if isinstance(decl, CommandDecl) and decl.open:
                continue
            known = ", ".join(by_name) or "none"
            return str(key), f"unknown parameter {key!r} (declared: {known})"
        if not check_value(found.type, value):
            why = f"must be {found.type}, got {_kind_of(value)} {value!r:.40}"
            return key, f"parameter {key!r} {why}"
    return None


def compile_check(decl: CommandDecl) -> Callable[[Any], tuple[str, str] | None]:
    """:func:`check_params` for ``decl`` as a function made once, for the check every
    request of a declared command passes: the types parsed, the names looked up in a
    dict; only params that fail go through :func:`check_params` for the message."""
    declared = decl.params or ()
    types_by_name = {p.name: _predicate(_parsed(p.type) or ("any",)) for p in declared}
    required = [p.name for p in declared if p.required]
    is_open = decl.open

    def check(params: Any) -> tuple[str, str] | None:
        if params is None:
            return check_params(decl, params) if required else None
        if type(params) is not dict:
            return check_params(decl, params)
        for name in required:
            if name not in params:
                return check_params(decl, params)
        for key, value in params.items():
            fits = types_by_name.get(key)
            if fits is None:
                if is_open:
                    continue
                return check_params(decl, params)
            if not fits(value):
                return check_params(decl, params)
        return None

    return check


@dataclass
class Interface:
    """What one client declares: its commands' and events' declarations, by name."""

    commands: dict[str, CommandDecl] = field(default_factory=dict)
    events: dict[str, EventDecl] = field(default_factory=dict)


def describe(name: str, lname: str, groups: Iterable[str], interface: Interface) -> dict[str, Any]:
    """The answer to ``msgq.introspect`` (docs/PROTOCOL.md): this client's ``name``,
    ``lname``, joined ``groups``, its commands and events, sorted by name."""
    return {
        "version": INTERFACE_VERSION,
        "name": name,
        "lname": lname,
        "groups": list(groups),
        "commands": [interface.commands[c].to_wire() for c in sorted(interface.commands)],
        "events": [interface.events[e].to_wire() for e in sorted(interface.events)],
    }
