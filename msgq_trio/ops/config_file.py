"""The configuration file (TOML) and runtime changes of the broker's configuration.

Precedence, lowest first: built-in defaults (:class:`msgq_trio.config.BrokerConfig`), the
file given with ``serve --config``, command-line flags. The same merge runs again on
SIGHUP or the ``config-reload`` control command; ``config-set`` changes one key of the
running configuration only (the next reload returns to file + flags).

Every error names the key and the value (``limits.max_frame_size = -1: ...``), and a
configuration is validated completely before any of it is applied.
"""

from __future__ import annotations

import copy
import difflib
import json
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ..config import (
    ACCESS_VERBS,
    AccessRule,
    AccessSettings,
    BrokerConfig,
    CaptureSettings,
    ControlSettings,
    Limits,
    LogSettings,
    MetricsSettings,
    QuotaSettings,
    TcpSettings,
    TracingSettings,
    default_state_dir,
)

#: Section name -> settings class; each class's attrs fields are the section's keys.
SECTIONS: dict[str, type[Any]] = {
    "limits": Limits,
    "log": LogSettings,
    "control": ControlSettings,
    "capture": CaptureSettings,
    "metrics": MetricsSettings,
    "tracing": TracingSettings,
    "tcp": TcpSettings,
    "quotas": QuotaSettings,
}
#: Keys outside any section.
TOP_LEVEL: dict[str, str] = {
    "socket": "str",
    "socket_mode": "str",
    "socket_group": "str",
    "state_dir": "str",
    "gc_threshold": "int",
}
#: Plugins whose ``dir`` (their store) defaults to ``<state_dir>/<name>`` when their table
#: leaves it out, so ``serve --plugin queue`` needs no configuration file.
STATE_DIR_PLUGINS = ("queue",)

#: Keys read once at start: a changed value is reported, not applied, until a restart.
RESTART_ONLY = frozenset(
    {
        "socket",
        "socket_mode",
        "socket_group",
        "state_dir",
        "gc_threshold",
        "metrics.listen",
        "tcp.listen",
        "tcp.certfile",
        "tcp.keyfile",
        "tcp.client_ca",
        "tcp.require_client_cert",
        "tcp.insecure",
    }
)
#: Limits read when a connection starts: a change applies to connections made after it.
NEW_CONNECTIONS_ONLY = frozenset(
    {
        "limits.max_frame_size",
        "limits.idle_in_frame_timeout",
        "limits.handshake_timeout",
        "limits.max_fds_per_message",
        "limits.socket_send_buffer",
        "tcp.tokens",
        "tcp.heartbeat_interval",
        "tcp.heartbeat_misses",
    }
)


