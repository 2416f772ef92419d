"""Fixtures for the queue plugin: brokers started with ``[plugins.queue]`` configured."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def toml_value(v: Any) -> str:
    return json.dumps(v) if not isinstance(v, bool) else ("true" if v else "false")


def write_queue_config(
    path: Path, store: Path, queues: dict[str, dict[str, Any]] | None, **settings: Any
) -> Path:
    """Write a broker configuration enabling the queue plugin on ``store``."""
    lines = ["[plugins.queue]", f"dir = {toml_value(str(store))}"]
    lines += [f"{k} = {toml_value(v)}" for k, v in settings.items()]
    for name, opts in (queues or {}).items():
        lines.append(f"[plugins.queue.queues.{json.dumps(name)}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in opts.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def queue_broker(broker_factory: Callable[..., Any], short_tmp: Path) -> Callable[..., Any]:
    """``start(queues=None, path=None, store=None, **settings)``: a broker running the
    queue plugin (store in ``short_tmp/store`` unless given); returns once it is ready."""

    def start(
        queues: dict[str, dict[str, Any]] | None = None,
        *,
        path: Path | None = None,
        store: Path | None = None,
        **settings: Any,
    ) -> Any:
        cfg = write_queue_config(
            short_tmp / "queue.toml", store or short_tmp / "store", queues, **settings
        )
        return broker_factory("--config", str(cfg), path=path)

    return start
