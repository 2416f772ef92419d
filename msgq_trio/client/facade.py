"""What every client driver shows of its session: the connection's identity and the
registration of command handlers with their declarations. The trio and asyncio
clients (client/async_bus.py) and the blocking one (client/direct.py) inherit it, so
each of these exists once; a driver only refuses the handler forms it cannot run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .interface import Param
from .session import Session

__all__ = ["SessionView"]

#: A command handler in any of its forms (client/handlers.py, ``as_handler``).
Handler = Callable[..., Any]


class SessionView:
    """The connection's identity, read from the session, and the command table's
    registration: shared by every driver (the blocking ``DirectBus`` too)."""

    _s: Session

    @property
    def name(self) -> str:
        """The client name sent in HELLO."""
        return self._s.name

    @property
    def lname(self) -> str:
        """This connection's unique address, assigned by the broker (``l.N``)."""
        return self._s.lname

    @property
    def broker_version(self) -> str:
        """The broker's version from WELCOME."""
        return self._s.broker_version

    @property
    def session(self) -> Session:
        """The sans-I/O protocol state under this driver (for plugin clients and tests)."""
        return self._s

    # -- serving commands ----------------------------------------------------------------
    def command(
        self,
        name: str,
        *,
        params: Mapping[str, Any] | Sequence[Param] | None = None,
        result: Any = None,
        doc: str | None = None,
        raises: Iterable[str] = (),
        check: bool | None = None,
    ) -> Callable[[Handler], Handler]:
        """Decorator: register ``fn`` to answer requests for ``name``.

        ``fn(params)``, ``fn(params, request)`` or ``fn(*, name: type = default, ...)``
        (keyword-only parameters: the request's params map as keyword arguments), a
        plain function or (on the trio and asyncio clients) an ``async def``. On those
        a plain function is called by the reader as the request arrives, without a task
        (it must not block: it would block the whole event loop in a task too), and an
        ``async def`` runs in a task of its own per request; the blocking client runs
        plain functions only, in the thread inside whichever method is waiting.
        What the result or exception answers is the one handler contract of every
        driver (:meth:`msgq_trio.client.session.Session.answer_for`): the return value
        (or a :class:`~msgq_trio.client.message.Reply`) is the answer;
        ``CommandFailed(code, message, data)`` answers with that error;
        ``TypeError``/``ValueError``/``KeyError`` and a malformed request answer
        ``bad-request``; any other exception ``internal-error`` naming its type.

        The declaration (what ``msgq.introspect`` answers; client/interface.py) comes
        from a keyword handler's signature and type hints, else from ``params=`` (a map
        of name to type or :class:`~msgq_trio.client.interface.Param`); ``result``,
        ``doc`` (default: the docstring's first line) and ``raises`` (error codes)
        complete it. ``check`` (default: on where parameters are declared) answers
        params that do not fit ``bad-request`` naming the parameter, before ``fn`` runs.

        Raises:
            UsageError: ``fn`` fits none of the handler forms, or the declaration is
                malformed.
        """

        def register(fn: Handler) -> Handler:
            self.add_command(
                name, fn, params=params, result=result, doc=doc, raises=raises, check=check
            )
            return fn

        return register

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
    ) -> None:
        """Register ``fn`` for ``name`` (see :meth:`command`).

        Raises:
            UsageError: ``fn`` fits none of the handler forms (or is async on the
                blocking client), or the declaration is malformed.
        """
        self._check_handler(fn)
        self._s.add_command(
            name, fn, params=params, result=result, doc=doc, raises=raises, check=check
        )

    def _check_handler(self, fn: Handler) -> None:
        """Refuse a handler this driver cannot run (UsageError); every form by default."""

    def declare_event(
        self,
        name: str,
        *,
        group: str | None = None,
        params: Mapping[str, Any] | Sequence[Param] | None = None,
        doc: str = "",
    ) -> None:
        """Declare notification ``name`` (sent to ``group``) that this client emits, for
        ``msgq.introspect`` (see :meth:`~msgq_trio.client.session.Session.declare_event`)."""
        self._s.declare_event(name, group=group, params=params, doc=doc)
