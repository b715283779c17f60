"""The algorithm layer (no flwr): the methods, each ONE module here, and their registry.

``algorithm`` -- the method base (``Algorithm``: server side, client side, the bound on an
honest reply); ``round`` -- a round's exchanges and report; ``reduce`` -- the clients' results
summed then finalised; ``replies`` -- typed, ranged reply fields; ``executors`` -- how a backend
runs its clients. A new method is a module here with a subclass of ``Algorithm`` plus its line
in ``METHODS``; every backend -- the Flower strategies (``strategies.flower_api.strategy``), the
ClientApp, the engine and torchrun -- then runs it, and ``algorithm = "<name>"`` selects it in a
run config.
"""

from __future__ import annotations

from typing import Any

from ..core.settings import Hyper, Mode
from .algorithm import Algorithm
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
