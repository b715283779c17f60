"""The paper's methods for every backend: the algorithm layer, its Flower strategies and client API.

``from strategies import CELGC`` gives the Flower strategy (also ``EPISODE``,
``NaiveParallelClip``, ``SCAFFOLD``); ``strategies.clientapp`` is the client API for any
ClientApp (round settings, I clipped steps, the reply). Below them, importing no flwr (the
fast engine uses them where Flower is not installed): the algorithm layer
(``strategies.methods.algorithm``, one module per method in ``strategies.methods``), the executors
(``strategies.methods.executors``), the averaging (``strategies.methods.reduce``) and the pure math
(``strategies.core.clipped_sgd``, ``strategies.core.averaging``, ``strategies.core.schedule``, ...). The
strategy classes are loaded on first access. This package imports nothing else of the
project: it is what the wheel installs.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CELGC", "EPISODE", "SCAFFOLD", "NaiveParallelClip"]

#: the strategies with a class of their own (their own constructor); every other method's
#: strategy is ``strategies.flower_api.strategy.flower_strategy(method)``, under the method's class name
_OWN = {"CELGC": "strategies.flower_api.celgc_strategy", "EPISODE": "strategies.flower_api.episode_strategy",
        "NaiveParallelClip": "strategies.flower_api.naive_strategy"}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _OWN:
        return getattr(importlib.import_module(_OWN[name]), name)
    methods = {cls.__name__: cls for cls in importlib.import_module("strategies.methods").METHODS.values()}
    if name in methods:
        return importlib.import_module("strategies.flower_api.strategy").flower_strategy(methods[name])
    raise AttributeError(f"module 'strategies' has no attribute {name!r}")
