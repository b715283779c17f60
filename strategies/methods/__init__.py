"""The algorithm layer (no flwr): the methods, each ONE module here, and their registry.

``algorithm`` -- the method base (``Algorithm``: server side, client side, the bound on an
honest reply); ``round`` -- a round's exchanges and report; ``reduce`` -- the clients' results
summed then finalised; ``replies`` -- typed, ranged reply fields; ``executors`` -- how a backend
runs its clients; ``fedopt`` -- the server-optimiser base (FedAvgM, FedAdam, FedYogi). The
methods (``METHODS``, docs/ALGORITHMS.md): the paper's CELGC, local SGD, naive parallel clipping
and single-machine clipped SGD; EPISODE, SCAFFOLD, FedProx, FedAvgM, FedAdam, FedYogi. A new
method is a module here with a subclass of ``Algorithm`` (found by ``METHODS``, nothing else to
edit; its own keys in a ``Settings`` dataclass of ``own_key`` fields, addressed in a run config
as ``<name>.<key>``); every backend -- the Flower strategies (``strategies.flower_api.strategy``),
the ClientApp, the engine and torchrun -- then runs it, and ``algorithm = "<name>"`` selects it in
a run config.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from typing import Any

from ..core.settings import OWNED_KEYS, ConfigError, Hyper, RoundSettings
from .algorithm import Algorithm
from .celgc import CELGC
from .episode import EPISODE
from .local_sgd import LocalSGD
from .naive import NaiveParallelClip
from .scaffold import SCAFFOLD
from .single import SingleMachine

#: the modules of this package that are the layer's machinery, not methods
_MACHINERY = {"algorithm", "round", "reduce", "replies"}


def _methods_in_package() -> list[type[Algorithm]]:
    """Every concrete method defined in a module of this package (a new method is one file here)."""
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.ispkg or info.name in _MACHINERY:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += [obj for obj in vars(module).values()
                  if isinstance(obj, type) and issubclass(obj, Algorithm) and obj.__module__ == module.__name__
                  and "name" in vars(obj) and not inspect.isabstract(obj)]
    return found


#: what a method's name and its own keys may be: a bare TOML key without dots (a name scopes its keys,
#: ``<name>.<key>``, the table ``[<name>]`` of a run config)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
#: keys a round's config already carries (``RoundSettings``; ``clients``: the wire's per-node list,
#: ``strategies.flower_api.wire.CLIENTS_KEY``): an own key of that name would overwrite them
ROUND_KEYS = frozenset({*OWNED_KEYS, "server-round", "clients"})


def declaration_problems(cls: type[Algorithm]) -> list[str]:
    """What is wrong with a method's name and own keys, as messages naming them ([]: nothing)."""
    out = []
    name = vars(cls).get("name")
    if not (isinstance(name, str) and NAME.fullmatch(name)):
        out.append(f"{cls.__module__}.{cls.__qualname__} must set its own name, letters, digits, '-' and '_' (it scopes "
                   f"its run-config keys as <name>.<key> and names the method in every round), got {name!r}")
    for key in cls.own_keys():
        if not NAME.fullmatch(key):
            out.append(f"{cls.__qualname__}'s own key {key!r} must be letters, digits, '-' and '_' (no dots)")
        elif key in ROUND_KEYS:
            out.append(f"{cls.__qualname__}'s own key {key!r} is a key every round's config carries already "
                       f"({', '.join(sorted(ROUND_KEYS))}): choose another name")
    return out


def _registry() -> dict[str, type[Algorithm]]:
    out: dict[str, type[Algorithm]] = {}
    for cls in (CELGC, LocalSGD, NaiveParallelClip, EPISODE, SingleMachine, SCAFFOLD, *_methods_in_package()):
        for problem in declaration_problems(cls):
            raise ValueError(problem)
        if out.get(cls.name, cls) is not cls:
            raise ValueError(f"two methods are named {cls.name!r}: {out[cls.name].__qualname__} and {cls.__qualname__}")
        out[cls.name] = cls
    return out


#: ``algorithm`` config value -> the method: the paper's methods first, then every other module's
METHODS: dict[str, type[Algorithm]] = _registry()


