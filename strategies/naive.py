"""Naive parallel clipping: the paper's baseline, one clipped step per communication.

Clipped SGD of Zhang et al. (2020) run data-parallel on N workers, as in Liu et al.
(NeurIPS 2022, https://arxiv.org/abs/2205.05040), section 5: every round each client
computes its stochastic gradient g_i at the shared point x on ONE minibatch; the server
averages them into g_bar and takes one step

    x <- x - min(lr, clip / |g_bar|) (g_bar + weight_decay x)

with the same pure step as the clients of CELGC (``strategies.clipped_sgd``). With N
clients of batch b this equals single-machine clipped SGD at batch N b on the union of the
same samples (for a mean-reduced loss and a model without batch statistics).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import INFO, WARNING

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from .averaging import average_states, check_state, client_weights, state_nbytes
from .celgc import CELGC, aggregate_client_metrics
from .clipped_sgd import StepConfig, clipped_sgd_step

#: ``mode`` value of the round config asking a client for its gradient, not a local update.
GRADIENT_MODE = "gradient"


class NaiveParallelClip(CELGC):
    """Naive parallel gradient clipping (the baseline of Liu et al., NeurIPS 2022).

    Paper: https://arxiv.org/abs/2205.05040. Each round is ONE step: the round config
    carries ``mode = "gradient"`` and ``local-steps = 1``; every client answers with
    ``grads`` (an ArrayRecord of the loss gradient w.r.t. each trainable parameter at the
    received point, on one minibatch of ``batch-size``), ``buffers`` (its floating and
    integer buffers after that forward pass, e.g. BatchNorm statistics) and ``metrics``.
    The server averages gradients and buffers (uniformly, or weighted by examples) and
    applies the clipped step to the global parameters. With ``momentum > 0`` the server
    keeps the heavy-ball buffer across rounds (the paper uses 0).

    Language-model clients may report ``lr-scale`` (the AWD-LSTM ``seq_len / bptt``); the
    step uses the mean over the replies (all clients draw the same length each round).

    Bytes: ``bytes-sent`` = the model once per sampled client (parameters and buffers
    down), ``bytes-received`` = what the replies carried (gradients and buffers up).
    Round metrics: ``train-loss`` (clients' mean loss at the shared point), ``grad-norm``
    (|g_bar|, the norm the clip acts on), ``clip-fraction`` (1.0 if this step was
    clipped), ``skipped-steps`` (1 if |g_bar| was not finite), ``client-grad-norm``.

    Parameters
    ----------
    lr, clip, batch_size, weight_decay, momentum, lr_decay, lr_milestones, train_size,
    aggregation, num_clients, **fedavg_kwargs
        As for :class:`strategies.celgc.CELGC`; there are no local steps (I = 1).
    """

    def __init__(self, lr: float, clip: float = 1.0, batch_size: int = 32, **kwargs: object) -> None:
        if "local_steps" in kwargs:
            raise ValueError("NaiveParallelClip takes no local_steps: every round is one step")
        super().__init__(local_steps=1, lr=lr, clip=clip, batch_size=batch_size, **kwargs)  # type: ignore[arg-type]
        self._momentum: dict[str, torch.Tensor] | None = None

    def summary(self) -> None:
        """Log every setting."""
        log(INFO, "\t├──> %s settings:", type(self).__name__)
        log(INFO, "\t│\t├── one step a round: clients send gradients, the server clips | batch size: %d",
            self.batch_size)
        log(INFO, "\t│\t├── lr: %g | clip: %s | weight decay: %g | momentum: %g (server side)",
            self.lr, "off" if math.isinf(self.clip) else f"{self.clip:g}", self.weight_decay, self.momentum)
        log(INFO, "\t│\t├── schedule: x%g at global epochs %s (train size %s)",
            self.lr_decay, list(self.lr_milestones), self.train_size)
        log(INFO, "\t│\t├── gradient averaging: %s | clients per round: %s", self.aggregation,
            self.num_clients or "all")
        log(INFO, "\t│\t└── non-finite or mis-shaped replies are rejected")
        FedAvg.summary(self)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Server state carried across rounds (the momentum buffer), for checkpoints."""
        return {f"momentum.{k}": v for k, v in (self._momentum or {}).items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``state_dict()`` (a resumed run continues with the same momentum)."""
        momentum = {k.removeprefix("momentum."): v for k, v in state.items() if k.startswith("momentum.")}
        self._momentum = momentum or None

    def round_config(self, server_round: int, clients_per_round: int) -> dict[str, float | int | str]:
        return {**super().round_config(server_round, clients_per_round), "mode": GRADIENT_MODE}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the sound replies' gradients and buffers; take one clipped step."""
        replies = list(replies)
        ok, failed = self._check_and_log_replies(replies, is_train=True, validate=False)
        self.last_failures = [f"node {m.metadata.src_node_id}: {m.error.reason}" for m in failed]
        grads, buffers, metrics, rejected, received = [], [], [], 0, 0
        for msg in ok:
            grad, buf, record, reason = self._unpack_gradient(msg.content)
            received += state_nbytes(grad) + state_nbytes(buf)
            if reason is not None:
                rejected += 1
                self.last_failures.append(f"node {msg.metadata.src_node_id}: rejected, {reason}")
                log(WARNING, "Round %d: rejected reply from node %d: %s",
                    server_round, msg.metadata.src_node_id, reason)
                continue
            grads.append(grad)
            buffers.append(buf)
            metrics.append(record)
        sent = self._sent.get(server_round, 0)
        summary = MetricRecord({
            "replies": len(grads),
            "rejected-replies": rejected,
            "failed-replies": len(failed) + max(sent - len(replies), 0),
            "bytes-sent": state_nbytes(self._global) * sent,
            "bytes-received": received,
        })
        if not grads:
            log(WARNING, "Round %d: no sound replies, the global model is unchanged", server_round)
            self.last_round_metrics = summary
            return None, summary
        weights = client_weights([int(m.get("num-examples", 0)) for m in metrics], self.aggregation)
        new_state, stats = self.apply_step(server_round, average_states(grads, weights),
                                           average_states(buffers, weights), _mean_lr_scale(metrics))
        client_metrics = aggregate_client_metrics(metrics)
        if "grad-norm" in client_metrics:
            client_metrics["client-grad-norm"] = client_metrics.pop("grad-norm")
        summary.update(client_metrics)
        summary.update(stats)
        self.last_round_metrics = summary
        return ArrayRecord(new_state), summary

    def apply_step(
        self, server_round: int, grad: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], lr_scale: float = 1.0
    ) -> tuple[dict[str, torch.Tensor], dict[str, float | int]]:
        """x <- x - min(lr, clip/|g|)(g + wd x) on the global parameters; buffers replaced."""
        lr, clip = self.round_hparams(server_round, self.num_clients or max(self.min_train_nodes, 1))
        keys = list(grad)
        params = [self._global[k] for k in keys]
        grads = [grad[k].to(self._global[k].dtype) for k in keys]
        bufs = None
        if self.momentum > 0:
            if self._momentum is None or list(self._momentum) != keys:
                self._momentum = {k: torch.zeros_like(p) for k, p in zip(keys, params, strict=True)}
            bufs = [self._momentum[k] for k in keys]
        step = StepConfig(lr=lr, clip=clip, weight_decay=self.weight_decay, momentum=self.momentum)
        with torch.no_grad():
            new_params, new_bufs, stats = clipped_sgd_step(params, grads, bufs, step, lr_scale=lr_scale)
        if new_bufs is not None:
            self._momentum = dict(zip(keys, new_bufs, strict=True))
        state = dict(self._global)
        state.update(zip(keys, new_params, strict=True))
        state.update(buffers)
        norm, clipped, skipped = torch.stack([stats["grad-norm"], stats["clipped"], stats["skipped"]]).tolist()
        out: dict[str, float | int] = {"clip-fraction": clipped, "skipped-steps": int(skipped)}
        if math.isfinite(norm):
            out["grad-norm"] = norm
        return state, out

    def _unpack_gradient(
        self, content: RecordDict
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], MetricRecord, str | None]:
        arrays, records = content.array_records, content.metric_records
        record = next(iter(records.values()), MetricRecord())
        if set(arrays) != {"grads", "buffers"} or len(records) != 1:
            return {}, {}, record, "expected ArrayRecords 'grads' and 'buffers' and one MetricRecord"
        if "num-examples" not in record:
            return {}, {}, record, "metrics lack ['num-examples']"
        try:
            grad = arrays["grads"].to_torch_state_dict()
            buf = arrays["buffers"].to_torch_state_dict()
        except Exception as exc:  # a malformed payload must not end the run
            return {}, {}, record, f"arrays could not be decoded ({exc})"
        if set(grad) & set(buf):
            return grad, buf, record, f"keys both in grads and buffers: {sorted(set(grad) & set(buf))}"
        if not grad:
            return grad, buf, record, "no gradients"
        return grad, buf, record, check_state({**grad, **buf}, self._global)


def _mean_lr_scale(metrics: list[MetricRecord]) -> float:
    scales = [float(m["lr-scale"]) for m in metrics if "lr-scale" in m]
    return sum(scales) / len(scales) if scales else 1.0
