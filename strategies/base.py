"""What CELGC and naive parallel clipping share as Flower strategies: the clipped-SGD
settings, the paper's schedule, the round config, and reply handling.

``ClippedSGDStrategy`` is a ``FedAvg`` that sends every sampled client the global arrays and
the round's step settings, decodes and checks every reply (a bad one is rejected and counted,
never averaged and never a crash), and hands the sound payloads to ``combine`` -- averaging
parameters (CELGC) or taking one clipped step on averaged gradients (naive). Subclasses add
their own knobs; none inherits a knob it must forbid.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from .averaging import AGGREGATIONS, client_weights, state_nbytes
from .schedule import global_epoch, scheduled


class ClippedSGDStrategy(FedAvg):
    """Base of the clipped-SGD strategies: settings, schedule, round config, reply handling.

    Parameters
    ----------
    lr : float
        eta, the learning rate (> 0).
    clip : float (default: 1.0)
        gamma, the clipping threshold (> 0); ``math.inf`` disables clipping.
    batch_size : int (default: 32)
        Minibatch size of every step.
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
        Clients per round; sets ``min_train_nodes`` and ``min_available_nodes``.
    **fedavg_kwargs
        Passed to ``FedAvg`` (``fraction_train``, ``min_train_nodes``, ...).
    """

    #: local steps per round (CELGC: its ``local_steps``; naive parallel clipping: 1)
    local_steps: int = 1

    def __init__(
        self,
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
        **fedavg_kwargs: Any,
    ) -> None:
        if num_clients is not None:
            if not (isinstance(num_clients, int) and num_clients >= 1):
                raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
            fedavg_kwargs.setdefault("min_train_nodes", num_clients)
            fedavg_kwargs.setdefault("min_available_nodes", num_clients)
        super().__init__(**fedavg_kwargs)
        checks: list[tuple[bool, str]] = [
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
    def _summary_lines(self) -> list[str]:
        """The algorithm's own first line(s) of ``summary()``."""
        return []

    def summary(self) -> None:
        """Log every setting."""
        log(INFO, "\t├──> %s settings:", type(self).__name__)
        for line in self._summary_lines():
            log(INFO, "\t│\t├── %s", line)
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

    def clients_per_round(self) -> int:
        return self.num_clients or max(self.min_train_nodes, 1)

    def round_config(self, server_round: int, clients_per_round: int) -> dict[str, Any]:
        """The step settings every client receives in ``server_round``."""
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
        """Send the global arrays and this round's settings to the clients."""
        own = ConfigRecord(dict(config))  # never mutate the caller's record
        for key, value in self.round_config(server_round, self.clients_per_round()).items():
            own[key] = value
        self._global = arrays.to_torch_state_dict()
        messages = list(super().configure_train(server_round, arrays, own, grid))
        self._sent[server_round] = len(messages)
        return messages

    def unpack(self, content: RecordDict) -> tuple[Any, MetricRecord, str | None]:
        """(payload, metrics, reason to reject or None) of one reply's content."""
        raise NotImplementedError

    def payload_bytes(self, payload: Any) -> int:
        """Bytes one reply carried (for ``bytes-received``)."""
        raise NotImplementedError

    def combine(self, server_round: int, payloads: list[Any], weights: list[float],
                metrics: list[MetricRecord]) -> tuple[dict[str, torch.Tensor], dict[str, float | int]]:
        """The new global state and the round's metrics from the sound replies."""
        raise NotImplementedError

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check every reply, then ``combine`` the sound ones; count rejected and failed ones."""
        replies = list(replies)
        ok, failed = self._check_and_log_replies(replies, is_train=True, validate=False)
        self.last_failures = [f"node {m.metadata.src_node_id}: {m.error.reason}" for m in failed]
        payloads, metrics, rejected, received = [], [], 0, 0
        for msg in ok:
            payload, record, reason = self.unpack(msg.content)
            received += self.payload_bytes(payload)
            if reason is not None:
                rejected += 1
                self.last_failures.append(f"node {msg.metadata.src_node_id}: rejected, {reason}")
                log(WARNING, "Round %d: rejected reply from node %d: %s", server_round, msg.metadata.src_node_id, reason)
                continue
            payloads.append(payload)
            metrics.append(record)
        sent = self._sent.get(server_round, 0)
        summary = MetricRecord({
            "replies": len(payloads),
            "rejected-replies": rejected,
            "failed-replies": len(failed) + max(sent - len(replies), 0),
            "bytes-sent": state_nbytes(self._global) * sent,
            "bytes-received": received,
        })
        if not payloads:
            log(WARNING, "Round %d: no sound replies, the global model is unchanged", server_round)
            self.last_round_metrics = summary
            return None, summary
        weights = client_weights([int(m.get("num-examples", 0)) for m in metrics], self.aggregation)
        state, round_metrics = self.combine(server_round, payloads, weights, metrics)
        summary.update(round_metrics)
        self.last_round_metrics = summary
        return ArrayRecord(state), summary
