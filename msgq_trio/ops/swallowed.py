"""Ctrl-C that the interpreter swallowed: remembered, so the command still stops.

Python raises KeyboardInterrupt wherever the main thread is when SIGINT's handler runs.
If that is a weak reference's callback (every import runs one: importlib's module
locks), a ``__del__`` or a generator closed by the garbage collector, the exception
cannot propagate: the interpreter prints "Exception ignored in ..." and carries on, as
if Ctrl-C had never been pressed. A command then waits for traffic until the next
Ctrl-C; seen for ``dump`` interrupted while it imported its modules.

The program (``cli.main``) installs :func:`install` before it imports anything else:
the hook records such an interrupt, quietly, instead of printing it. What runs the
command (``ops/interrupt.run``, ``ops/serve``) asks :func:`pending` before and after it
takes over SIGINT and treats a recorded interrupt as Ctrl-C. Imports nothing heavy: it
runs before the command's imports.
"""

from __future__ import annotations

import sys

_swallowed = False


def _hook(args: sys.UnraisableHookArgs) -> None:
    global _swallowed
    if args.exc_type is not None and issubclass(args.exc_type, KeyboardInterrupt):
        _swallowed = True
        return
    sys.__unraisablehook__(args)


def install() -> None:
    """Record, instead of printing, a KeyboardInterrupt the interpreter cannot raise."""
    sys.unraisablehook = _hook


def pending() -> bool:
    """Whether a Ctrl-C was swallowed since :func:`install` (it stays recorded)."""
    return _swallowed


def raise_if_pending() -> None:
    """Raise the KeyboardInterrupt that was swallowed, if one was.

    Raises:
        KeyboardInterrupt: Ctrl-C came and the interpreter could not raise it.
    """
    if _swallowed:
        raise KeyboardInterrupt
