"""Find plugins by name through the entry-point group and check their settings."""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from .api import ENTRY_POINT_GROUP, Plugin

__all__ = ["PluginConfigError", "check_plugin_config", "installed_plugins", "load_plugin"]


class PluginConfigError(ValueError):
    """A plugin named in the configuration is not installed, cannot be loaded, or
    refuses its settings. The message names the plugin and, if known, the key."""


def installed_plugins() -> list[str]:
    """Names registered under ``msgq_trio.plugins``, sorted."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def load_plugin(name: str) -> Plugin:
    """Load the plugin registered as ``name``.

    Raises:
        PluginConfigError: no such entry point (the message lists the installed ones),
            importing it failed, or the object does not satisfy :class:`Plugin`.
    """
    eps = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not eps:
        have = ", ".join(installed_plugins()) or "none"
        raise PluginConfigError(f"unknown plugin {name!r} (installed: {have})")
    try:
        obj = eps[0].load()
    except Exception as exc:
        raise PluginConfigError(
            f"plugin {name!r} ({eps[0].value}) cannot be loaded: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(obj, Plugin):
        raise PluginConfigError(
            f"plugin {name!r} ({eps[0].value}) has no name/check_config/run: not a Plugin"
        )
    return obj


def check_plugin_config(name: str, table: Mapping[str, Any]) -> object:
    """Load plugin ``name`` and let it validate ``table``; returns its settings.

    Raises:
        PluginConfigError: see :func:`load_plugin`, or the plugin refused the table.
    """
    plugin = load_plugin(name)
    try:
        return plugin.check_config(table)
    except (ValueError, TypeError) as exc:
        raise PluginConfigError(str(exc)) from None
