"""Find plugins by name through the entry-point group, check their settings and read
their access declarations (the broker side of the plugin API, plugins/api.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any

from msgq_trio.config import ACCESS_VERBS, AccessSettings, CommandAccess

from .api import ENTRY_POINT_GROUP, Plugin

__all__ = [
    "QUEUE_PLUGIN",
    "PluginConfigError",
    "access_declarations",
    "check_plugin_config",
    "enforced_commands",
    "installed_plugins",
    "load_plugin",
    "plugin_access",
]

#: The plugin whose declared commands ``[access] queue_group`` names the group of. Its
#: declaration is enforced whether or not this broker runs it: the access policy has
#: always checked the queue commands on that group, whoever answers there (a queue
#: service run under another supervisor is protected too).
QUEUE_PLUGIN = "queue"


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


def plugin_access(name: str) -> CommandAccess | None:
    """The access declaration of plugin ``name`` (its optional ``access`` attribute), or
    None if it declares none.

    Raises:
        PluginConfigError: see :func:`load_plugin`; or the declaration is not a
            :class:`~msgq_trio.config.CommandAccess`, names no params key, or declares a
            verb the broker does not know (the message names the plugin, the command and
            the verbs there are).
    """
    plugin = load_plugin(name)
    declared = getattr(plugin, "access", None)
    if declared is None:
        return None
    if not isinstance(declared, CommandAccess):
        raise PluginConfigError(
            f"plugin {name!r} declares access as {type(declared).__name__}, "
            "not a msgq_trio.plugins.api.CommandAccess"
        )
    if not declared.group or not declared.param:
        raise PluginConfigError(
            f"plugin {name!r} declares access without a group or params key "
            f"(group={declared.group!r}, param={declared.param!r})"
        )
    for command, verb in declared.verbs.items():
        if verb not in ACCESS_VERBS:
            raise PluginConfigError(
                f"plugin {name!r} declares verb {verb!r} for its command {command!r}, "
                f"which the broker does not know (known: {', '.join(ACCESS_VERBS)})"
            )
    return declared


def access_declarations(enabled: Iterable[str]) -> dict[str, CommandAccess]:
    """Plugin name -> access declaration, for each plugin in ``enabled`` that declares
    one and for :data:`QUEUE_PLUGIN` always (if installed).

    Raises:
        PluginConfigError: see :func:`plugin_access`.
    """
    names = dict.fromkeys(enabled)
    if QUEUE_PLUGIN in installed_plugins():
        names = {QUEUE_PLUGIN: None, **names}
    out: dict[str, CommandAccess] = {}
    for name in names:
        declared = plugin_access(name)
        if declared is not None:
            out[name] = declared
    return out


def enforced_commands(
    access: AccessSettings, declared: Mapping[str, CommandAccess]
) -> dict[str, CommandAccess]:
    """Group -> declaration, as the broker enforces them under ``access``: each plugin's
    on its declared group, :data:`QUEUE_PLUGIN`'s on ``access.queue_group``.

    Raises:
        PluginConfigError: two plugins' commands would be checked on one group (the
            message names both).
    """
    out: dict[str, CommandAccess] = {}
    owner: dict[str, str] = {}
    for name, decl in declared.items():
        group = access.queue_group if name == QUEUE_PLUGIN else decl.group
        if group in owner:
            raise PluginConfigError(
                f"plugins {owner[group]!r} and {name!r} both declare the commands of "
                f"group {group!r}"
            )
        owner[group] = name
        out[group] = CommandAccess(group=group, param=decl.param, verbs=decl.verbs)
    return out
