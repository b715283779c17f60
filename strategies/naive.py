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

from typing import Any

import torch
from flwr.app import MetricRecord, RecordDict

from .averaging import average_states
from .base import ClippedSGDStrategy
from .client_metrics import aggregate_client_metrics
from .clipped_sgd import StepConfig
from .naive_step import naive_server_step

#: ``mode`` value of the round config asking a client for its gradient, not a local update.
GRADIENT_MODE = "gradient"


class NaiveParallelClip(ClippedSGDStrategy):
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
        As for :class:`strategies.base.ClippedSGDStrategy`; there are no local steps (I = 1).
    """

    needs_global = True  # the step is taken on the global parameters sent this round

    def __init__(self, lr: float, **kwargs: Any) -> None:
        if "local_steps" in kwargs:
            raise TypeError("NaiveParallelClip takes no local_steps: every round is one step (I = 1)")
        super().__init__(lr=lr, **kwargs)
        self._momentum: dict[str, torch.Tensor] | None = None

    def _summary_lines(self) -> list[str]:
        return [f"one step a round: clients send gradients, the server clips | batch size: {self.batch_size}",
                "momentum (if any) is kept by the server"]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Server state carried across rounds (the momentum buffer), for checkpoints."""
        return {f"momentum.{k}": v for k, v in (self._momentum or {}).items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``state_dict()`` (a resumed run continues with the same momentum)."""
        momentum = {k.removeprefix("momentum."): v for k, v in state.items() if k.startswith("momentum.")}
        self._momentum = momentum or None

    def round_config(self, server_round: int, clients_per_round: int | None = None) -> dict[str, Any]:
        return {**super().round_config(server_round, clients_per_round), "mode": GRADIENT_MODE}

    def owned_keys(self) -> dict[str, str]:
        return {**super().owned_keys(), "mode": "(the strategy's class)"}

    def unpack(self, content: RecordDict) -> tuple[tuple[dict, dict] | None, str | None]:
        arrays = content.array_records
        if set(arrays) != {"grads", "buffers"}:
            return None, f"expected ArrayRecords 'grads' and 'buffers', got {sorted(arrays)}"
        try:
            grad = arrays["grads"].to_torch_state_dict()
            buf = arrays["buffers"].to_torch_state_dict()
        except Exception as exc:  # a malformed payload must not end the run
            return None, f"arrays could not be decoded ({exc})"
        if set(grad) & set(buf):
            return (grad, buf), f"keys both in grads and buffers: {sorted(set(grad) & set(buf))}"
        if not grad:
            return (grad, buf), "no gradients"
        return (grad, buf), None

    def payload_state(self, payload: tuple[dict, dict]) -> dict[str, torch.Tensor]:
        grad, buf = payload
        return {**grad, **buf}

    def check_payload(self, server_round: int, payload: tuple[dict, dict], metrics: MetricRecord) -> str | None:
        """The gradients must name exactly the trainable parameters (when known) and the
        reported ``lr-scale`` lie in (0, max_lr_scale]: it scales the server's step."""
        grad, _ = payload
        if self.bound_keys is not None and sorted(grad) != sorted(self.bound_keys):
            return f"gradients of {sorted(set(grad) ^ set(self.bound_keys))} do not match the trainable parameters"
        scale = metrics.get("lr-scale", 1.0) if metrics is not None else 1.0
        if not (0 < float(scale) <= self.max_lr_scale):
            return f"lr-scale must be in (0, {self.max_lr_scale:g}], got {scale!r}"
        return None

    def combine(self, server_round: int, payloads: list[tuple[dict, dict]], weights: list[float],
                metrics: list[MetricRecord]) -> tuple[dict[str, torch.Tensor], dict[str, float | int]]:
        """Average the gradients and buffers; take one clipped step on the global parameters."""
        grads = average_states([g for g, _ in payloads], weights)
        buffers = average_states([b for _, b in payloads], weights)
        new_state, stats = self.apply_step(server_round, grads, buffers, _mean_lr_scale(metrics))
        client_metrics = aggregate_client_metrics(metrics)
        if "grad-norm" in client_metrics:
            client_metrics["client-grad-norm"] = client_metrics.pop("grad-norm")
        return new_state, {**client_metrics, **stats}

    def apply_step(
        self, server_round: int, grad: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], lr_scale: float = 1.0
    ) -> tuple[dict[str, torch.Tensor], dict[str, float | int]]:
        """x <- x - min(lr, clip/|g|)(g + wd x) on the global parameters; buffers replaced."""
        lr, clip = self.round_hparams(server_round)
        step = StepConfig(lr=lr, clip=clip, weight_decay=self.weight_decay, momentum=self.momentum)
        params, self._momentum, stats = naive_server_step(self._global, grad, self._momentum, step, lr_scale)
        state = dict(self._global)
        state.update(params)
        state.update(buffers)
        return state, stats


def _mean_lr_scale(metrics: list[MetricRecord]) -> float:
    scales = [float(m["lr-scale"]) for m in metrics if "lr-scale" in m]
    return sum(scales) / len(scales) if scales else 1.0