#: ``package.module:Class`` -- a method of your own, outside this project (like ``task``)
IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
#: methods loaded by import path in this process: their ``name`` -> the class (what ``client_side`` also answers)
LOADED: dict[str, type[Algorithm]] = {}


def method(name: str) -> type[Algorithm]:
    """The method named ``name``: a registered one, or ``package.module:Class`` imported (then
    known by its class's ``name`` to ``client_side`` in this process); an error names the known
    methods, or what is wrong with the path (a module that does not import: where it must)."""
    if name in METHODS:
        return METHODS[name]
    if not (isinstance(name, str) and IMPORT_PATH.fullmatch(name)):
        raise ValueError(f"algorithm must be one of {', '.join(METHODS)} or an import path \"package.module:Class\", "
                         f"got {name!r}")
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"algorithm {name!r}: module {module_name!r} does not import here ({exc}). A method of your "
                         f"own must import in every process that reads the run config: the engine's, the ServerApp "
                         f"and every ClientApp (docs/ALGORITHMS.md, 'Where a method of your own must import'): put "
                         f"it in the app's folder (flwr run ships it to the apps), install it, or set PYTHONPATH "
                         f"before the processes start -- `flwr run .` keeps its local SuperLink, started with the "
                         f"environment of the first run: stop it (python -m simulations.flower stop-local) and run "
                         f"again, or run with the wrapper (python -m simulations.flower .), which starts its own; "
                         f"deployed SuperNodes need it too") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)) or inspect.isabstract(cls):
        raise ValueError(f"algorithm {name!r} is not a method: {attr} must be a concrete subclass of "
                         f"strategies.methods.algorithm.Algorithm, got {cls!r}")
    if not (isinstance(vars(cls).get("name"), str) and vars(cls)["name"]):
        raise ValueError(f"algorithm {name!r}: {attr} must set its own name (the name rounds carry)")
    problems = declaration_problems(cls)
    if problems:
        raise ValueError(f"algorithm {name!r}: {'; '.join(problems)}")
    taken = METHODS.get(cls.name) or LOADED.get(cls.name)
    if taken is not None and taken is not cls:
        raise ValueError(f"algorithm {name!r} is named {cls.name!r}, the name of {taken.__module__}.{taken.__qualname__}")
    LOADED[cls.name] = cls
    return cls


def client_side(settings: RoundSettings) -> type[Algorithm]:
    """The method whose client side answers an exchange of ``settings``: the one its
    ``algorithm`` names, never another with the same ``mode`` (a mode is an exchange's kind, not a
    method); an error when the settings name no method, one this node does not have, or one
    without exchanges of that mode."""
    if settings.algorithm is None:
        raise ConfigError("the round's config names no method ('algorithm'): a client runs exactly the method the "
                          "server runs, and the strategies of `strategies` name it in every round's config")
    try:
        cls = METHODS[settings.algorithm] if settings.algorithm in METHODS else LOADED[settings.algorithm]
    except KeyError:
        raise ConfigError(f"the round's config names algorithm {settings.algorithm!r}, which this node does not have "
                          f"(it has {', '.join(METHODS)})") from None
    if settings.mode not in cls.modes:
        raise ConfigError(f"algorithm {settings.algorithm!r} has no exchange of mode {settings.mode.value!r} (its "
                          f"exchanges: {', '.join(m.value for m in cls.modes)})")
    return cls


def own_keys() -> dict[str, tuple[str, Any]]:
    """Every registered method's own settings: run-config key (``<name>.<key>``) -> (the method's
    name, its field). Two methods may each have a key of the same name: their scopes differ."""
    return {key: (name, f) for name, cls in METHODS.items() for key, f in cls.run_config_keys().items()}


def build(name: str, hyper: Hyper, **kw: Any) -> Algorithm:
    """The method ``name`` for a run's ``hyper``-parameters (``kw``: train_size, population)."""
    return method(name)(hyper, **kw)


__all__ = ["IMPORT_PATH", "LOADED", "METHODS", "NAME", "ROUND_KEYS", "Algorithm", "build", "client_side",
           "declaration_problems", "method", "own_keys"]
