"""Flower strategies of the paper and their pure math.

``from strategies import CELGC`` gives the Flower strategy; the pure modules
(``strategies.averaging``, ``strategies.schedule``, ``strategies.clipped_sgd``) import no flwr, so the fast engine can
use them where Flower is not installed: the strategy classes are loaded on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CELGC", "NaiveParallelClip"]

_LAZY = {"CELGC": "strategies.celgc", "NaiveParallelClip": "strategies.naive"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")
