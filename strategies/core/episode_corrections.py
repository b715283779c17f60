"""EPISODE, pure PyTorch: episodic gradient clipping with periodic resampled corrections.

Crawshaw, Bao, Liu, "EPISODE: Episodic Gradient Clipping with Periodic Resampled
Corrections for Federated Learning with Heterogeneous Data" (ICLR 2023, arXiv 2302.07155),
Algorithm 1. Round r, global point x̄_r, N clients:

1. every client i draws a fresh minibatch and sends G_r^i = ∇F_i(x̄_r; ξ̃_i);
   the server averages them: G_r = (1/N) Σ_i G_r^i, and sends each client its
   correction c_i = G_r - G_r^i and the norm ‖G_r‖;
2. the round clips or not as a whole: clipping iff ‖G_r‖ ≥ γ/η (one decision for every
   client and every step of the round, from the resampled gradients; ≥ as the authors'
   code, MingruiLiu-ML-Lab/episode ``episode_final``);
3. client i runs I local steps from x̄_r with the corrected direction
   d = g + λx (heavy-ball buffer as torch.optim.SGD if μ > 0) + c_i, where g = ∇F_i(x; ξ):

       clipping round:   x ← x - (γ / ‖d‖) · d
       otherwise:        x ← x - η · d

4. the server averages the clients' parameters: x̄_{r+1}.

With N = 1, or clients whose data (hence G_r^i) are identical, c_i = 0 and a round is I
steps of SGD or normalised SGD chosen by ‖G_r‖. A step whose direction norm is not finite
is skipped and counted, as in ``clipped_sgd``. ``episode_step`` is functional (returns new
tensors) like ``clipped_sgd_step``.

The resampled minibatch ξ̃_i of round r is drawn from the client's partition exactly as the
local steps' minibatches (``tasks.sampling``: passes without replacement) but from a
separate stream, the sampling seed ``resample_seed(seed)`` (one step a round): it is
independent of the I minibatches of the local steps, and every backend draws the same one.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .clipped_sgd import StepConfig, grad_norm
from .settings import Mode

__all__ = ["CORRECTION_KEY", "EPISODE_MODE", "GLOBAL_NORM_KEY", "RESAMPLE_MODE", "clipping_round", "corrections",
           "episode_step", "resample_seed"]

#: round-config ``mode`` of the first exchange: send G_r^i, the gradient at the global point
RESAMPLE_MODE = Mode.RESAMPLE.value
#: round-config ``mode`` of the second exchange: I local EPISODE steps with the correction
EPISODE_MODE = Mode.EPISODE.value
#: the ArrayRecord of the second exchange holding the client's correction c_i
CORRECTION_KEY = "correction"
#: the round-config key of the second exchange holding ‖G_r‖
GLOBAL_NORM_KEY = "global-grad-norm"


def resample_seed(seed: int) -> int:
    """The sampling seed of the resampled minibatches: a stream apart from ``seed``'s
    (``numpy.random.SeedSequence([seed, 0xE915])``), so ξ̃ differs from the local steps' ξ."""
    return int(np.random.SeedSequence([int(seed), 0xE915]).generate_state(1, dtype=np.uint32)[0])


def corrections(client_grads: list[dict[str, Tensor]], weights: list[float] | None = None
                ) -> tuple[dict[str, Tensor], list[dict[str, Tensor]], float]:
    """(G_r, [c_i = G_r - G_r^i], ‖G_r‖) from the clients' resampled gradients.

    G_r is the uniform average (the paper) or the ``weights``-weighted one.
    """
    if not client_grads:
        raise ValueError("no resampled gradients: EPISODE needs at least one client's G_r^i")
    names = list(client_grads[0])
    if any(list(g) != names for g in client_grads):
        raise ValueError("the clients' resampled gradients name different parameters")
    w = [1.0] * len(client_grads) if weights is None else [float(x) for x in weights]
    total = sum(w)
    if not (total > 0 and all(x >= 0 and math.isfinite(x) for x in w)):
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {w}")
    mean = {k: sum(wi * g[k].double() for wi, g in zip(w, client_grads, strict=True)) / total for k in names}
    mean = {k: v.to(client_grads[0][k].dtype) for k, v in mean.items()}
    corr = [{k: mean[k] - g[k] for k in names} for g in client_grads]
    return mean, corr, float(grad_norm(list(mean.values())))


def clipping_round(global_norm: float, cfg: StepConfig, lr_scale: float = 1.0) -> bool:
    """The round's one decision: clip iff ‖G_r‖ ≥ γ/η, as the authors' code (never with γ = inf)."""
    return math.isfinite(cfg.clip) and global_norm >= (cfg.clip * lr_scale) / (cfg.lr * lr_scale)


def episode_step(
    params: list[Tensor],
    grads: list[Tensor],
    correction: list[Tensor],
    bufs: list[Tensor] | None,
    cfg: StepConfig,
    clip_round: bool,
    lr_scale: float = 1.0,
) -> tuple[list[Tensor], list[Tensor] | None, dict[str, Tensor]]:
    """One local EPISODE step; returns (new_params, new_bufs, stats) without mutating inputs.

    ``stats``: ``grad-norm`` (of the raw stochastic gradient, as the other steps report),
    ``clipped`` (1.0 in a clipping round), ``skipped`` (1.0 if the direction was not finite).
    """
    lr, clip = cfg.lr * lr_scale, cfg.clip * lr_scale
    directions, new_bufs = [], [] if bufs is not None else None
    for i, (x, g, c) in enumerate(zip(params, grads, correction, strict=True)):
        d = g if cfg.weight_decay == 0 else g + cfg.weight_decay * x
        if bufs is not None:
            d = cfg.momentum * bufs[i] + d
            new_bufs.append(d)
        directions.append(d + c)
    norm = grad_norm(directions)
    finite = bool(torch.isfinite(norm))
    stats = {"grad-norm": grad_norm(grads), "clipped": torch.tensor(float(clip_round and finite)),
             "skipped": torch.tensor(float(not finite))}
    if not finite:
        return list(params), (list(bufs) if bufs is not None else None), stats
    size = clip / float(norm) if clip_round else lr
    if clip_round and float(norm) == 0.0:
        size = 0.0
    return [x - size * d for x, d in zip(params, directions, strict=True)], new_bufs, stats
