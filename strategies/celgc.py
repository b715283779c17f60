"""CELGC: local clipped SGD with periodic parameter averaging, as a Flower strategy."""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import MetricRecord, RecordDict

from .averaging import average_states
from .base import ClippedSGDStrategy
from .bound import check_displacement
from .client_metrics import aggregate_client_metrics


class CELGC(ClippedSGDStrategy):
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
    and dtypes are rejected (counted in the round's ``rejected-replies``), never averaged;
    without a prior ``configure_train`` the replies are checked against the layout most of
    them share. A reply is one ArrayRecord (any key) and one MetricRecord holding
    ``weighted_by_key`` (default ``num-examples``, any real number >= 0).
    Floating-point buffers (BatchNorm statistics) are averaged; integer buffers keep
    their dtype (rounded mean).

    Parameters
    ----------
    local_steps : int
        I, local steps per round (>= 1).
    lr, clip, batch_size, weight_decay, momentum, lr_decay, lr_milestones, train_size,
    aggregation, num_clients, **fedavg_kwargs
        As for :class:`strategies.base.ClippedSGDStrategy`.
    """

    def __init__(self, local_steps: int, lr: float, **kwargs: Any) -> None:
        if not (isinstance(local_steps, int) and not isinstance(local_steps, bool) and local_steps >= 1):
            raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}")
        super().__init__(lr=lr, **kwargs)
        self.local_steps = local_steps

    def _summary_lines(self) -> list[str]:
        return [f"local steps I: {self.local_steps} | batch size: {self.batch_size}"]

    def unpack(self, content: RecordDict) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        if len(content.array_records) != 1:
            return None, f"expected exactly one ArrayRecord, got {len(content.array_records)}"
        try:
            return next(iter(content.array_records.values())).to_torch_state_dict(), None
        except Exception as exc:  # a malformed payload must not end the run
            return None, f"arrays could not be decoded ({exc})"

    def payload_state(self, payload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return payload

    def check_payload(self, server_round: int, payload: dict[str, torch.Tensor], metrics: MetricRecord) -> str | None:
        """The clipping bound: I clipped steps move the trainable parameters at most
        ``max_displacement`` (I * clip with lr scale 1, no weight decay)."""
        if self.bound_keys is None:
            return None
        lr, clip = self.round_hparams(server_round)
        return check_displacement(payload, self._global, self.bound_keys, local_steps=self.local_steps, lr=lr,
                                  clip=clip, weight_decay=self.weight_decay, momentum=self.momentum,
                                  max_lr_scale=self.max_lr_scale)

    def combine(self, server_round: int, payloads: list[dict[str, torch.Tensor]], weights: list[float],
                metrics: list[MetricRecord]) -> tuple[dict[str, torch.Tensor], dict[str, float | int]]:
        return average_states(payloads, weights), aggregate_client_metrics(metrics)
