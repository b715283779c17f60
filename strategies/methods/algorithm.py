"""The algorithm layer: each method defined once, driven by every backend (pure, no flwr).

A method (one module of ``strategies.methods`` each; the registry, ``METHODS``, and docs/ALGORITHMS.md
list them) is ONE subclass of ``Algorithm`` with two sides:

* the server side, ``server(rnd)``: one round as straight-line code, a generator that yields
  each ``Exchange`` (what the round's clients are sent: the global model, the settings with
  their ``Mode``, any per-client arrays) and receives the clients' ``ClientResults``, averages
  them with ``rnd.mean`` (sum-then-finalise, ``strategies.methods.reduce``) and ends with
  ``rnd.finish(new_state, metrics)``, which returns the round's typed ``RoundReport``;
* the client side, ``client(exchange, group)``: what the clients of a ``ClientGroup`` do in
  one exchange, with the primitives of ``strategies.methods.executors`` (local steps of a step
  rule, a gradient) -- one client in a ClientApp, many in the engine.

Beside them a method states what an honest client's reply can be: ``bound(settings)``, the
farthest its trainable parameters can move from the global model in the round (None: no
bound holds), checked by the Flower strategies on every reply; and ``check_result`` for the
rest of its own reply. A backend drives the generator: the Flower strategy across
``configure_train`` / ``aggregate_train`` (messages in and out), the engine in a loop over its
executors (one flat all-reduce per exchange across processes). No backend names a method.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from torch import Tensor

from ..core.bound import check_displacement
from ..core.schedule import global_epoch, scheduled
from ..core.settings import ConfigError, Hyper, Mode, RoundSettings
from .reduce import ClientResults
from .round import Exchange, Rejection, Round, RoundReport, Server

__all__ = ["Algorithm", "Exchange", "Rejection", "Round", "RoundReport", "Server", "own_key"]


def own_key(key: str, doc: str, default: Any, check: Callable[[Any], bool] | None = None, rule: str = "") -> Any:
    """A field of a method's own settings (``Algorithm.Settings``, a frozen dataclass): its TOML
    key, one-line meaning, default and check (``rule``: what the check wants, for the error)."""
    return dataclasses.field(default=default, metadata={"key": key, "doc": doc, "check": check, "rule": rule})


def _coerce(key: str, typ: str, value: Any) -> Any:
    """A setting's value as its declared type (``float``, ``int``, ``bool`` or ``str``); an error names the key."""
    if typ == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
        return value
    if typ in ("int", "float"):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{key} must be a number, got {value!r}")
        if typ == "int":
            if not float(value).is_integer():
                raise ValueError(f"{key} must be an integer, got {value!r}")
            return int(value)
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {value!r}")
    return value


