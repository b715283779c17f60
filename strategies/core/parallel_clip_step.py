"""The server step of naive parallel clipping, one pure function for every backend (no flwr).

Given the shared parameters x and the clients' averaged gradient g_bar, one clipped step

    x <- x - min(lr, clip / |g_bar|) (g_bar + weight_decay x)      (+ heavy-ball momentum)

with the clients' own step (``strategies.core.clipped_sgd.clipped_sgd_step``). Used by
``strategies.flower_api.naive_strategy.NaiveParallelClip`` (Flower) and the fast engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from .clipped_sgd import StepConfig, clipped_sgd_step


def naive_server_step(
    params: Mapping[str, Tensor], grad: Mapping[str, Tensor], momentum: Mapping[str, Tensor] | None,
    step: StepConfig, lr_scale: float = 1.0,
) -> tuple[dict[str, Tensor], dict[str, Tensor] | None, dict[str, float | int]]:
    """One clipped step on the parameters named by ``grad``.

    Returns (the updated parameters named by ``grad``, the new momentum buffers -- None
    when ``step.momentum == 0`` -- and the step's metrics ``clip-fraction`` (1.0 if
    clipped), ``skipped-steps`` (1 if |g_bar| was not finite) and ``grad-norm`` when finite).
    A momentum mapping whose keys differ from ``grad``'s starts again from zeros.
    """
    keys = list(grad)
    values = [params[k] for k in keys]
    grads = [grad[k].to(params[k].dtype) for k in keys]
    bufs = None
    if step.momentum > 0:
        if momentum is None or list(momentum) != keys:
            momentum = {k: torch.zeros_like(p) for k, p in zip(keys, values, strict=True)}
        bufs = [momentum[k] for k in keys]
    with torch.no_grad():
        new_values, new_bufs, stats = clipped_sgd_step(values, grads, bufs, step, lr_scale=lr_scale)
    norm, clipped, skipped = torch.stack([stats["grad-norm"], stats["clipped"], stats["skipped"]]).tolist()
    metrics: dict[str, float | int] = {"clip-fraction": clipped, "skipped-steps": int(skipped)}
    if math.isfinite(norm):
        metrics["grad-norm"] = norm
    new_momentum = dict(zip(keys, new_bufs, strict=True)) if new_bufs is not None else None
    return dict(zip(keys, new_values, strict=True)), new_momentum, metrics
