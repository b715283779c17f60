"""The methods, each ONE module of the algorithm layer (``strategies.algorithm``), and their registry.

A new method is a module here with a subclass of ``strategies.algorithm.Algorithm`` (its
server side, client side and the bound on an honest reply) plus its line in ``METHODS``;
every backend -- the Flower strategies (``strategies.base``), the ClientApp, the engine and
torchrun -- then runs it, and ``algorithm = "<name>"`` selects it in a run config.
"""

from __future__ import annotations

from typing import Any

from ..algorithm import Algorithm
from ..settings import Hyper, Mode
from .celgc import CELGC
from .episode import EPISODE
from .local_sgd import LocalSGD
from .naive import NaiveParallelClip
from .scaffold import SCAFFOLD
from .single import SingleMachine

#: ``algorithm`` config value -> the method
METHODS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (CELGC, LocalSGD, NaiveParallelClip, EPISODE,
                                                                   SingleMachine, SCAFFOLD)}


def method(name: str) -> type[Algorithm]:
    """The method named ``name`` (an error naming the known ones)."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"algorithm must be one of {', '.join(METHODS)}, got {name!r}") from None


def answering(mode: Mode | str) -> type[Algorithm]:
    """The method whose client side answers an exchange of ``mode`` (the round config's mode)."""
    mode = Mode(mode)
    for cls in METHODS.values():
        if mode in cls.modes:
            return cls
    raise ValueError(f"no method answers mode {mode.value!r}")


def build(name: str, hyper: Hyper, **kw: Any) -> Algorithm:
    """The method ``name`` for a run's ``hyper``-parameters (``kw``: train_size, population)."""
    return method(name)(hyper, **kw)


__all__ = ["METHODS", "Algorithm", "answering", "build", "method"]