class ConfigError(ValueError):
    """An invalid configuration. ``key`` and ``value`` name the offending setting."""

    def __init__(self, message: str, key: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.key = key
        self.value = value


def show(value: object) -> str:
    """A value as it would be written in TOML/JSON (for error messages)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def all_keys() -> list[str]:
    """Every dotted key the configuration knows, in file order."""
    keys = list(TOP_LEVEL)
    for section, cls in SECTIONS.items():
        keys.extend(f"{section}.{f.name}" for f in attrs.fields(cls))
    keys.extend(("access.rule", "access.queue_group"))
    return keys


def normalize_key(key: str) -> str:
    """``limits.request_timeout`` stays; a bare field name unique across sections
    (``request_timeout``) is completed. Raises ConfigError for unknown keys."""
    known = all_keys()
    if key in known:
        return key
    matches = [k for k in known if k.rpartition(".")[2] == key]
    if len(matches) == 1:
        return matches[0]
    hint = difflib.get_close_matches(key, known, n=1)
    raise ConfigError(
        f"unknown configuration key {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""),
        key,
    )


def _coerce(key: str, typ: str, value: object) -> object:
    """Check ``value`` against the field's declared type; convert lists and ints."""

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{key} = {show(value)}: must be {what}", key, value)

    if typ == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad("an integer")
        return value
    if typ == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad("a number")
        return float(value)
    if typ == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if typ == "str":
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if typ.startswith("tuple[int"):
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise bad("a list of integers")
        return tuple(value)
    if typ.startswith("tuple[str"):
        if isinstance(value, str):
            value = [value]  # a single name is a list of one
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad("a list of strings")
        return tuple(value)
    if typ.startswith("dict[str, str]"):
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise bad("a table of strings")
        return dict(value)
    raise AssertionError(f"unsupported field type {typ!r} for {key}")


def build_section(section: str, cls: type[Any], table: object) -> Any:
    if not isinstance(table, Mapping):
        raise ConfigError(f"[{section}] must be a table, got {show(table)}", section, table)
    fields = {f.name: f for f in attrs.fields(cls)}
    kwargs: dict[str, object] = {}
    for name, value in table.items():
        key = f"{section}.{name}"
        field = fields.get(name)
        if field is None:
            hint = difflib.get_close_matches(name, list(fields), n=1)
            raise ConfigError(
                f"unknown key {key!r}" + (f" (did you mean {section}.{hint[0]}?)" if hint else ""),
                key,
                value,
            )
        checked = _coerce(key, str(field.type), value)
        if field.validator is not None:
            try:
                field.validator(None, field, checked)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{key} = {show(value)}: {exc}", key, value) from None
        kwargs[name] = checked
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # a rule between several keys of the section
        msg = str(exc)
        if not msg.startswith(section + "."):
            msg = f"[{section}] {msg}"
        raise ConfigError(msg, section) from None


def build(data: Mapping[str, Any]) -> BrokerConfig:
    """A validated configuration from a nested mapping (a parsed TOML document).

    Raises:
        ConfigError: an unknown key, a wrong type or an invalid value (named in the message).
    """
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name == "plugins":
            kwargs[name] = build_plugins(_with_state_dirs(value, data.get("state_dir")))
        elif name == "access":
            kwargs[name] = build_access(value)
        elif name == "quotas":
            kwargs[name] = build_quotas(value)
        elif name in SECTIONS:
            kwargs[name] = build_section(name, SECTIONS[name], value)
        elif name in TOP_LEVEL:
            checked = _coerce(name, TOP_LEVEL[name], value)
            field = attrs.fields_dict(BrokerConfig)[name]
            if field.validator is not None:
                try:
                    field.validator(None, field, checked)
                except ValueError as exc:
                    raise ConfigError(f"{name} = {show(value)}: {exc}", name, value) from None
            kwargs[name] = checked
        else:
            hint = difflib.get_close_matches(name, [*TOP_LEVEL, *SECTIONS], n=1)
            raise ConfigError(
                f"unknown key {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""),
                name,
                value,
            )
    return BrokerConfig(**kwargs)


def _with_state_dirs(table: object, state_dir: object) -> object:
    """``[plugins]`` with ``dir`` filled in for :data:`STATE_DIR_PLUGINS` that lack it:
    ``<state_dir>/<name>`` (``state_dir`` "" or absent: :func:`default_state_dir`)."""
    if not isinstance(table, Mapping):
        return table  # build_plugins names the error
    out = dict(table)
    for name in STATE_DIR_PLUGINS:
        settings = out.get(name)
        if isinstance(settings, Mapping) and "dir" not in settings:
            base = (
                Path(state_dir)
                if isinstance(state_dir, str) and state_dir
                else (default_state_dir())
            )
            out[name] = {**settings, "dir": str(base / name)}
    return out


def build_access(table: object) -> AccessSettings:
    """The ``[access]`` table: ``queue_group`` and the ``[[access.rule]]`` array.

    Raises:
        ConfigError: naming the rule (``access.rule[2].send``) and the offending value.
    """
    if not isinstance(table, Mapping):
        raise ConfigError(f"[access] must be a table, got {show(table)}", "access", table)
    unknown = set(table) - {"rule", "queue_group"}
    if unknown:
        key = f"access.{sorted(unknown)[0]}"
        raise ConfigError(f"unknown key {key!r} (access has rule, queue_group)", key)
    queue_group = _coerce("access.queue_group", "str", table.get("queue_group", "msgq-queue"))
    rules_in = table.get("rule", [])
    if not isinstance(rules_in, list):
        raise ConfigError(
            "access.rule must be an array of tables ([[access.rule]])", "access.rule", rules_in
        )
    rules: list[AccessRule] = []
    fields = {f.name: f for f in attrs.fields(AccessRule)}
    for i, rule in enumerate(rules_in):
        where = f"access.rule[{i}]"
        if not isinstance(rule, Mapping):
            raise ConfigError(f"{where} must be a table, got {show(rule)}", where, rule)
        kwargs: dict[str, object] = {}
        for name, value in rule.items():
            if name not in fields:
                hint = difflib.get_close_matches(name, list(fields), n=1)
                raise ConfigError(
                    f"unknown key {where}.{name}"
                    + (f" (did you mean {hint[0]}?)" if hint else "")
                    + f"; a rule has who, {', '.join(ACCESS_VERBS)}, control",
                    "access.rule",
                    value,
                )
            kwargs[name] = _coerce(f"{where}.{name}", str(fields[name].type), value)
        if "who" not in kwargs:
            raise ConfigError(f"{where} needs a 'who' list", "access.rule", dict(rule))
        try:
            rules.append(AccessRule(**kwargs))  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where}: {exc}", "access.rule", dict(rule)) from None
    return AccessSettings(rules=rules, queue_group=str(queue_group))  # type: ignore[arg-type]


def build_quotas(table: object) -> QuotaSettings:
    """The ``[quotas]`` table, with its ``[quotas.users."uid:N"]`` tables of one user's
    own values.

    Raises:
        ConfigError: naming the key (``quotas.users.uid:1000.memory``) and the value.
    """
    if not isinstance(table, Mapping):
        raise ConfigError(f"[quotas] must be a table, got {show(table)}", "quotas", table)
    rest = {k: v for k, v in table.items() if k != "users"}
    settings: QuotaSettings = build_section("quotas", QuotaSettings, rest)
    if "users" not in table:
        return settings
    users = table["users"]
    field = attrs.fields(QuotaSettings).users
    try:
        assert field.validator is not None
        field.validator(None, field, users)
    except ValueError as exc:
        raise ConfigError(f"quotas.{exc}", "quotas.users", users) from None
    return attrs.evolve(settings, users={k: dict(v) for k, v in users.items()})


