"""A reply's metrics, parsed before use: typed values in range, or a reason to reject (no flwr).

Every field a strategy reads from a client's MetricRecord goes through ``parse_metrics``:
a value of the wrong type (a list, a string, a bool), a non-finite number where a finite
one is needed, or a value out of range rejects the reply with a reason that names the
field and the value; nothing here raises on client input.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    """A metric field: integer or real, its range, and whether NaN is allowed."""

    integer: bool = False
    low: float = -math.inf
    high: float = math.inf
    allow_nan: bool = False
    allow_inf: bool = False

    def parse(self, name: str, value: object) -> tuple[float | int | None, str | None]:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return None, f"{name} must be a number, got {type(value).__name__} {_short(value)}"
        x = float(value)
        if math.isnan(x):
            return (x, None) if self.allow_nan else (None, f"{name} must not be NaN")
        if math.isinf(x) and not self.allow_inf:
            return None, f"{name} must be finite, got {x}"
        if self.integer and x != math.floor(x):
            return None, f"{name} must be an integer, got {x!r}"
        if not (self.low <= x <= self.high):
            return None, f"{name} must be in [{self.low:g}, {self.high:g}], got {x:g}"
        return (int(x) if self.integer else x), None


#: The metrics this project's clients report, with their types and ranges.
FIELDS: dict[str, Field] = {
    "num-examples": Field(low=0.0),
    "num-steps": Field(integer=True, low=0),
    "skipped-steps": Field(integer=True, low=0),
    "train-loss": Field(allow_nan=True, allow_inf=True),
    "train-ce": Field(allow_nan=True, allow_inf=True),
    "clip-fraction": Field(low=0.0, high=1.0),
    "grad-norm": Field(low=0.0, allow_nan=True, allow_inf=True),
    "lr-scale": Field(low=0.0),
    "partition-id": Field(integer=True, low=0),
    "server-round": Field(integer=True, low=0),
    "in-sum": Field(integer=True, low=0, high=1),  # node-aggregation: the client is in its node's sum
}


def parse_metrics(record: Mapping[str, object], required: tuple[str, ...] = (),
                  fields: Mapping[str, Field] = FIELDS) -> tuple[dict[str, float | int], str | None]:
    """The known fields of ``record`` parsed, or the first reason to reject the reply.

    Fields not in ``fields`` are passed through untouched (a user's own metrics); the
    ``required`` ones must be present."""
    missing = [k for k in required if k not in record]
    if missing:
        return {}, f"metrics lack {missing}"
    out: dict[str, float | int] = {}
    for key, value in record.items():
        spec = fields.get(key)
        if spec is None:
            out[key] = value  # type: ignore[assignment]
            continue
        parsed, reason = spec.parse(key, value)
        if reason is not None:
            return {}, reason
        out[key] = parsed  # type: ignore[assignment]
    if "num-steps" in out and "skipped-steps" in out and out["skipped-steps"] > out["num-steps"]:
        return {}, f"skipped-steps ({out['skipped-steps']}) exceeds num-steps ({out['num-steps']})"
    return out, None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
