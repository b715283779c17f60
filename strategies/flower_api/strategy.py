"""The Flower adapter of the algorithm layer: a FedAvg that drives one method's rounds.

``ClippedSGDStrategy`` is a ``FedAvg`` that honours FedAvg's contract (``weighted_by_key``,
``arrayrecord_key``, ``configrecord_key``, ``train_metrics_aggr_fn`` and
``evaluate_metrics_aggr_fn``, float weights, ``fraction_train`` / ``min_*_nodes``) and runs the
rounds of its method (``algorithm_class``, ``strategies.methods``): ``configure_train``
samples the nodes, starts the method's round and sends its exchanges (a method with two
exchanges, EPISODE, has its first one answered inside ``configure_train``);
``aggregate_train`` reads and checks every reply in ONE place (``strategies.flower_api.wire.read_reply``:
structure, ranges, the global model's layout, the method's bound on an honest reply; a bad
reply is rejected and counted, never averaged and never a crash) and hands the sound ones to
the method, whose typed ``RoundReport`` is kept as ``last_report``. The strategy classes of
the methods (``CELGC``, ``NaiveParallelClip``, ``EPISODE``, ``SCAFFOLD``) only name their method
and their own knobs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from logging import INFO, WARNING
from typing import Any, ClassVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords, sample_nodes
from flwr.supercore import log

from ..core.averaging import NON_FINITE
from ..core.buffers import Norm
from ..core.schedule import global_epoch, scheduled
from ..core.settings import DEFAULTS, OWNED_KEYS, Hyper
from ..methods import CELGC as CELGCMethod
from ..methods.algorithm import Algorithm
from ..methods.reduce import ClientResults
from ..methods.round import Exchange, Round, RoundReport
from .node_sampling import Assign, Select, sample
from .screen import Checks, screen
from .wire import TRANSPORT_ERROR, TRANSPORTS, NamedClients, Reply, messages

#: the Strategy methods that run a round: a class mixing in another strategy's version of one is refused
ROUND_HOOKS = ("configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate", "start")
#: Flower's robust strategies and the ``aggregation`` that computes the same here
ROBUST_EQUIVALENT = {"FedMedian": "aggregation=\"median\"",
                     "FedTrimmedAvg": "aggregation=\"trimmed-mean\", trim_fraction=beta"}

#: CELGC's own client metrics: a reply with neither comes from a ClientApp that does not run local clipped SGD
OWN_METRICS = ("num-steps", "clip-fraction")


class ClippedSGDStrategy(FedAvg):
    """A method of ``strategies.methods`` as a Flower strategy.

    Parameters
    ----------
    lr : float
        eta, the learning rate (> 0).
    clip : float (default: 0.3, as every default: ``strategies.core.settings.Hyper``)
        gamma, the clipping threshold (> 0); ``math.inf`` disables clipping.
    batch_size : int (default: 32)
        Minibatch size of every step.
    weight_decay, momentum : float (default: 0.0)
        lambda and mu (torch.optim.SGD semantics; the paper uses mu = 0).
    lr_decay : float (default: 0.1)
        Factor applied to lr and clip at each milestone.
    lr_milestones : sequence of float (default: ())
        Global epochs at which lr and clip decay. Needs ``train_size``. Epochs are counted
        from the clients actually sampled in each round.
    train_size : int, optional
        Training-set size (all clients together), to count global epochs.
    aggregation : {"uniform", "examples", "median", "trimmed-mean"} (default: "uniform")
        Uniform mean (the paper), weighted by each reply's ``weighted_by_key`` value, or a
        coordinate-wise robust statistic of the sound replies (``strategies.core.robust_statistics``: after
        the reply checks and the bound; what Flower's FedMedian and FedTrimmedAvg compute).
    trim_fraction : float (default: 0.2, Flower's FedTrimmedAvg beta)
        beta of ``aggregation="trimmed-mean"``: floor(beta n) values dropped at each end.
    num_clients : int, optional
        Clients sampled per round: exactly ``num_clients`` once that many nodes are
        connected (at least ``min_train_nodes``, which defaults to ``num_clients``: the
        round waits for them). None: FedAvg's ``fraction_train`` sampling.
    local_steps : int (default: 8)
        I, local steps per round (the method's own classes set or refuse it).
    population : int, optional
        N, all clients, for a method whose server state depends on it (SCAFFOLD under
        partial participation); None: the clients of each round.
    verify_examples : bool (default: False)
        Reject a reply whose ``num-examples`` is not the exchange's steps x ``batch_size``
        (what a client that counts a batch's rows processes): the server does not trust a
        client's count. Off for clients that count examples otherwise.
    bound_keys : sequence of str, optional
        Names of the trainable parameters: replies are checked against them (a gradient
        names exactly them) and against the method's bound on how far an honest client
        moves them (``Algorithm.bound``; off where no bound holds).
    max_lr_scale : float (default: 1.0)
        The largest per-step lr scale an honest client uses (batches' ``lr_scale``);
        ``math.inf`` turns the displacement bound off.
    buffer_rules : sequence of strategies.core.buffers.Norm, optional
        The model's BatchNorm layers (``strategies.core.buffers.buffer_rules(model)``): each reply's
        ``num_batches_tracked`` must be the global count plus the exchange's local steps and its
        ``running_var`` at least what those steps leave of the global one. None: layers known by
        their buffers' names, only ``running_var >= 0`` checked (a foreign client may take any
        number of forwards). Integer buffers beyond +-2**53 are rejected either way.
    select : callable, optional
        ``select(server_round, node_ids) -> node_ids``: which of the connected nodes
        (sorted ids, at least ``min_available_nodes`` of them, waited for) train in the
        round, instead of a uniform random sample -- e.g. the nodes holding the round's
        partitions under partial participation (``strategies.core.client_sampling``), so every
        backend trains the same clients. It must return distinct connected node ids.
    assign : callable, optional
        ``assign(server_round, node_ids) -> {node: [client ids]}``: the round's clients and the
        connected node that serves each (a multi-client node runs several with one call of its
        executor: the ServerApp's federation of partitions). The messages then go one per node
        (``strategies.flower_api.wire``: the global model once, ``clients`` in the config, each client's
        arrays and reply records suffixed with its id), every client's reply is read and checked
        on its own, and the clients' ids are their partition ids. Replaces ``select``.
    exchange_timeout : float, optional
        Seconds to wait for the replies of a method's first exchanges (EPISODE's resample;
        None: no limit); the last exchange's replies are waited for by ``Strategy.start``.
    packed : bool (default: False)
        Send each train message's arrays as ONE packed record (``strategies.flower_api.packing``),
        which this project's ClientApp reads and answers alike; replies of either kind are read.
        Off for a ClientApp that expects Flower's usual ArrayRecord.
    transport : {"float32", "bfloat16", "float16"} (default: "float32")
        How the model's trainable parameters travel (``packed`` only): exact, or rounded to half
        the bytes -- the global model rounded, each reply's model as its rounded difference from
        the model it received, added to the server's exact model (lossy: the run's model differs
        from the engine's; the bound on a reply is widened by the rounding, ``wire.TRANSPORT_ERROR``).
    node_sums : bool (default: False)
        A node serving several clients of an exchange (``assign``) replies with their sum instead of
        each client's arrays (``packed`` only; a method that only averages; uniform or examples
        aggregation): one model's bytes a node. The checks see the node's average (keys, shapes,
        finite values, buffers, the bound); the model equals the one from every client's arrays
        up to the order of the float64 sum (``strategies.methods.reduce.NodeSum``).
    **fedavg_kwargs
        Passed to ``FedAvg``: ``fraction_train``, ``fraction_evaluate``, ``min_train_nodes``,
        ``min_available_nodes``, ``weighted_by_key`` (default
        ``"num-examples"``: every reply needs it, a real number >= 0), ``arrayrecord_key``,
        ``configrecord_key``, ``train_metrics_aggr_fn`` (the clients' own metrics, kept in
        the round's metrics beside the strategy's), ``evaluate_metrics_aggr_fn``.

    The round's ``ConfigRecord`` holds the caller's ``train_config`` plus the keys in
    ``OWNED_KEYS`` (and ``server-round``); a ``train_config`` that sets an owned key is an
    error naming it (set the strategy's argument instead).
    """

    #: the method this strategy runs
    algorithm_class: ClassVar[type[Algorithm]] = CELGCMethod

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse a class that mixes in another Flower strategy's rounds: with this class first
        in the MRO the other's aggregation is silently never called (``class X(CELGC,
        FedMedian)`` averages), with it first this class's reply checks and bound are dropped.
        A robust aggregation is this class's ``aggregation=`` argument instead."""
        super().__init_subclass__(**kwargs)
        for base in cls.__mro__:
            if issubclass(base, ClippedSGDStrategy) or base in (FedAvg, *FedAvg.__mro__):
                continue
            hooks = sorted(h for h in ROUND_HOOKS if h in vars(base))
            if hooks:
                use = ROBUST_EQUIVALENT.get(base.__name__)
                fix = (f"pass {use} to the clipped-SGD strategy instead (e.g. CELGC(..., {use})): it aggregates "
                       "robustly after the reply checks and the bound" if use else
                       "subclass the clipped-SGD strategy alone; its robust aggregations are aggregation=\"median\" "
                       "and aggregation=\"trimmed-mean\"")
                raise TypeError(
                    f"{cls.__name__} mixes {base.__name__} into a clipped-SGD strategy: {base.__name__}'s "
                    f"{', '.join(hooks)} and the clipped-SGD rounds cannot both run (whichever comes first in the MRO "
                    f"wins: the other's aggregation is silently skipped, or the reply checks and the bound are "
                    f"dropped); {fix}")

    def __init__(
        self,
        lr: float,
        clip: float = DEFAULTS.clip,
        batch_size: int = DEFAULTS.batch_size,
        weight_decay: float = DEFAULTS.weight_decay,
        momentum: float = DEFAULTS.momentum,
        lr_decay: float = DEFAULTS.lr_decay,
        lr_milestones: Sequence[float] = DEFAULTS.lr_milestones,
        train_size: int | None = None,
        aggregation: str = DEFAULTS.aggregation,
        trim_fraction: float = DEFAULTS.trim_fraction,
        num_clients: int | None = None,
        verify_examples: bool = False,
        bound_keys: Sequence[str] | None = None,
        max_lr_scale: float = 1.0,
        buffer_rules: Sequence[Norm] | None = None,
        select: Select | None = None,
        assign: Assign | None = None,
        local_steps: int = DEFAULTS.local_steps,
        population: int | None = None,
        exchange_timeout: float | None = None,
        packed: bool = False,
        transport: str = "float32",
        node_sums: bool = False,
        **fedavg_kwargs: Any,
    ) -> None:
        if num_clients is not None:
            if isinstance(num_clients, bool) or not (isinstance(num_clients, int) and num_clients >= 1):
                raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
            fedavg_kwargs.setdefault("min_train_nodes", num_clients)
            fedavg_kwargs.setdefault("min_available_nodes", num_clients)
        own = {f.name: f.metadata["key"] for f in self.algorithm_class.own_keys().values()}
        options = {own[k]: fedavg_kwargs.pop(k) for k in list(fedavg_kwargs) if k in own}  # the method's own arguments
        super().__init__(**fedavg_kwargs)
        checks: list[tuple[bool, str]] = [
            (max_lr_scale >= 1, f"max_lr_scale must be >= 1 (math.inf: no bound), got {max_lr_scale!r}"),
            (select is None or callable(select), f"select must be callable (server_round, node_ids) -> node_ids, got {select!r}"),
            (assign is None or callable(assign),
             f"assign must be callable (server_round, node_ids) -> {{node: [client ids]}}, got {assign!r}"),
            (exchange_timeout is None or exchange_timeout > 0,
             f"exchange_timeout must be > 0 seconds or None, got {exchange_timeout!r}"),
            (transport in TRANSPORTS, f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}"),
            (transport == "float32" or packed, f"transport={transport!r} needs packed=True (this project's ClientApp)"),
            (not node_sums or packed, "node_sums=True needs packed=True (this project's ClientApp sums its clients)"),
            (not node_sums or self.algorithm_class.node_sums,
             f"node_sums=True needs a method whose server only averages the replies; {self.algorithm_class.name!r} "
             "does not"),
            (not node_sums or aggregation in ("uniform", "examples"),
             f"node_sums=True needs aggregation 'uniform' or 'examples' (a node cannot sum a robust statistic), got "
             f"{aggregation!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        hyper = Hyper.from_arguments(local_steps=local_steps, batch_size=batch_size, lr=float(lr), clip=float(clip),
                      weight_decay=float(weight_decay), momentum=float(momentum), lr_decay=float(lr_decay),
                      lr_milestones=tuple(float(m) for m in lr_milestones), aggregation=aggregation,
                      trim_fraction=trim_fraction)
        self.num_clients = num_clients
        self.algorithm = self.algorithm_class(hyper, train_size=train_size, population=population,
                                              per_round=self.clients_per_round(), options=options)
        self.verify_examples = verify_examples
        self.bound_keys = list(bound_keys) if bound_keys is not None else None
        self.max_lr_scale = float(max_lr_scale)
        self.buffer_rules = tuple(buffer_rules) if buffer_rules is not None else None
        self.select = select
        self.assign = assign
        self.exchange_timeout = exchange_timeout
        self.packed = bool(packed)
        self.transport = transport
        self.node_sums = bool(node_sums)
        self._round: tuple[Round, Any, Exchange, dict | None] | None = None  # the round configure_train started
        self._last_start: tuple[int, dict, list[int]] | None = None
        self._config = ConfigRecord()
        self._warned_foreign = False
        self.last_report: RoundReport | None = None
        self.last_round_metrics: MetricRecord | None = None
        self.last_failures: list[str] = []

    # --- settings (the method's hyper-parameters) --------------------------------------
    @property
    def hyper(self) -> Hyper:
        return self.algorithm.hyper

    lr = property(lambda self: self.hyper.lr)
    clip = property(lambda self: self.hyper.clip)
    batch_size = property(lambda self: self.hyper.batch_size)
    weight_decay = property(lambda self: self.hyper.weight_decay)
    momentum = property(lambda self: self.hyper.momentum)
    lr_decay = property(lambda self: self.hyper.lr_decay)
    lr_milestones = property(lambda self: self.hyper.lr_milestones)
    aggregation = property(lambda self: self.hyper.aggregation)
    trim_fraction = property(lambda self: self.hyper.trim_fraction)
    train_size = property(lambda self: self.algorithm.train_size)
    local_steps = property(lambda self: self.algorithm.local_steps)

    def summary(self) -> None:
        """Log every setting."""
        h = self.hyper
        log(INFO, "\t├──> %s settings:", type(self).__name__)
        for line in self.algorithm.summary():
            log(INFO, "\t│\t├── %s", line)
        log(INFO, "\t│\t├── local steps I: %d | batch size: %d", self.local_steps, h.batch_size)
        log(INFO, "\t│\t├── lr: %g | clip: %s | weight decay: %g | momentum: %g",
            h.lr, "off" if not h.clipping else f"{h.clip:g}", h.weight_decay, h.momentum)
        log(INFO, "\t│\t├── schedule: x%g at global epochs %s (train size %s)",
            h.lr_decay, list(h.lr_milestones), self.train_size)
        log(INFO, "\t│\t├── aggregation: %s | clients per round: %s",
            h.aggregation + (f" (trim-fraction {h.trim_fraction:g})" if h.aggregation == "trimmed-mean" else ""),
            self.num_clients or "all")
        log(INFO, "\t│\t└── non-finite, mis-shaped or out-of-bound replies are rejected")
        super().summary()

    def clients_per_round(self) -> int:
        """The clients a round samples when every node is connected."""
        return self.num_clients or max(self.min_train_nodes, 1)

    def epoch_at(self, rounds_done: int, clients_per_round: int | None = None) -> float | None:
        """Global epochs after ``rounds_done`` rounds (None without ``train_size``): counted from
        the clients that trained, or at ``clients_per_round`` a round."""
        if clients_per_round is None:
            return self.algorithm.epoch_at(rounds_done)
        return None if self.train_size is None else global_epoch(rounds_done, clients_per_round, self.local_steps,
                                                                 self.hyper.batch_size, self.train_size)

    def round_hparams(self, server_round: int, clients_per_round: int | None = None) -> tuple[float, float]:
        """(lr, clip) of a round after the schedule (epochs completed before the round): counted
        from the clients that trained, or at ``clients_per_round`` a round."""
        h = self.hyper
        if clients_per_round is None:
            return self.algorithm.round_hparams(server_round)
        if self.train_size is None:
            return h.lr, h.clip
        return scheduled(h.lr, h.clip, server_round - 1, clients_per_round, self.local_steps, h.batch_size,
                         self.train_size, h.lr_milestones, h.lr_decay)

    def round_config(self, server_round: int, clients_per_round: int | None = None) -> dict[str, Any]:
        """The settings every client receives in the first exchange of ``server_round`` (the
        schedule as ``round_hparams``)."""
        lr, clip = self.round_hparams(server_round, clients_per_round)
        return self.algorithm.round_settings(server_round, self.algorithm.modes[0], lr, clip).to_config()

    def owned_keys(self) -> dict[str, str]:
        """Round-config keys this strategy sets -> the argument that sets them."""
        return dict(OWNED_KEYS)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Server state carried across rounds (the method's), for checkpoints."""
        return self.algorithm.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``state_dict()`` (a resumed run continues with the same server state)."""
        self.algorithm.load_state_dict(state)

    # --- rounds -----------------------------------------------------------------------
    def sample(self, grid: Grid, server_round: int | None = None) -> list[int]:
        """This round's clients (``strategies.flower_api.node_sampling.sample``)."""
        return sample(grid, num_clients=self.num_clients, fraction=self.fraction_train,
                      min_train_nodes=self.min_train_nodes, min_available_nodes=self.min_available_nodes,
                      select=self.select, server_round=server_round)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Start the method's round: its first exchanges answered here, the last one's
        messages returned (the global arrays and the round's settings to the sampled clients)."""
        owned = self.owned_keys()
        clash = [k for k in config if k in owned]
        if clash:
            raise ValueError(
                f"train_config sets {', '.join(repr(k) for k in clash)}, which {type(self).__name__} sends every round: "
                f"set {', '.join(f'{owned[k]}=' for k in clash)} on the strategy instead"
            )
        self._round = None
        self.last_failures = []
        if self.fraction_train == 0.0:
            return []
        config = ConfigRecord(dict(config))
        config["server-round"] = server_round
        self._config = config
        served = self._assigned(grid, server_round) if self.assign is not None else None
        clients = sorted(p for ps in served.values() for p in ps) if served is not None else self.sample(grid, server_round)
        rnd = self.algorithm.begin(server_round, arrays.to_torch_state_dict(), clients, trainable=self.bound_keys)
        self._last_start = (server_round, rnd.state, list(clients))
        gen = self.algorithm.server(rnd)
        exchange = next(gen)
        while not exchange.final:
            holders = _holders(served, exchange)
            sent = self._messages(exchange, arrays, holders)
            replies = list(grid.send_and_receive(sent, timeout=self.exchange_timeout))
            try:
                exchange = gen.send(self._results(rnd, exchange, replies, holders=holders)[0])
            except StopIteration as stop:  # the round ended early (no sound reply to go on with)
                self._report(stop.value, [])
                log(WARNING, "Round %d: no sound reply to the %s exchange, the round is skipped", server_round,
                    exchange.mode.value)
                return []
        holders = _holders(served, exchange)
        self._round = (rnd, gen, exchange, holders)
        return self._messages(exchange, arrays, holders)

    def _assigned(self, grid: Grid, server_round: int) -> dict[int, list[int]]:
        """The round's clients by the node that serves each (``assign``), checked."""
        _, everyone = sample_nodes(grid, self.min_available_nodes, 0)  # waits for min_available_nodes
        connected = sorted(everyone)
        assigned = self.assign(server_round, connected)
        served = {int(n): [int(p) for p in ps] for n, ps in assigned.items()}
        if isinstance(assigned, NamedClients):  # nodes serving several clients: the messages name theirs
            served = NamedClients(served)
        clients = [p for ps in served.values() for p in ps]
        if set(served) - set(connected) or len(set(clients)) != len(clients):
            raise ValueError(f"assign({server_round}, ...) must map connected node ids to distinct clients, got "
                             f"{served} (connected: {connected})")
        log(INFO, "configure_train: %d clients on %d nodes (out of %d)", len(clients),
            sum(1 for ps in served.values() if ps), len(connected))
        return served

    def _messages(self, exchange: Exchange, arrays: ArrayRecord, holders: dict | None = None) -> list[Message]:
        return messages(exchange, arrays, self._config, arrayrecord_key=self.arrayrecord_key,
                        configrecord_key=self.configrecord_key, holders=holders, packed=self.packed,
                        transport=self.transport if self.packed else "float32", trainable=self.bound_keys,
                        node_sum=self.hyper.aggregation if self.node_sums else None)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Read and check every reply, then give the sound ones to the method; count rejected
        and failed ones. Every reply rejected for one structural reason raises
        ``InconsistentMessageReplies`` naming it (as FedAvg does), instead of an empty round."""
        replies = list(replies)
        started = self._round if self._round is not None and self._round[0].server_round == server_round else None
        self._round = None
        if started is None and not replies and self.last_report is not None \
                and self.last_report.server_round == server_round:  # a round configure_train already ended
            return self._report(self.last_report, [])
        if started is None:  # no configure_train for these replies: the last global model of the round, if any
            self.last_failures = []
            state, clients = ({}, [m.metadata.src_node_id for m in replies])
            if self._last_start is not None and self._last_start[0] == server_round and len(self.algorithm.modes) == 1:
                _, state, clients = self._last_start
            rnd = self.algorithm.begin(server_round, state, clients, trainable=self.bound_keys)
            gen = self.algorithm.server(rnd)
            exchange, holders = next(gen), None
        else:
            rnd, gen, exchange, holders = started
        results, sound = self._results(rnd, exchange, replies, holders=holders, final=True)
        if not sound and not rnd.state:  # nothing to average and no global model to keep
            return self._report(rnd.unchanged(), [])
        try:
            gen.send(results)
        except StopIteration as stop:
            return self._report(stop.value, [r.content for r in sound])
        raise RuntimeError(f"{self.algorithm.name}: the round has more exchanges after the last one")

    def _report(self, report: RoundReport, contents: list[RecordDict]) -> tuple[ArrayRecord | None, MetricRecord]:
        self.last_report = report
        summary = MetricRecord(dict(report.metrics))
        for key, value in self._clients_metrics(contents).items():
            if key not in summary:  # the clients' own metrics; the strategy's own definitions win
                summary[key] = value
        self.last_round_metrics = summary
        if report.state is None:
            log(WARNING, "Round %d: no sound replies, the global model is unchanged", report.server_round)
            return None, summary
        return ArrayRecord(report.state), summary

    def _results(self, rnd: Round, exchange: Exchange, replies: list[Message], *, holders: dict | None = None,
                 final: bool = False) -> tuple[ClientResults, list[Reply]]:
        """The sound replies of ``exchange`` as the method's results (``strategies.flower_api.screen``), and
        the replies; failed and rejected ones recorded in the round and in ``last_failures``."""
        ok, failed = self._check_and_log_replies(replies, is_train=True, validate=False)
        label = "" if exchange.final else f"{exchange.mode.value} "
        self.last_failures += [f"node {m.metadata.src_node_id}: {label}{m.error.reason}" for m in failed]
        if holders is None:
            rnd.fail(len(failed) + max(len(exchange.clients) - len(replies), 0))
        else:  # every client of a node without a usable reply
            answered = {m.metadata.src_node_id for m in ok}
            rnd.fail(sum(len(ps) for node, ps in holders.items() if node not in answered))
        checks = Checks(self.weighted_by_key, self.verify_examples, self.bound_keys, self.max_lr_scale,
                        self.buffer_rules, TRANSPORT_ERROR[self.transport] if self.packed else 0.0)
        out = screen(rnd, exchange, ok, self.algorithm, checks, holders)
        for r in out.rejected:
            who = f"node {r.node}" if holders is None else f"client {r.node}"
            self.last_failures.append(f"{who}: {label}rejected, {r.reason}")
            log(WARNING, "Round %d: rejected %sreply of %s: %s", rnd.server_round, label, who, r.reason)
        if final:
            reasons = {r.reason for r in out.rejected}
            if out.rejected and not out.sound and len(reasons) == 1 and not next(iter(reasons)).endswith(NON_FINITE):
                raise InconsistentMessageReplies(
                    reason=f"round {rnd.server_round}: all {len(out.rejected)} replies rejected: {next(iter(reasons))}")
            self._warn_foreign(out.sound)
        return out.results, out.sound

    def _clients_metrics(self, contents: list[RecordDict]) -> MetricRecord:
        """``train_metrics_aggr_fn`` over the sound replies (FedAvg's default: the weighted mean
        by ``weighted_by_key``); metrics the default cannot average are left out with a warning."""
        if not contents:
            return MetricRecord()
        if self.train_metrics_aggr_fn is not aggregate_metricrecords:
            return self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        try:
            return self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            log(WARNING, "The clients' own metrics could not be averaged by %r (%s): left out",
                self.weighted_by_key, exc)
            return MetricRecord()

    def _warn_foreign(self, sound: list[Reply]) -> None:
        """One warning when replies carry none of CELGC's own metrics."""
        foreign = [r.node for r in sound if r.record is not None and not any(k in r.record for k in OWN_METRICS)]
        if foreign and not self._warned_foreign:
            self._warned_foreign = True
            log(WARNING, "Replies from node(s) %s carry none of %s: those ClientApps are not running local clipped "
                "SGD (they ignore local-steps, lr and clip). Use strategies.clientapp in the ClientApp.",
                foreign, list(OWN_METRICS))


def _holders(served: dict[int, list[int]] | None, exchange: Exchange) -> dict[int, list[int]] | None:
    """The nodes serving the clients of ``exchange`` (a method may leave clients out of an exchange)."""
    if served is None:
        return None
    taking = set(exchange.clients)
    out = {node: [p for p in ps if p in taking] for node, ps in served.items() if any(p in taking for p in ps)}
    return NamedClients(out) if isinstance(served, NamedClients) else out


@functools.cache
def flower_strategy(method: type[Algorithm]) -> type[ClippedSGDStrategy]:
    """The Flower strategy class of a method, with ``ClippedSGDStrategy``'s arguments for every
    method (what the ServerApp builds; ``strategies.SCAFFOLD`` is one)."""
    return type(method.__name__, (ClippedSGDStrategy,), {
        "algorithm_class": method, "__module__": __name__,
        "__doc__": f"{method.__doc__}\n\n    {method.paper}\n\n    Arguments: as ``ClippedSGDStrategy``."})
