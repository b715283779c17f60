"""The algorithm layer: each method defined once, driven by every backend (pure, no flwr).

A method (``strategies.algorithms``: CELGC, local SGD, naive parallel clipping, EPISODE,
single-machine clipped SGD, SCAFFOLD) is ONE subclass of ``Algorithm`` with two sides:

* the server side, ``server(rnd)``: one round as straight-line code, a generator that yields
  each ``Exchange`` (what the round's clients are sent: the global model, the settings with
  their ``Mode``, any per-client arrays) and receives the clients' ``ClientResults``, averages
  them with ``rnd.mean`` (sum-then-finalise, ``strategies.reduce``) and ends with
  ``rnd.finish(new_state, metrics)``, which returns the round's typed ``RoundReport``;
* the client side, ``client(exchange, group)``: what the clients of a ``ClientGroup`` do in
  one exchange, with the primitives of ``strategies.executors`` (local steps of a step
  rule, a gradient) -- one client in a ClientApp, many in the engine.

Beside them a method states what an honest client's reply can be: ``bound(settings)``, the
farthest its trainable parameters can move from the global model in the round (None: no
bound holds), checked by the Flower strategies on every reply; and ``check_result`` for the
rest of its own reply. A backend drives the generator: the Flower strategy across
``configure_train`` / ``aggregate_train`` (messages in and out), the engine in a loop over its
executors (one flat all-reduce per exchange across processes). No backend names a method.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from .averaging import state_nbytes
from .bound import check_displacement
from .reduce import AllReduce, ClientResults, Mean, mean, per_client
from .schedule import global_epoch, scheduled
from .settings import Hyper, Mode, RoundSettings

__all__ = ["Algorithm", "Exchange", "Rejection", "Round", "RoundReport", "Server"]

#: what a group of a reply holds: the whole state, the trainable parameters' shapes, or the rest
GROUP_KINDS = {"arrays": "state", "grads": "trainable", "control": "trainable", "buffers": "buffers"}


@dataclass
class Exchange:
    """What the server sends in one exchange of a round: the global ``state``, the
    ``settings`` (their ``mode`` says what the clients do) and per-client ``arrays``
    (record name -> one mapping per client of ``clients``, e.g. EPISODE's corrections)."""

    settings: RoundSettings
    clients: list[int]
    state: Mapping[str, Tensor]
    arrays: dict[str, list[Mapping[str, Tensor]]] = field(default_factory=dict)
    final: bool = True
    expected: int | None = None  # clients asked over all processes (None: len(clients))

    @property
    def mode(self) -> Mode:
        return self.settings.mode

    def for_clients(self, positions: Sequence[int]) -> Exchange:
        """The same exchange for the clients at ``positions`` (one client of a ClientApp)."""
        return Exchange(self.settings, [self.clients[i] for i in positions], self.state,
                        {k: [v[i] for i in positions] for k, v in self.arrays.items()}, self.final, self.expected)

    def sent_bytes(self) -> int:
        """What this exchange's messages carry: the model once per client plus its arrays."""
        model = state_nbytes(self.state)
        return sum(model + sum(state_nbytes(a[i]) for a in self.arrays.values()) for i in range(len(self.clients)))


@dataclass(frozen=True)
class Rejection:
    """A client's reply that was not used, and why (``mode``: the exchange it answered)."""

    client: int | str
    reason: str
    mode: Mode | None = None


@dataclass
class RoundReport:
    """The outcome of one round: the new global state (None: unchanged) and the round's
    metrics -- ``replies``, ``rejected-replies``, ``failed-replies``, ``bytes-sent``,
    ``bytes-received``, the clients' metrics and the method's own -- and the rejections."""

    server_round: int
    lr: float
    clip: float
    state: dict[str, Tensor] | None
    metrics: dict[str, float | int]
    rejected: list[Rejection] = field(default_factory=list)

    @property
    def replies(self) -> int:
        return int(self.metrics.get("replies", 0))


class Round:
    """One round of a method on one backend process: the exchanges' bookkeeping and averaging.

    ``clients``: the round's clients this process drives; ``expected``: the round's clients
    over all processes (default: ``len(clients)``); ``all_reduce``: the sum over processes
    (None: one process); ``trainable``: the names of the trainable parameters (None: taken
    from the replies)."""

    def __init__(self, algorithm: Algorithm, server_round: int, state: Mapping[str, Tensor], clients: Sequence[int],
                 *, expected: int | None = None, all_reduce: AllReduce | None = None,
                 trainable: Sequence[str] | None = None) -> None:
        self.algorithm = algorithm
        self.server_round = server_round
        self.state = dict(state)
        self.clients = list(clients)
        self.expected = len(self.clients) if expected is None else expected
        self.all_reduce = all_reduce
        self.trainable = None if trainable is None else list(trainable)
        self.lr, self.clip = algorithm.round_hparams(server_round)
        self.rejected: list[Rejection] = []
        self.failed: dict[Mode | None, int] = {}  # clients without a usable reply (errors, timeouts), by exchange
        self._pending = {"bytes-sent": 0.0, "bytes-received": 0.0}  # this process's, until the next mean
        self._totals = {"bytes-sent": 0, "bytes-received": 0}
        self._exchanges = 0
        self._last: Exchange | None = None

    # --- exchanges -----------------------------------------------------------------------
    def settings(self, mode: Mode, **changes: Any) -> RoundSettings:
        """The round's scheduled settings for an exchange of ``mode``."""
        return self.algorithm.round_settings(self.server_round, mode, self.lr, self.clip).replace(**changes)

    def exchange(self, mode: Mode, clients: Sequence[int] | None = None, arrays: dict[str, list[Any]] | None = None,
                 expected: int | None = None, **changes: Any) -> Exchange:
        """The next exchange: ``mode`` for ``clients`` (default: the round's), per-client
        ``arrays``; ``expected``: the clients asked over all processes."""
        clients = self.clients if clients is None else list(clients)
        modes = self.algorithm.modes
        self._exchanges += 1
        ex = Exchange(self.settings(mode, **changes), clients, self.state, dict(arrays or {}),
                      final=mode == modes[-1], expected=self.expected if expected is None else expected)
        for name, values in ex.arrays.items():
            if len(values) != len(clients):
                raise ValueError(f"{name!r}: {len(values)} arrays for {len(clients)} clients")
        self._pending["bytes-sent"] += ex.sent_bytes()
        self._last = ex
        if ex.final:  # the clients that train in the round: global epochs and the schedule count them
            self.algorithm.took_part(self.server_round, ex.expected)
        return ex

    def received(self, nbytes: int) -> None:
        """Count reply bytes that never reach the method (rejected replies)."""
        self._pending["bytes-received"] += nbytes

    def reject(self, client: int | str, reason: str) -> None:
        """A reply of the current exchange that is not used (counted in ``rejected-replies``
        when the exchange is the round's last), with the reason."""
        self.rejected.append(Rejection(client, reason, self._last.mode if self._last is not None else None))

    def fail(self, count: int = 1) -> None:
        """Clients of the current exchange without a usable reply (errors, timeouts)."""
        mode = self._last.mode if self._last is not None else None
        self.failed[mode] = self.failed.get(mode, 0) + count

    # --- averaging -----------------------------------------------------------------------
    def like(self, group: str, sample: Mapping[str, Mapping[str, Tensor]] | None = None) -> dict[str, Tensor]:
        """The keys, shapes and dtypes of a group's average: from the global model where it is
        known, else from ``sample`` (one client's groups)."""
        kind = GROUP_KINDS.get(group, "state")
        trainable = self.trainable
        if trainable is None and sample is not None:
            named = next((sample[g] for g in sample if GROUP_KINDS.get(g) == "trainable"), None)
            trainable = list(named) if named is not None else None
        if self.state and (kind == "state" or trainable is not None):
            if kind == "state":
                return self.state
            if kind == "trainable":
                return {k: self.state[k] for k in trainable}
            return {k: v for k, v in self.state.items() if k not in set(trainable)}
        if sample is None or group not in sample:
            if self.state and kind != "state":
                return {}  # no result and the trainable parameters unknown: nothing to average
            raise ValueError(f"no result to take the layout of {group!r} from, and no global model")
        return {k: v.detach() for k, v in sample[group].items()}

    def mean(self, results: ClientResults, *groups: str, aggregation: str | None = None) -> Mean:
        """The groups' averages over the sound clients of all processes (ONE all-reduce).

        Also sums, over all processes, the clients given (``Mean.metrics["clients"]``) and the
        bytes sent and received so far."""
        self._pending["bytes-received"] += results.nbytes()
        sample = {g: per_client(a)[0] for g, a in results.arrays.items()} if len(results) else None
        like = {g: self.like(g, sample) for g in groups}
        sums = {"clients": float(len(results)), **self._pending}
        m = mean(results, like, aggregation=aggregation or self.algorithm.hyper.aggregation,
                 expected=self._expected_for(results), all_reduce=self.all_reduce, sums=sums)
        for key in self._totals:
            self._totals[key] += int(round(m.sums[key]))
        self._pending = {k: 0.0 for k in self._pending}
        return m

    def _expected_for(self, results: ClientResults) -> int:
        return self._last.expected if self._last is not None and self._last.expected is not None else len(results)

    def finish(self, state: dict[str, Tensor] | None, last: Mean, metrics: Mapping[str, float | int] | None = None,
               **extra: float | int) -> RoundReport:
        """The round's report from its final average ``last`` (``state``: the new global state,
        None: unchanged): the counts, the bytes, the clients' ``metrics`` (default: the
        average's) and the method's own metrics ``extra``."""
        clients = int(round(last.sums.get("clients", last.replies)))
        final = self._last.mode if self._last is not None else None
        out: dict[str, float | int] = {
            "replies": last.replies,
            "rejected-replies": sum(1 for r in self.rejected if r.mode == final) + (clients - last.replies),
            "failed-replies": self.failed.get(final, 0),
            "bytes-sent": self._totals["bytes-sent"],
            "bytes-received": self._totals["bytes-received"],
            **(last.metrics if metrics is None else metrics),
            **extra,
        }
        return RoundReport(self.server_round, self.lr, self.clip, state, out, list(self.rejected))

    def unchanged(self, **extra: float | int) -> RoundReport:
        """A round without a usable average: the global model stays."""
        final = self._last.mode if self._last is not None else None
        out = {"replies": 0, "rejected-replies": sum(1 for r in self.rejected if r.mode == final),
               "failed-replies": self.failed.get(final, 0),
               "bytes-sent": self._totals["bytes-sent"] + int(self._pending["bytes-sent"]),
               "bytes-received": self._totals["bytes-received"] + int(self._pending["bytes-received"]), **extra}
        return RoundReport(self.server_round, self.lr, self.clip, None, out, list(self.rejected))


#: the server side of one round: yields exchanges, receives results, returns the report
Server = Generator[Exchange, ClientResults, RoundReport]


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
    #: its replies mean nothing without the round's global model (it steps on it)
    needs_global: ClassVar[bool] = True

    def __init__(self, hyper: Hyper, *, train_size: int | None = None, population: int | None = None,
                 per_round: int | None = None) -> None:
        if train_size is not None and not (isinstance(train_size, int) and train_size >= 1):
            raise ValueError(f"train-size must be an integer >= 1, got {train_size!r}")
        if hyper.lr_milestones and train_size is None:
            raise ValueError("lr-milestones are global epochs: the training-set size (train_size) is needed too")
        if population is not None and not (isinstance(population, int) and population >= 1):
            raise ValueError(f"population (num-clients) must be an integer >= 1, got {population!r}")
        for problem in self.problems(hyper):
            raise ValueError(problem)
        self.hyper = hyper
        self.train_size = train_size
        self.population = population
        #: the clients a round trains when all take part (counts the rounds a backend did not run, e.g. before a resume)
        self.per_round = per_round or population or 1
        self._clients: dict[int, int] = {}  # round -> clients that took part (counts epochs)

    # --- configuration --------------------------------------------------------------------
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
        """An exchange's settings (a gradient exchange takes one step)."""
        h = self.hyper
        steps = self.local_steps if mode not in (Mode.GRADIENT, Mode.RESAMPLE) else 1
        return RoundSettings(server_round=server_round, local_steps=steps, batch_size=h.batch_size, lr=lr, clip=clip,
                             weight_decay=h.weight_decay, momentum=h.momentum, mode=mode)

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
        from .bound import norm

        x0 = norm(exchange.state, trainable)
        limit = self.bound(exchange.settings, x0, max_lr_scale)
        if limit is None or not math.isfinite(limit):
            return None
        s = exchange.settings
        return check_displacement(arrays["arrays"], exchange.state, list(trainable), local_steps=s.local_steps,
                                  lr=s.lr, clip=s.clip, weight_decay=s.weight_decay, momentum=s.momentum,
                                  max_lr_scale=max_lr_scale, bound=limit)

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


def to_device(state: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device) for k, v in state.items()}
