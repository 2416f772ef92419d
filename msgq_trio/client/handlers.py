"""The handler contract of every driver, without I/O: how a command handler is
called (:func:`as_handler`, :func:`never_suspends`), the request event for it, and
what its result or exception answers (:class:`HandlerContract`, the session's part
that encodes answers)."""

from __future__ import annotations

import dis
import inspect
import logging
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..errors import (
    CommandFailed,
    ConnectionLost,
    MalformedMessage,
    UsageError,
)
from ..protocol.codes import ErrorCode
from ..protocol.errors import LocalProtocolError, RemoteProtocolError
from ..protocol.framing import (
    close_fds,
    encode_cbor,
    encode_frame,
    encode_simple,
)
from .interface import (
    INTROSPECT,
    CommandDecl,
    EventDecl,
    Interface,
    Param,
    check_params,
    compile_check,
    declare_command,
    describe,
    doc_of,
    explicit_params,
    first_line,
)
from .message import (
    Buffer,
    Message,
    Reply,
)
from .wire import ERROR as _ERROR
from .wire import REPLY as _REPLY

log = logging.getLogger("msgq_trio.client")

__all__ = [
    "INTROSPECT",
    "Handler",
    "HandlerContract",
    "InlineHandler",
    "Request",
    "as_handler",
    "never_suspends",
]


#: A command handler as the session stores it: ``fn(params, request)``, returning the
#: result (or an awaitable of it, for a driver that can await).
Handler = Callable[[Any, Message], Any]
#: A handler that answers by itself (:meth:`Session.encode_answer`), called in order.
InlineHandler = Callable[[Message], None]


def as_handler(fn: Callable[..., Any], decl: CommandDecl | None = None) -> Handler:
    """``fn`` as a :data:`Handler` (called ``handler(params, request)``), following its
    declaration ``decl`` (:func:`~msgq_trio.client.interface.declare_command`; derived
    from ``fn`` when None).

    * ``fn(params, request)``: itself; ``fn(params)``: called without the request;
    * keyword-only parameters: called with the params map as keyword arguments (and the
      request for a parameter annotated ``Message``); params that are not a map answer
      ``bad-request``;
    * with ``decl.check``: params that do not fit the declaration answer ``bad-request``
      naming the parameter (``data`` ``{"param": name}``) before ``fn`` runs.

    Raises:
        UsageError: ``fn`` takes neither (params), (params, request) nor keyword-only
            parameters.
    """
    if decl is None:
        decl = declare_command(getattr(fn, "__name__", "command"), fn)
    if decl.keywords:
        return _keyword_handler(fn, decl)
    nparams = len(inspect.signature(fn).parameters)
    if decl.check:
        two = nparams == 2
        wrong = compile_check(decl)

        def checked(params: Any, request: Message) -> Any:
            if wrong(params) is not None:
                _refuse_bad_params(decl, params)
            return fn(params, request) if two else fn(params)

        return checked
    if nparams == 2:
        return fn
    return lambda params, _request: fn(params)


def _refuse_bad_params(decl: CommandDecl, params: Any) -> None:
    wrong = check_params(decl, params)
    if wrong is not None:
        # The caller's fault: bad-request, naming the parameter and the command.
        raise CommandFailed(ErrorCode.BAD_REQUEST, f"{decl.name}: {wrong[1]}", {"param": wrong[0]})


def _keyword_handler(fn: Callable[..., Any], decl: CommandDecl) -> Handler:
    """``fn(**params)`` as a :data:`Handler`."""
    request_arg = decl.request_arg
    wrong = compile_check(decl) if decl.check else None

    def keywords(params: Any, request: Message) -> Any:
        if wrong is not None and wrong(params) is not None:
            _refuse_bad_params(decl, params)
        if params is None:
            params = {}
        elif not isinstance(params, dict):
            raise CommandFailed(
                ErrorCode.BAD_REQUEST,
                f"{decl.name}: params must be a map of named parameters, "
                f"not {type(params).__name__}",
                {"param": ""},
            )
        if request_arg is not None:
            params = {**params, request_arg: request}
        return fn(**params)  # a name fn does not take: TypeError, answered bad-request

    return keywords


#: Bytecode that lets a coroutine suspend (an ``await``, ``async with``, ``async for``).
_SUSPENDING_OPS = frozenset(
    {"GET_AWAITABLE", "SEND", "YIELD_VALUE", "BEFORE_ASYNC_WITH", "GET_AITER", "GET_ANEXT"}
)
_never_suspends: dict[types.CodeType, bool] = {}


