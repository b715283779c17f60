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

from ..core.settings import ConfigError, Hyper, RoundSettings
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


def client_side(settings: RoundSettings) -> type[Algorithm]:
    """The method whose client side answers an exchange of ``settings``: the one its
    ``algorithm`` names, never another with the same ``mode`` (a mode is an exchange's kind, not a
    method); an error when the settings name no method, one this node does not have, or one
    without exchanges of that mode."""
    if settings.algorithm is None:
        raise ConfigError("the round's config names no method ('algorithm'): a client runs exactly the method the "
                          "server runs, and the strategies of `strategies` name it in every round's config")
    try:
        cls = METHODS[settings.algorithm]
    except KeyError:
        raise ConfigError(f"the round's config names algorithm {settings.algorithm!r}, which this node does not have "
                          f"(it has {', '.join(METHODS)})") from None
    if settings.mode not in cls.modes:
        raise ConfigError(f"algorithm {settings.algorithm!r} has no exchange of mode {settings.mode.value!r} (its "
                          f"exchanges: {', '.join(m.value for m in cls.modes)})")
    return cls


def build(name: str, hyper: Hyper, **kw: Any) -> Algorithm:
    """The method ``name`` for a run's ``hyper``-parameters (``kw``: train_size, population)."""
    return method(name)(hyper, **kw)


__all__ = ["METHODS", "Algorithm", "build", "client_side", "method"]