class Algorithm(ABC):
    """One method: its server side, its client side, the bound on an honest reply.

    ``hyper``: the run's hyper-parameters; ``train_size``: the training examples of all
    clients (counts global epochs; None: no schedule); ``population``: all clients N (a method
    whose server state depends on it, e.g. SCAFFOLD's c under partial participation);
    ``per_round``: the clients of a round when all take part (default: ``population``)."""

    #: the ``algorithm`` config value
    name: ClassVar[str]
    #: the paper, for the summary and the docs
    paper: ClassVar[str] = ""
    #: the modes of a round's exchanges, in order (the last one's replies are averaged into the model)
    modes: ClassVar[tuple[Mode, ...]] = (Mode.LOCAL,)
    #: the client side runs vectorised (``torch.func.vmap`` over the clients)
    vectorises: ClassVar[bool] = True
    #: clients keep state of the method's own across rounds (``ClientGroup.memory``)
    keeps_client_memory: ClassVar[bool] = False
    #: its server keeps state per client across rounds (``state_dict`` entries ``<record>/<client id>/<name>``,
    #: e.g. SCAFFOLD's c_i): on several engine processes each holds its own clients' and the checkpoint gathers them
    keeps_client_records: ClassVar[bool] = False
    #: its replies mean nothing without the round's global model (it steps on it)
    needs_global: ClassVar[bool] = True
    #: its server uses every exchange's replies only through their average (``Round.mean``): a node may
    #: send its clients' sum instead of their arrays (``node-aggregation``, ``reduce.NodeSum``)
    node_sums: ClassVar[bool] = False
    #: its own groups of arrays in replies -> what they hold ("state", "trainable" or "buffers")
    groups: ClassVar[dict[str, str]] = {}
    #: its own settings: a frozen dataclass of ``own_key`` fields (key, type, default, check, doc); the run
    #: config carries them scoped by ``name`` (``<name>.<key>``, ``run_config_keys``), the Flower strategy as
    #: arguments (Python names), the round's config under their own keys (it names the method)
    Settings: ClassVar[type | None] = None
    #: its defaults for shared keys (TOML key -> value), taken where a run leaves the key at the shared default
    shared_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, hyper: Hyper, *, train_size: int | None = None, population: int | None = None,
                 per_round: int | None = None, options: Mapping[str, Any] | None = None) -> None:
        if train_size is not None and not (isinstance(train_size, int) and train_size >= 1):
            raise ValueError(f"train-size must be an integer >= 1, got {train_size!r}")
        if hyper.lr_milestones and train_size is None:
            raise ValueError("lr-milestones are global epochs: the training-set size (train_size) is needed too")
        if population is not None and not (isinstance(population, int) and population >= 1):
            raise ValueError(f"population (num-clients) must be an integer >= 1, got {population!r}")
        hyper = self.with_shared_defaults(hyper)
        for problem in self.problems(hyper):
            raise ValueError(problem)
        #: the method's own settings (an instance of ``Settings``), from ``options`` (TOML keys)
        self.options = self.parse_options(options or {})
        self.hyper = hyper
        self.train_size = train_size
        self.population = population
        #: the clients a round trains when all take part (counts the rounds a backend did not run, e.g. before a resume)
        self.per_round = per_round or population or 1
        self._clients: dict[int, int] = {}  # round -> clients that took part (counts epochs)

    # --- configuration --------------------------------------------------------------------
    @classmethod
    def own_keys(cls) -> dict[str, dataclasses.Field]:
        """TOML key -> field of the method's own settings (none without ``Settings``)."""
        return {f.metadata["key"]: f for f in dataclasses.fields(cls.Settings)} if cls.Settings is not None else {}

    @classmethod
    def with_shared_defaults(cls, hyper: Hyper) -> Hyper:
        """``hyper`` with the method's defaults for shared keys where it holds the shared default."""
        names, defaults = Hyper.keys(), Hyper()
        changes = {names[k]: v for k, v in cls.shared_defaults.items()
                   if k in names and getattr(hyper, names[k]) == getattr(defaults, names[k])}
        return hyper.replace(**changes) if changes else hyper

    @classmethod
    def run_config_keys(cls) -> dict[str, dataclasses.Field]:
        """Run-config key -> field of the method's own settings: each scoped by the method's name,
        ``<name>.<key>`` (``fedavgm.server-lr``; in TOML the table ``[<name>]`` of the run config), so
        that two methods may each have a key of the same name and a value meant for one never
        reaches another."""
        return {f"{cls.name}.{key}": f for key, f in cls.own_keys().items()}

    @classmethod
    def parse_options(cls, values: Mapping[str, Any], *, complete: bool = False, prefix: str = "") -> Any:
        """The method's own settings from TOML keys (missing ones: their defaults; ``complete``:
        an error instead); an unknown key is an error naming the closest own key. ``prefix`` goes
        before every key an error names (``fedavgm.`` where the keys came from a run config)."""
        fields = cls.own_keys()
        unknown = sorted(set(values) - set(fields))
        if unknown:
            close = {k: m[0] for k in unknown if (m := difflib.get_close_matches(k, list(fields), n=1, cutoff=0.7))}
            hint = "".join(f" (did you mean {prefix + m!r} for {prefix + k!r}?)" for k, m in close.items())
            raise ValueError(f"algorithm {cls.name!r} has no setting(s) {[prefix + k for k in unknown]}{hint}; its own "
                             f"keys: {', '.join(prefix + k for k in fields) or 'none'}")
        if cls.Settings is None:
            return None
        missing = [k for k in fields if k not in values]
        if complete and missing:
            raise ConfigError(f"the round's config lacks {', '.join(map(repr, missing))}, setting(s) of algorithm "
                              f"{cls.name!r} its server sends every round")
        kwargs = {}
        for key, f in fields.items():
            typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))  # annotations or not
            value = _coerce(prefix + key, typ, values[key]) if key in values else f.default
            check = f.metadata["check"]
            if check is not None and not check(value):
                raise ValueError(f"{prefix}{key} must be {f.metadata['rule'] or 'valid'}, got {value!r}")
            kwargs[f.name] = value
        return cls.Settings(**kwargs)

    def options_config(self) -> dict[str, Any]:
        """The own settings as round-config entries (TOML key -> value)."""
        if self.options is None:
            return {}
        return {f.metadata["key"]: getattr(self.options, f.name) for f in dataclasses.fields(self.options)}

    @classmethod
    def options_of(cls, settings: RoundSettings) -> Any:
        """The own settings an exchange's config carries (what the client side reads); an error
        names a missing or bad key."""
        keys = cls.own_keys()
        return cls.parse_options({k: v for k, v in settings.extra.items() if k in keys}, complete=True)

    @classmethod
    def problems(cls, hyper: Hyper) -> list[str]:
        """This method's constraints on the hyper-parameters, as messages naming the key."""
        return []

    @classmethod
    def config_problems(cls, cfg: Any) -> list[str]:
        """This method's constraints on a run config (``tasks.config.RunConfig``), beyond
        ``problems``; each message names the key."""
        return []

    @property
    def local_steps(self) -> int:
        """The local steps of a round's training exchange (epochs count them)."""
        return self.hyper.local_steps

    def summary(self) -> list[str]:
        """Lines describing the method's round (logged by the backends)."""
        return [f"{self.name}: {self.paper}" if self.paper else self.name]

    @classmethod
    def label(cls, local_steps: int | str) -> str:
        """The method's name in tables and figures."""
        return f"{cls.__name__} I={local_steps}"

    # --- the schedule (one place: every backend) ----------------------------------------
    def took_part(self, server_round: int, clients: int) -> None:
        """Record the clients that trained in ``server_round`` (epochs and the schedule count them)."""
        self._clients[server_round] = clients

    def clients_before(self, server_round: int, nominal: int | None = None) -> int:
        """Client-rounds done before ``server_round`` (a round not recorded counts ``nominal``,
        default ``per_round``)."""
        nominal = self.per_round if nominal is None else nominal
        return sum(self._clients.get(r, nominal) for r in range(1, server_round))

    def epoch_at(self, rounds_done: int, nominal: int | None = None) -> float | None:
        """Global epochs after ``rounds_done`` rounds (None without a training-set size)."""
        if self.train_size is None:
            return None
        done = self.clients_before(rounds_done + 1, nominal)
        return global_epoch(done, 1, self.local_steps, self.hyper.batch_size, self.train_size)

    def round_hparams(self, server_round: int, nominal: int | None = None) -> tuple[float, float]:
        """(lr, clip) of a round: both decay at the milestones, in global epochs done before it."""
        h = self.hyper
        if self.train_size is None:
            return h.lr, h.clip
        return scheduled(h.lr, h.clip, self.clients_before(server_round, nominal), 1, self.local_steps, h.batch_size,
                         self.train_size, h.lr_milestones, h.lr_decay)

    def round_settings(self, server_round: int, mode: Mode, lr: float, clip: float) -> RoundSettings:
        """An exchange's settings (a gradient exchange takes one step); they name this method,
        whose client side a client runs (``strategies.methods.client_side``)."""
        h = self.hyper
        steps = self.local_steps if mode not in (Mode.GRADIENT, Mode.RESAMPLE) else 1
        return RoundSettings(server_round=server_round, local_steps=steps, batch_size=h.batch_size, lr=lr, clip=clip,
                             weight_decay=h.weight_decay, momentum=h.momentum, mode=mode, algorithm=self.name,
                             extra=self.options_config())

    # --- a round ------------------------------------------------------------------------
    def begin(self, server_round: int, state: Mapping[str, Tensor], clients: Sequence[int], **kw: Any) -> Round:
        """A round over ``clients`` from the global ``state`` (see ``Round`` for ``kw``)."""
        return Round(self, server_round, state, clients, **kw)

    @abstractmethod
    def server(self, rnd: Round) -> Server:
        """The server side of one round (a generator: yield exchanges, return the report)."""

    @classmethod
    @abstractmethod
    def client(cls, exchange: Exchange, group: Any) -> ClientResults:
        """The client side of one exchange for the clients of ``group`` (a ``ClientGroup``),
        which start at ``exchange.state``; it needs nothing of the server's (a ClientApp runs it
        from the message alone)."""

    # --- honest replies ---------------------------------------------------------------------
    def bound(self, settings: RoundSettings, x0_norm: float = 0.0, max_lr_scale: float = 1.0) -> float | None:
        """The farthest an honest client's trainable parameters move from the global model in
        an exchange of ``settings`` (``x0_norm``: the global model's norm over them; the
        batches' largest lr scale); None where no bound holds."""
        return None

    def check_result(self, exchange: Exchange, arrays: Mapping[str, Mapping[str, Tensor]], metrics: Mapping[str, Any],
                     trainable: Sequence[str] | None, max_lr_scale: float = 1.0) -> str | None:
        """Why one client's reply (its ``arrays`` groups, checked for keys, shapes and dtypes
        already) cannot come from an honest client of this exchange, or None."""
        if trainable is None or "arrays" not in arrays or not exchange.state:
            return None
        x0 = exchange.state_norm(trainable)
        limit = self.bound(exchange.settings, x0, max_lr_scale)
        if limit is None or not math.isfinite(limit):
            return None
        s = exchange.settings
        return check_displacement(arrays["arrays"], exchange.state, list(trainable), local_steps=s.local_steps,
                                  lr=s.lr, clip=s.clip, weight_decay=s.weight_decay, momentum=s.momentum,
                                  max_lr_scale=max_lr_scale, bound=limit, x0=x0)

    def reply_groups(self, mode: Mode) -> tuple[str, ...]:
        """The array groups a reply of ``mode`` carries."""
        return ("grads", "buffers") if mode in (Mode.GRADIENT, Mode.RESAMPLE) else ("arrays",)

    # --- server state (checkpoints) --------------------------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        """Server state carried across rounds (checkpointed with the model)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore ``state_dict()``; a method without server state accepts only an empty one."""
        if state:
            raise ValueError(f"{self.name} keeps no server state, the checkpoint holds {sorted(state)}")
