"""CELGC: local clipped SGD with periodic parameter averaging, as a Flower strategy."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from logging import INFO, WARNING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from .averaging import AGGREGATIONS, average_states, check_state, client_weights, state_nbytes
from .schedule import global_epoch, scheduled

# Per-step means (weighted by each reply's num-steps) and per-round sums of client metrics.
STEP_MEANS = ("train-loss", "clip-fraction", "grad-norm")
SUMS = ("num-examples", "num-steps", "skipped-steps")


class CELGC(FedAvg):
    """Communication-efficient local gradient clipping (Liu et al., NeurIPS 2022).

    Paper: https://arxiv.org/abs/2205.05040. Each round every sampled client runs
    ``local_steps`` steps of x <- x - min(lr, clip/|g|) (g + weight_decay x) on its own
    data and returns its parameters; the server averages them (uniformly, as in the
    paper, or weighted by examples). ``clip = inf`` gives local SGD (FedAvg with I steps).

    The round's ``ConfigRecord`` carries ``local-steps``, ``lr``, ``clip``,
    ``weight-decay``, ``momentum``, ``batch-size`` and ``server-round`` (on a copy: the
    caller's record is never changed). ``lr`` and ``clip`` follow the paper's schedule:
    both are multiplied by ``lr_decay`` at each global epoch in ``lr_milestones``, with
    one global epoch = ``train_size`` samples processed summed over all clients.

    Replies whose arrays are non-finite or do not match the global model's keys, shapes
    and dtypes are rejected (counted in the round's ``rejected-replies``), never averaged.
    Floating-point buffers (BatchNorm statistics) are averaged; integer buffers keep
    their dtype (rounded mean).

    Parameters
    ----------
    local_steps : int
        I, local steps per round (>= 1).
    lr : float
        eta, the learning rate (> 0).
    clip : float (default: 1.0)
        gamma, the clipping threshold (> 0); ``math.inf`` disables clipping.
    batch_size : int (default: 32)
        Minibatch size of every local step.
    weight_decay, momentum : float (default: 0.0)
        lambda and mu (torch.optim.SGD semantics; the paper uses mu = 0).
    lr_decay : float (default: 0.1)
        Factor applied to lr and clip at each milestone.
    lr_milestones : sequence of float (default: ())
        Global epochs at which lr and clip decay. Needs ``train_size``.
    train_size : int, optional
        Training-set size (all clients together), to count global epochs.
    aggregation : {"uniform", "examples"} (default: "uniform")
        Uniform mean (the paper) or weighted by ``num-examples``.
    num_clients : int, optional
        Clients per round; sets ``min_train_nodes`` and ``min_available_nodes`` so that
        exactly this many train (the paper samples every client every round).
    **fedavg_kwargs
        Passed to ``FedAvg`` (``fraction_train``, ``min_train_nodes``, ...).
    """

    def __init__(
        self,
        local_steps: int,
        lr: float,
        clip: float = 1.0,
        batch_size: int = 32,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        lr_decay: float = 0.1,
        lr_milestones: Sequence[float] = (),
        train_size: int | None = None,
        aggregation: str = "uniform",
        num_clients: int | None = None,
        **fedavg_kwargs: object,
    ) -> None:
        if num_clients is not None:
            if not (isinstance(num_clients, int) and num_clients >= 1):
                raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
            fedavg_kwargs.setdefault("min_train_nodes", num_clients)
            fedavg_kwargs.setdefault("min_available_nodes", num_clients)
        super().__init__(**fedavg_kwargs)  # type: ignore[arg-type]
        checks: list[tuple[bool, str]] = [
            (isinstance(local_steps, int) and local_steps >= 1, f"local_steps must be an integer >= 1, got {local_steps!r}"),
            (math.isfinite(lr) and lr > 0, f"lr must be a finite number > 0, got {lr!r}"),
            (clip > 0, f"clip must be > 0 (math.inf disables clipping), got {clip!r}"),
            (isinstance(batch_size, int) and batch_size >= 1, f"batch_size must be an integer >= 1, got {batch_size!r}"),
            (math.isfinite(weight_decay) and weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay!r}"),
            (0 <= momentum < 1, f"momentum must be in [0, 1), got {momentum!r}"),
            (0 < lr_decay <= 1, f"lr_decay must be in (0, 1], got {lr_decay!r}"),
            (aggregation in AGGREGATIONS, f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}"),
            (not lr_milestones or train_size is not None, "lr_milestones are global epochs: pass train_size too"),
            (train_size is None or train_size >= 1, f"train_size must be >= 1, got {train_size!r}"),
            (list(lr_milestones) == sorted(lr_milestones), f"lr_milestones must be increasing, got {list(lr_milestones)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.local_steps = local_steps
        self.lr = float(lr)
        self.clip = float(clip)
        self.batch_size = batch_size
        self.weight_decay = float(weight_decay)
        self.momentum = float(momentum)
        self.lr_decay = float(lr_decay)
        self.lr_milestones = tuple(float(m) for m in lr_milestones)
        self.train_size = train_size
        self.aggregation = aggregation
        self.num_clients = num_clients
        self._global: dict[str, torch.Tensor] = {}
        self._sent: dict[int, int] = {}  # round -> number of train messages sent
        self.last_round_metrics: MetricRecord | None = None
        self.last_failures: list[str] = []

    # --- settings ---------------------------------------------------------------------
    def summary(self) -> None:
        """Log every setting."""
        log(INFO, "\t├──> %s settings:", type(self).__name__)
        log(INFO, "\t│\t├── local steps I: %d | batch size: %d", self.local_steps, self.batch_size)
        log(INFO, "\t│\t├── lr: %g | clip: %s | weight decay: %g | momentum: %g",
            self.lr, "off" if math.isinf(self.clip) else f"{self.clip:g}", self.weight_decay, self.momentum)
        log(INFO, "\t│\t├── schedule: x%g at global epochs %s (train size %s)",
            self.lr_decay, list(self.lr_milestones), self.train_size)
        log(INFO, "\t│\t├── aggregation: %s | clients per round: %s", self.aggregation, self.num_clients or "all")
        log(INFO, "\t│\t└── non-finite or mis-shaped replies are rejected")
        super().summary()

    def epoch_at(self, rounds_done: int, clients_per_round: int) -> float | None:
        """Global epochs after ``rounds_done`` rounds (None without ``train_size``)."""
        if self.train_size is None:
            return None
        return global_epoch(rounds_done, clients_per_round, self.local_steps, self.batch_size, self.train_size)

    def round_hparams(self, server_round: int, clients_per_round: int) -> tuple[float, float]:
        """(lr, clip) of a round after the schedule (epochs completed before the round)."""
        if self.train_size is None:
            return self.lr, self.clip
        return scheduled(self.lr, self.clip, server_round - 1, clients_per_round, self.local_steps, self.batch_size,
                         self.train_size, self.lr_milestones, self.lr_decay)

    def round_config(self, server_round: int, clients_per_round: int) -> dict[str, float | int]:
        lr, clip = self.round_hparams(server_round, clients_per_round)
        return {
            "local-steps": self.local_steps,
            "lr": lr,
            "clip": clip,
            "weight-decay": self.weight_decay,
            "momentum": self.momentum,
            "batch-size": self.batch_size,
        }

    # --- rounds -----------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global arrays and this round's hyper-parameters to the clients."""
        clients = self.num_clients or max(self.min_train_nodes, 1)
        own = ConfigRecord(dict(config))  # never mutate the caller's record
        for key, value in self.round_config(server_round, clients).items():
            own[key] = value
        self._global = arrays.to_torch_state_dict()
        messages = list(super().configure_train(server_round, arrays, own, grid))
        self._sent[server_round] = len(messages)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the sound replies' arrays; count rejected and failed ones."""
        replies = list(replies)
        ok, failed = self._check_and_log_replies(replies, is_train=True, validate=False)
        states, metrics, rejected = [], [], 0
        self.last_failures = [f"node {m.metadata.src_node_id}: {m.error.reason}" for m in failed]
        for msg in ok:
            state, record, reason = self._unpack(msg.content)
            if reason is not None:
                rejected += 1
                self.last_failures.append(f"node {msg.metadata.src_node_id}: rejected, {reason}")
                log(WARNING, "Round %d: rejected reply from node %d: %s", server_round, msg.metadata.src_node_id, reason)
                continue
            states.append(state)
            metrics.append(record)
        model_bytes = state_nbytes(self._global)
        summary = MetricRecord({
            "replies": len(states),
            "rejected-replies": rejected,
            "failed-replies": len(failed) + max(self._sent.get(server_round, 0) - len(replies), 0),
            "bytes-sent": model_bytes * self._sent.get(server_round, 0),
            "bytes-received": model_bytes * (len(states) + rejected),
        })
        if not states:
            log(WARNING, "Round %d: no sound replies, the global model is unchanged", server_round)
            self.last_round_metrics = summary
            return None, summary
        weights = client_weights([int(m.get("num-examples", 0)) for m in metrics], self.aggregation)
        averaged = average_states(states, weights)
        summary.update(aggregate_client_metrics(metrics))
        self.last_round_metrics = summary
        return ArrayRecord(averaged), summary

    def _unpack(self, content: RecordDict) -> tuple[dict[str, torch.Tensor], MetricRecord, str | None]:
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            return {}, MetricRecord(), "expected exactly one ArrayRecord and one MetricRecord"
        record = next(iter(content.metric_records.values()))
        missing = [k for k in ("num-examples",) if k not in record]
        if missing:
            return {}, record, f"metrics lack {missing}"
        try:
            state = next(iter(content.array_records.values())).to_torch_state_dict()
        except Exception as exc:  # a malformed payload must not end the run
            return {}, record, f"arrays could not be decoded ({exc})"
        return state, record, check_state(state, self._global)


def aggregate_client_metrics(metrics: Sequence[MetricRecord]) -> dict[str, float | int]:
    """Step-weighted means of loss, clip fraction and gradient norm; sums of counts."""
    out: dict[str, float | int] = {}
    steps = [float(m.get("num-steps", 1)) for m in metrics]
    total = sum(steps) or 1.0
    for key in STEP_MEANS:
        pairs = [(float(m[key]), s) for m, s in zip(metrics, steps) if key in m and math.isfinite(float(m[key]))]
        if pairs:
            out[key] = sum(v * s for v, s in pairs) / (sum(s for _, s in pairs) or total)
    for key in SUMS:
        if all(key in m for m in metrics):
            out[key] = int(sum(int(m[key]) for m in metrics))
    return out


