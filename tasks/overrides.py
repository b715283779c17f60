"""Run-config overrides as ``flwr run --run-config`` takes them: ``k=v`` pairs and TOML files.

Standard library only, so the ``flwr`` wrappers (``python -m simulations.flower``) read their
overrides without importing torch (2.7 s of their start, measured).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomllib


def _value(text: str) -> Any:
    """A TOML value (``0.1``, ``true``, ``'digits'``, ``"80,120"``); bare words stay strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested tables as dotted keys, as flwr reads ``[tool.flwr.app.config]``: ``{"fedavgm":
    {"server-lr": 0.5}}`` (the TOML table ``[fedavgm]``, or ``fedavgm.server-lr = 0.5``) ->
    ``{"fedavgm.server-lr": 0.5}``; flat keys stay as they are."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["lr=0.1 task='digits'", "more.toml"]`` -> {key: value}: ``k=v`` pairs as for
    ``flwr run --run-config``, or a TOML file of keys (its tables flattened: ``[fedavgm]`` with
    ``server-lr = 0.5`` is ``fedavgm.server-lr``)."""
    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item and item.endswith(".toml") and Path(item).is_file():
            out.update(flatten(tomllib.loads(Path(item).read_text())))
            continue
        for pair in shlex.split(item):
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"expected key=value pairs (as for flwr run --run-config), got {pair!r}")
            out[key.strip()] = _value(value.strip())
    return out
