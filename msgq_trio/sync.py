"""Synchronous client for code that is not async: scripts, tools, tests.

``msgq_trio.sync.connect(...)`` runs a trio loop with an ordinary :class:`msgq_trio.Bus`
in a background thread; every method blocks the calling thread until the loop has done
the work and raises the same exceptions as the async client (``NoRecipient``,
``RecipientGone``, ``RequestTimeout``, ``RemoteError``, ``ConnectionLost``...).
:func:`msgq_trio.connect_direct` is the leaner alternative for calls and messages: no
background thread, the calling thread does the socket I/O (``client/direct.py``).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import trio

from .client.bus import Bus, Message
from .client.bus import connect as aconnect
from .client.queue import Queue, QueueMessage
from .client.reconnect import Reconnect
from .errors import ConnectionLost, UsageError

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class _InLoop(Generic[T_co]):
    """A blocking object over an object of the trio loop thread (``_target``): the
    base of the facades whose methods :func:`_blocking` and :func:`_blocking_sync`
    derive from the async API."""

    @property
    def _target(self) -> T_co:
        raise NotImplementedError

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _run_sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def _blocking(
    fn: Callable[Concatenate[T, P], Awaitable[R]],
) -> Callable[Concatenate[_InLoop[T], P], R]:
    """The blocking method of an async method ``fn``: same name, signature and
    docstring; it runs ``fn`` on the facade's target in the loop thread and blocks the
    calling thread until it is done, raising what ``fn`` raises."""

    @functools.wraps(fn)
    def method(self: _InLoop[T], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(fn, self._target, *args, **kwargs)  # type: ignore[no-any-return]

    return method


def _blocking_sync(fn: Callable[Concatenate[T, P], R]) -> Callable[Concatenate[_InLoop[T], P], R]:
    """:func:`_blocking` for a plain (non-async) method ``fn``: it still runs in the
    loop thread, since the target's state belongs to it."""

    @functools.wraps(fn)
    def method(self: _InLoop[T], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run_sync(fn, self._target, *args, **kwargs)  # type: ignore[no-any-return]

    return method


def _blocking_flushed(
    fn: Callable[Concatenate[Bus, P], Awaitable[None]],
) -> Callable[Concatenate[SyncBus, P], None]:
    """:func:`_blocking` for a send (``fn`` queues a frame), which then also waits
    until everything queued is written to the socket: a script that sends and exits
    must not lose what is still queued in the loop thread."""

    async def send_and_flush(bus: Bus, *args: Any, **kwargs: Any) -> None:
        await fn(bus, *args, **kwargs)
        await bus.flush()

    @functools.wraps(fn)
    def method(self: SyncBus, /, *args: P.args, **kwargs: P.kwargs) -> None:
        self._run(send_and_flush, self._target, *args, **kwargs)

    method.__doc__ = (
        inspect.cleandoc(fn.__doc__ or "")
        + "\n\nThe blocking call returns once the message is written to the socket."
    )
    return method


class SyncBus(_InLoop[Bus]):
    """A blocking facade over :class:`msgq_trio.Bus`. Create it with :func:`connect`.

    Each method is the :class:`msgq_trio.Bus` method of the same name, run in the
    background thread's trio loop: it blocks the calling thread until the loop has
    done the work and raises what the async method raises. Sends return once the
    message is written to the socket.

    Resource handling: :meth:`close` (or leaving the ``with`` block) closes the
    connection and joins the background thread. Command handlers registered here run in
    worker threads (``trio.to_thread``), so a slow handler never blocks the connection.
    """

    def __init__(
        self, socket: str | os.PathLike[str] | None, name: str | None, **options: Any
    ) -> None:
        self._ready: queue.Queue[BaseException | None] = queue.Queue()
        self._bus: Bus | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(
            target=trio.run,
            args=(functools.partial(self._main, **options), socket, name),
            name="msgq-trio-sync",
            daemon=True,
        )
        self._thread.start()
        err = self._ready.get()
        if err is not None:
            self._thread.join()
            raise err

    async def _main(
        self, socket: str | os.PathLike[str] | None, name: str | None, **options: Any
    ) -> None:
        try:
            async with aconnect(socket, name, **options) as bus:
                self._bus = bus
                self._token = trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                self._ready.put(None)
                await self._stop.wait()
        except BaseException as exc:
            if self._bus is None:
                self._ready.put(exc)
                return
            raise

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._in_loop(trio.from_thread.run, fn, *args, **kwargs)

    def _run_sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._in_loop(trio.from_thread.run_sync, fn, *args, **kwargs)

    def _in_loop(
        self, run: Callable[..., Any], fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        if self._token is None or self._stop is None or self._stop.is_set():
            raise UsageError("the bus is closed")
        try:
            return run(functools.partial(fn, *args, **kwargs), trio_token=self._token)
        except trio.RunFinishedError as exc:
            raise ConnectionLost("the bus's background loop has ended") from exc

    @property
    def _target(self) -> Bus:
        return self.bus

    @property
    def bus(self) -> Bus:
        assert self._bus is not None
        return self._bus

    @property
    def lname(self) -> str:
        """This connection's lname (a new one after each reconnect)."""
        return self.bus.lname

    @property
    def reconnects(self) -> int:
        """How many times the bus reconnected (``connect(..., reconnect=...)``)."""
        return self.bus.reconnects

    wait_connected = _blocking(Bus.wait_connected)
    call = _blocking(Bus.call)
    request = _blocking(Bus.request)
    call_all = _blocking(Bus.call_all)
    call_many = _blocking(Bus.call_many)
    send = _blocking_flushed(Bus.send)
    send_many = _blocking_flushed(Bus.send_many)
    notify = _blocking_flushed(Bus.notify)
    subscribe = _blocking(Bus.subscribe)
    unsubscribe = _blocking(Bus.unsubscribe)
    members = _blocking(Bus.members)
    version = _blocking(Bus.version)

    def receive(self, timeout: float | None = None) -> Message:
        """The next message or notification.

        Raises:
            TimeoutError: nothing arrived within ``timeout`` seconds.
            ConnectionLost: the connection ended.
        """
        try:
            return self._run(self.bus.receive, timeout)  # type: ignore[no-any-return]
        except trio.TooSlowError as exc:
            raise TimeoutError(f"no message within {timeout} s") from exc

    def command(
        self, name: str, **declaration: Any
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: answer ``name`` with a plain (blocking) function run in a worker
        thread: ``fn(params)``, ``fn(params, request)`` or keyword-only parameters, with
        the declaration keywords of :meth:`msgq_trio.Bus.command` (``params``, ``result``,
        ``doc``, ``raises``, ``check``)."""

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            def in_thread(handler: Callable[[Any, Message], Any]) -> Callable[..., Any]:
                async def run(params: Any, request: Message) -> Any:
                    return await trio.to_thread.run_sync(handler, params, request)

                return run

            self._run_sync(self._declare, name, fn, in_thread, declaration)
            return fn

        return register

    def _declare(
        self, name: str, fn: Callable[..., Any], run: Any, declaration: dict[str, Any]
    ) -> None:
        self.bus._s.add_command(name, fn, run=run, **declaration)

    declare_event = _blocking_sync(Bus.declare_event)

    def queue(self, name: str, *, producer: str | None = None) -> SyncQueue:
        """A blocking handle on the durable queue ``name`` (see ``Bus.queue``)."""
        return SyncQueue(self, self.bus.queue(name, producer=producer))

    def pipe(self, name: str) -> Any:
        """The named pipe ``name`` (docs/PIPES.md): ``open_reader()`` / ``open_writer()``
        return binary file objects (:mod:`msgq_trio.client.pipe`)."""
        from .client.pipe import SyncPipe

        return SyncPipe(self._run, self.bus.pipe(name))

    def close(self) -> None:
        """Close the connection and stop the background thread (idempotent)."""
        if self._token is not None and self._stop is not None and not self._stop.is_set():
            try:
                self._token.run_sync_soon(self._stop.set)
            except trio.RunFinishedError:
                pass
        self._thread.join(10)

    def __enter__(self) -> SyncBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncQueue(_InLoop[Queue]):
    """Blocking facade over :class:`msgq_trio.client.queue.Queue` (docs/QUEUE.md): each
    method is the ``Queue`` method of the same name, blocking until the plugin answered
    and raising the same exceptions."""

    def __init__(self, sbus: SyncBus, q: Queue) -> None:
        self._sbus = sbus
        self._q = q

    @property
    def _target(self) -> Queue:
        return self._q

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._sbus._run(fn, *args, **kwargs)

    def _run_sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._sbus._run_sync(fn, *args, **kwargs)

    def declare(self, **options: Any) -> bool:
        """Blocking :meth:`msgq_trio.client.queue.Queue.declare` (written out: a method
        of keyword arguments only does not type-check as a ParamSpec's)."""
        return bool(self._run(self._q.declare, **options))

    put = _blocking(Queue.put)
    put_many = _blocking(Queue.put_many)
    send = _blocking(Queue.send)
    stats = _blocking(Queue.stats)
    producer_state = _blocking(Queue.producer_state)

    def fetch(self, n: int = 1, *, ack_timeout: float | None = None) -> list[SyncQueueMessage]:
        """:meth:`msgq_trio.client.queue.Queue.fetch`: the messages as
        :class:`SyncQueueMessage`."""
        got = self._sbus._run(self._q.fetch, n, ack_timeout=ack_timeout)
        return [SyncQueueMessage(self._sbus, m) for m in got]

    def ack(self, messages: Sequence[SyncQueueMessage]) -> int:
        """Ack fetched ``messages`` in one request; returns how many were still owed."""
        return int(self._sbus._run(self._q.ack, [m.message for m in messages]))

    def consume(
        self, window: int = 1, *, ack_timeout: float | None = None, timeout: float | None = None
    ) -> Iterator[SyncQueueMessage]:
        """Push consumer: yields messages (ack each with ``m.ack()``). Stops with
        TimeoutError if nothing arrives within ``timeout``; closing the generator (or
        leaving the ``for``) cancels the consumer."""
        consumer = self._q.consume(window, ack_timeout=ack_timeout)

        async def next_message() -> QueueMessage:
            with trio.fail_after(math.inf if timeout is None else timeout):
                return await consumer.__anext__()

        try:
            while True:
                try:
                    m = self._sbus._run(next_message)
                except trio.TooSlowError as exc:
                    raise TimeoutError(f"no message within {timeout} s") from exc
                yield SyncQueueMessage(self._sbus, m)
        finally:
            try:
                self._sbus._run(consumer.aclose)
            except (ConnectionLost, UsageError):
                pass


class SyncQueueMessage:
    """A delivered message for the sync client: ``body``, ``deliveries``, ``ack()``,
    ``nack()``."""

    def __init__(self, sbus: SyncBus, m: QueueMessage) -> None:
        self._sbus = sbus
        self.message = m

    @property
    def body(self) -> Any:
        return self.message.body

    @property
    def deliveries(self) -> int:
        return self.message.deliveries

    def ack(self) -> None:
        self._sbus._run(self.message.ack)

    def nack(self) -> None:
        self._sbus._run(self.message.nack)


def connect(
    socket: str | os.PathLike[str] | None = None,
    name: str | None = None,
    *,
    token: str | None = None,
    ssl_context: Any = None,
    server_hostname: str | None = None,
    reconnect: bool | Reconnect = False,
) -> SyncBus:
    """Connect to the broker; returns a :class:`SyncBus` (use it as a context manager).

    ``socket``, ``token``, ``ssl_context``, ``server_hostname`` and ``reconnect`` are as
    for :func:`msgq_trio.connect` (``tcp://`` / ``tls://`` addresses included; the trio
    Bus underneath reconnects by itself, see :meth:`SyncBus.wait_connected`).

    Raises:
        ConnectError: as :func:`msgq_trio.connect`.
    """
    return SyncBus(
        socket,
        name,
        token=token,
        ssl_context=ssl_context,
        server_hostname=server_hostname,
        reconnect=reconnect,
    )
