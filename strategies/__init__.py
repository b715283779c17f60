"""Flower strategies of the paper, their client API and their pure math.

``from strategies import CELGC`` gives the Flower strategy; ``strategies.clientapp`` is the
client API for any ClientApp (round settings, I clipped steps, the reply). The pure modules
(``strategies.averaging``, ``strategies.schedule``, ``strategies.clipped_sgd``,
``strategies.local_update``) import no flwr, so the fast engine can use them where Flower
is not installed: the strategy classes are loaded on first access. This package imports
nothing else of the project: it is what the wheel installs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CELGC", "EPISODE", "NaiveParallelClip"]

_LAZY = {"CELGC": "strategies.celgc", "EPISODE": "strategies.episode_strategy", "NaiveParallelClip": "strategies.naive"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")
