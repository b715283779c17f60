"""One round of a method on one backend: its exchanges, their averages, its typed report (pure).

``Round`` is what a method's server side (``Algorithm.server``) works with: it builds each
``Exchange`` (the settings of its ``Mode`` from the method's schedule, the clients, their
per-client arrays; the bytes it sends), averages the clients' results over all processes
(``mean``: ONE all-reduce, ``strategies.methods.reduce``; the bytes received), keeps the rejections
and failures the backend reports, and ends the round with its ``RoundReport``: the new
global state and the round's metrics -- ``replies``, ``rejected-replies``, ``failed-replies``,
``bytes-sent``, ``bytes-received``, the clients' metrics and the method's own.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from ..core.averaging import state_nbytes
from ..core.bound import norm_in_pieces
from ..core.settings import Hyper, Mode, RoundSettings
from .reduce import AllReduce, ClientResults, Mean, mean, per_client


class Method(Protocol):
    """What a round needs of its method (``strategies.methods.algorithm.Algorithm`` is one)."""

    modes: tuple[Mode, ...]
    groups: dict[str, str]
    hyper: Hyper
    population: int | None

    def round_hparams(self, server_round: int) -> tuple[float, float]: ...

    def round_settings(self, server_round: int, mode: Mode, lr: float, clip: float) -> RoundSettings: ...

    def took_part(self, server_round: int, clients: int) -> None: ...

__all__ = ["Exchange", "Rejection", "Round", "RoundReport", "Server"]

#: what a group of a reply holds: the whole state, the trainable parameters' shapes, or the rest
#: (a method adds its own groups: ``Algorithm.groups``)
GROUP_KINDS = {"arrays": "state", "grads": "trainable", "buffers": "buffers"}


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
    _norms: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def mode(self) -> Mode:
        return self.settings.mode

    def state_norm(self, keys: Sequence[str]) -> float:
        """|state| over ``keys`` (float64), computed once per exchange: every reply's bound uses it."""
        key = tuple(keys)
        if key not in self._norms:
            self._norms[key] = norm_in_pieces(self.state, key)
        return self._norms[key]

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

    def __init__(self, algorithm: Method, server_round: int, state: Mapping[str, Tensor], clients: Sequence[int],
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
        #: the run's DP mechanism (``strategies.methods.privacy.Privacy``, set on the method by the backend), or None
        self.privacy = getattr(algorithm, "privacy", None)
        self.dp_metrics: dict[str, float | int] = {}  # the DP round's metrics (epsilon, S, noise std, ...)

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
        kinds = {**GROUP_KINDS, **self.algorithm.groups}
        kind = kinds.get(group, "state")
        trainable = self.trainable
        if trainable is None and sample is not None:
            named = next((sample[g] for g in sample if kinds.get(g) == "trainable"), None)
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
        sums = {"clients": float(results.all_clients()), **self._pending}
        if self.privacy is not None and self._last is not None and self._last.final:  # a DP round's release
            if results.node_sums:
                raise ValueError("a DP round needs every client's own update: node-aggregation sums them at the nodes")
            m = self.privacy.mean(self, results, groups, sums)
        else:
            sample = {g: per_client(a)[0] for g, a in results.arrays.items()} if len(results) else None
            like = {g: self.like(g, sample) for g in groups}
            hyper = self.algorithm.hyper
            m = mean(results, like, aggregation=aggregation or hyper.aggregation, trim_fraction=hyper.trim_fraction,
                     expected=self._expected_for(results), all_reduce=self.all_reduce, sums=sums,
                     population=self.algorithm.population or self.expected, node_sums=results.node_sums,
                     node_reference={g: like[g] if self.summed_from_global(g) else None for g in groups})
        for key in self._totals:
            self._totals[key] += int(round(m.sums[key]))
        self._pending = {k: 0.0 for k in self._pending}
        return m

    def _expected_for(self, results: ClientResults) -> int:
        if self._last is not None and self._last.expected is not None:
            return self._last.expected
        return results.all_clients()

    def summed_from_global(self, group: str) -> bool:
        """Whether a node sums a group's update from the global model (a state or buffers group) rather
        than its values (a gradient-like group shaped as the trainable parameters)."""
        return {**GROUP_KINDS, **self.algorithm.groups}.get(group, "state") in ("state", "buffers")

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
            **self.dp_metrics,
        }
        return RoundReport(self.server_round, self.lr, self.clip, state, out, list(self.rejected))

    def unchanged(self, **extra: float | int) -> RoundReport:
        """A round without a usable average: the global model stays."""
        final = self._last.mode if self._last is not None else None
        out = {"replies": 0, "rejected-replies": sum(1 for r in self.rejected if r.mode == final),
               "failed-replies": self.failed.get(final, 0),
               "bytes-sent": self._totals["bytes-sent"] + int(self._pending["bytes-sent"]),
               "bytes-received": self._totals["bytes-received"] + int(self._pending["bytes-received"]), **extra,
               **self.dp_metrics}
        return RoundReport(self.server_round, self.lr, self.clip, None, out, list(self.rejected))


#: the server side of one round: yields exchanges, receives results, returns the report
Server = Generator[Exchange, ClientResults, RoundReport]