def build_plugins(table: object) -> dict[str, dict[str, Any]]:
    """Check the ``[plugins.<name>]`` tables: each name must be an installed plugin and
    its table valid for it (the plugin's ``check_config`` names the offending key).

    Raises:
        ConfigError: not a table of tables, unknown plugin, or invalid plugin settings.
    """
    from ..plugins.loader import PluginConfigError, check_plugin_config

    if not isinstance(table, Mapping):
        raise ConfigError(f"[plugins] must be a table, got {show(table)}", "plugins", table)
    out: dict[str, dict[str, Any]] = {}
    for name, settings in table.items():
        key = f"plugins.{name}"
        if not isinstance(settings, Mapping):
            raise ConfigError(f"[{key}] must be a table, got {show(settings)}", key, settings)
        try:
            check_plugin_config(name, settings)
        except PluginConfigError as exc:
            raise ConfigError(f"[{key}] {exc}", key, dict(settings)) from None
        out[name] = copy.deepcopy(dict(settings))
    return out


def read_toml(path: Path) -> dict[str, Any]:
    """Parse the file. Raises ConfigError (unreadable or not TOML), naming the file."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def set_in(data: dict[str, Any], key: str, value: object) -> None:
    """Set dotted ``key`` in a nested dict, creating the section table if needed."""
    section, _, name = key.rpartition(".")
    if not section:
        data[name] = value
        return
    table = data.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"[{section}] must be a table, got {show(table)}", section, table)
    table[name] = value


def to_dict(cfg: BrokerConfig) -> dict[str, Any]:
    """The configuration as a nested dict of plain values (lists, not tuples)."""
    out: dict[str, Any] = {name: getattr(cfg, name) for name in TOP_LEVEL}
    for section in SECTIONS:
        inst = getattr(cfg, section)
        out[section] = {
            f.name: list(v) if isinstance(v := getattr(inst, f.name), tuple) else v
            for f in attrs.fields(type(inst))
        }
    out["access"] = {
        "queue_group": cfg.access.queue_group,
        "rule": [
            {
                f.name: list(v) if isinstance(v := getattr(r, f.name), tuple) else v
                for f in attrs.fields(AccessRule)
            }
            for r in cfg.access.rules
        ],
    }
    if cfg.plugins:
        out["plugins"] = copy.deepcopy(cfg.plugins)
    return out


def flatten(cfg: BrokerConfig) -> dict[str, Any]:
    """``{"limits.max_frame_size": ..., ...}`` for every key."""
    out: dict[str, Any] = {}
    for k, v in to_dict(cfg).items():
        if isinstance(v, dict):
            out.update({f"{k}.{name}": value for name, value in v.items()})
        else:
            out[k] = v
    return out


def get_key(cfg: BrokerConfig, key: str) -> Any:
    return flatten(cfg)[normalize_key(key)]


def with_key(cfg: BrokerConfig, key: str, value: object) -> BrokerConfig:
    """A new configuration: ``cfg`` with ``key`` set to ``value`` (validated as a whole)."""
    data = to_dict(cfg)
    set_in(data, normalize_key(key), value)
    return build(data)


def diff(old: BrokerConfig, new: BrokerConfig) -> list[tuple[str, Any, Any]]:
    """``(key, old value, new value)`` for every key that differs."""
    a, b = flatten(old), flatten(new)
    return [(k, a[k], b[k]) for k in b if a.get(k) != b[k]]


def applies(key: str) -> str:
    """When a change of ``key`` takes effect: ``now``, ``new connections`` or ``restart``."""
    if key in RESTART_ONLY or key.startswith("plugins."):
        return "restart"
    if key in NEW_CONNECTIONS_ONLY:
        return "new connections"
    return "now"


@attrs.define
class ConfigSource:
    """Where the configuration comes from: an optional file plus command-line overrides
    (dotted key -> value). :meth:`load` re-reads the file each time (SIGHUP)."""

    path: Path | None = None
    overrides: dict[str, Any] = attrs.field(factory=dict)

    def load(self) -> BrokerConfig:
        """Read, merge and validate. Raises ConfigError; nothing is applied here."""
        data: dict[str, Any] = read_toml(self.path) if self.path is not None else {}
        data = copy.deepcopy(data)
        for key, value in self.overrides.items():
            if key.startswith("plugins.") and isinstance(value, dict):
                # ``serve --plugin NAME`` enables a plugin; its file table, if any, stays.
                plugins = data.setdefault("plugins", {})
                if isinstance(plugins, dict):
                    plugins.setdefault(key.partition(".")[2], {}).update(value)
                    continue
            set_in(data, key, value)
        try:
            return build(data)
        except ConfigError as exc:
            if exc.key is not None and exc.key in self.overrides:
                where = "on the command line"
            elif self.path is not None:
                where = f"in {self.path}"
            else:
                where = ""
            msg = f"{exc} ({where})" if where else str(exc)
            raise ConfigError(msg, exc.key, exc.value) from None
