"""CELGC as a Flower strategy: local clipped SGD with periodic parameter averaging."""

from __future__ import annotations

from typing import Any

from ..methods.celgc import CELGC as CELGCMethod
from .strategy import ClippedSGDStrategy


class CELGC(ClippedSGDStrategy):
    """Communication-efficient local gradient clipping (Liu et al., NeurIPS 2022).

    Paper: https://arxiv.org/abs/2205.05040. Each round every sampled client runs
    ``local_steps`` steps of x <- x - min(lr, clip/|g|) (g + weight_decay x) on its own
    data and returns its parameters; the server averages them (uniformly, as in the
    paper, or weighted by examples). ``clip = inf`` gives local SGD (FedAvg with I steps).
    The method itself is ``strategies.methods.celgc``, which every backend runs.

    The round's ``ConfigRecord`` carries ``local-steps``, ``lr``, ``clip``,
    ``weight-decay``, ``momentum``, ``batch-size``, ``mode`` and ``server-round`` (on a copy:
    the caller's record is never changed). ``lr`` and ``clip`` follow the paper's schedule:
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
    aggregation, trim_fraction, num_clients, **fedavg_kwargs
        As for :class:`strategies.flower_api.strategy.ClippedSGDStrategy`.
    """

    algorithm_class = CELGCMethod

    def __init__(self, local_steps: int, lr: float, **kwargs: Any) -> None:
        super().__init__(lr=lr, local_steps=local_steps, **kwargs)