def never_suspends(coro: object) -> bool:
    """Whether ``coro`` is a coroutine whose code has no ``await``, ``async with`` or
    ``async for``: it cannot suspend, so running it to its end with one ``send(None)``
    is the same as awaiting it, in any event loop, without a task. (An ``async def``
    handler that only computes its answer is common: the README's is one.) Cached per
    code object.
    """
    if not isinstance(coro, types.CoroutineType):
        return False
    code = coro.cr_code
    hit = _never_suspends.get(code)
    if hit is None:
        hit = not any(i.opname in _SUSPENDING_OPS for i in dis.get_instructions(code))
        if len(_never_suspends) < 4096:  # bounded: handlers are few, code objects fixed
            _never_suspends[code] = hit
    return hit


class Request:
    """Event: a request for a handler of this client.

    ``inline`` set: call ``inline(message)`` now, in arrival order; it answers by itself.
    Otherwise call ``handler(message.body, message)`` and send
    :meth:`Session.answer_for` of its outcome."""

    __slots__ = ("handler", "inline", "message")

    def __init__(
        self, message: Message, handler: Handler | None, inline: InlineHandler | None
    ) -> None:
        self.message = message
        self.handler = handler
        self.inline = inline


class HandlerContract:
    """The session's answers to requests: encoders of REPLY and ERROR and the mapping
    of a handler's outcome to its answer (mixed into
    :class:`~msgq_trio.client.session.Session`, whose state it reads)."""

    name: str
    lname: str
    stamp: bytes
    lost: ConnectionLost | None
    commands: dict[str, Handler]
    inline: dict[str, InlineHandler]
    groups: dict[str, None]
    #: What this client declares (its commands' and events' declarations).
    interface: Interface
    _targets: dict[str, bytes]
    target: Callable[[str], bytes]
    attach_fds: Callable[..., list[Buffer]]

    # -- declared commands and events (client/interface.py) ------------------------------
    def add_command(
        self,
        name: str,
        fn: Callable[..., Any],
        *,
        params: Mapping[str, Any] | Sequence[Param] | None = None,
        result: Any = None,
        doc: str | None = None,
        raises: Iterable[str] = (),
        check: bool | None = None,
        run: Callable[[Handler], Handler] | None = None,
    ) -> CommandDecl:
        """Register ``fn`` to answer ``name`` with its declaration (the arguments are
        :func:`~msgq_trio.client.interface.declare_command`'s); returns the declaration.
        ``run`` wraps the handler :func:`as_handler` makes (the synchronous facade runs
        it in a worker thread), the check included.

        Raises:
            UsageError: ``fn``'s signature fits no handler form, the declaration is
                malformed, or ``name`` is a standard command (``msgq.``).
        """
        if name.startswith("msgq."):
            raise UsageError(f"command names starting with 'msgq.' are reserved: {name!r}")
        decl = declare_command(
            name, fn, params=params, result=result, doc=doc, raises=raises, check=check
        )
        handler = as_handler(fn, decl)
        self.commands[name] = handler if run is None else run(handler)
        self.interface.commands[name] = decl
        return decl

    def declare_event(
        self,
        name: str,
        *,
        group: str | None = None,
        params: Mapping[str, Any] | Sequence[Param] | None = None,
        doc: str = "",
    ) -> EventDecl:
        """Declare that this client emits notification ``name`` (to ``group``; None: to
        any), with ``params`` as for commands: only described by ``msgq.introspect``,
        never checked on sending.

        Raises:
            UsageError: ``params`` is malformed.
        """
        decl = EventDecl(name, group, explicit_params(params), first_line(doc))
        self.interface.events[name] = decl
        return decl

    def introspect(self, _params: Any, _request: Message) -> dict[str, Any]:
        """The handler of the standard command ``msgq.introspect``: this client's
        description (docs/PROTOCOL.md "Interfaces and introspection"). Commands it answers
        without a declaration (inline handlers, handlers put in :attr:`commands`
        directly) are listed too, their params undeclared."""
        declared = self.interface.commands
        undeclared = {
            name: CommandDecl(name, doc=doc_of(fn))
            for table in (self.commands, self.inline)
            for name, fn in table.items()
            if name not in declared and name != INTROSPECT
        }
        if not undeclared:
            return describe(self.name, self.lname, self.groups, self.interface)
        everything = Interface({**undeclared, **declared}, self.interface.events)
        return describe(self.name, self.lname, self.groups, everything)

    def encode_answer(
        self, request: Message, result: Any = None, attachments: Sequence[Buffer] = ()
    ) -> list[Buffer]:
        """The REPLY to ``request`` with ``result`` and binary ``attachments``.

        Raises:
            UsageError: ``result`` cannot be encoded.
        """
        try:
            return encode_frame(
                _REPLY,
                target=request._reply_to,
                request_id=request.request_id,
                body=encode_cbor(result) if result is not None else b"",
                blobs=attachments,
                source=self.stamp,
            )
        except LocalProtocolError as exc:
            raise UsageError(f"answer cannot be encoded: {exc}") from exc

    def encode_error(
        self, request: Message, code: str, message: str, data: object = None
    ) -> list[Buffer]:
        """The ERROR answer ``code`` to ``request``.

        Raises:
            UsageError: ``data`` cannot be encoded.
        """
        try:
            return encode_frame(
                _ERROR,
                target=request._reply_to,
                request_id=request.request_id,
                header=encode_cbor({"code": str(code), "message": message}),
                body=encode_cbor(data) if data is not None else b"",
                source=self.stamp,
            )
        except LocalProtocolError as exc:
            raise UsageError(f"error answer cannot be encoded: {exc}") from exc

    # -- the handler contract ----------------------------------------------------------
    def answer_for(
        self, request: Message, result: Any, error: Exception | None
    ) -> list[Buffer] | None:
        """The answer to ``request`` for its handler's ``result``, or for the exception
        ``error`` it raised. This is the handler contract of every driver:

        * a value: the answer (CBOR); a :class:`~msgq_trio.client.message.Reply`: the
          answer with its blobs and descriptors (refused where the connection cannot
          pass descriptors);
        * :class:`~msgq_trio.errors.CommandFailed` ``(code, message, data)``: that error;
        * :class:`~msgq_trio.errors.MalformedMessage` (the request's body or header is
          not well-formed CBOR): ``bad-request`` with its message, which names the
          caller whose bug it is;
        * ``TypeError``, ``ValueError``, ``KeyError`` (the params did not fit):
          ``bad-request`` naming the exception's type;
        * :class:`~msgq_trio.errors.UsageError` or a result CBOR cannot encode:
          ``internal-error`` "handler result cannot be encoded";
        * :class:`~msgq_trio.errors.ConnectionLost` while this connection is lost: None,
          no answer (nobody to send it to; the driver raises or drops it);
        * any other exception: ``internal-error`` naming its type (``data`` ``{"type":
          name}``), logged with its traceback: the handler's bug.

        The request's descriptors that the handler did not take are closed here.
        """
        try:
            if error is not None:
                raise error
            if isinstance(result, Reply):
                try:
                    pieces = encode_frame(
                        _REPLY,
                        target=request._reply_to,
                        request_id=request.request_id,
                        body=encode_cbor(result.result) if result.result is not None else b"",
                        blobs=result.attachments,
                        n_fds=len(result.fds),
                        source=self.stamp,
                    )
                except BaseException:
                    close_fds(result.fds)
                    raise
                if result.fds:
                    pieces = self.attach_fds(pieces, result.fds, owned=True)
                return pieces
            reply_to = request._reply_to
            return [
                encode_simple(
                    _REPLY,
                    self._targets.get(reply_to) or self.target(reply_to),
                    encode_cbor(result) if result is not None else b"",
                    request_id=request.request_id,
                    source=self.stamp,
                )
            ]
        except CommandFailed as exc:
            return self.encode_error(request, str(exc.code), exc.message, exc.data)
        except MalformedMessage as exc:
            return self.encode_error(request, ErrorCode.BAD_REQUEST, str(exc))
        except (TypeError, ValueError, KeyError, RemoteProtocolError) as exc:
            return self.encode_error(request, ErrorCode.BAD_REQUEST, f"{type(exc).__name__}: {exc}")
        except (LocalProtocolError, UsageError) as exc:
            return self.encode_error(
                request, ErrorCode.INTERNAL_ERROR, f"handler result cannot be encoded: {exc}"
            )
        except ConnectionLost as exc:
            if self.lost is not None:
                return None
            return self._internal_error(request, exc)
        except Exception as exc:
            return self._internal_error(request, exc)
        finally:
            request.close()  # descriptors the handler did not take_fds() are closed here

    def _internal_error(self, request: Message, exc: Exception) -> list[Buffer]:
        log.error("handler for %r raised", request.command, exc_info=exc)
        return self.encode_error(
            request,
            ErrorCode.INTERNAL_ERROR,
            f"{type(exc).__name__}: {exc}",
            {"type": type(exc).__name__},
        )

    def inline_failed(self, request: Message, exc: Exception) -> list[Buffer]:
        """The answer when an inline handler raised: ``internal-error``, logged. Not
        :meth:`answer_for`: an inline handler decodes the request and answers by itself,
        so its exception is its own bug, never the caller's ``bad-request``."""
        log.error("inline handler for %r raised", request.command, exc_info=exc)
        return self.encode_error(request, ErrorCode.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")

    def unknown_command(self, request: Message, command: str | None) -> list[Buffer]:
        """``unknown-command`` for a request no handler takes; ``data`` lists ours (not the
        standard ``msgq.introspect``, which tells more)."""
        request.close()
        return self.encode_error(
            request,
            ErrorCode.UNKNOWN_COMMAND,
            f"{self.name} ({self.lname}) has no command {command!r}",
            sorted(c for c in self.commands if c != INTROSPECT),  # the standard one aside
        )
