"""Clipped SGD, one step, pure PyTorch (no flwr): shared by clients, strategies and the engine.

One step of Liu et al. 2022 (arXiv 2205.05040), Algorithm 1::

    g   = grad F(x; xi)                      stochastic gradient (or an average of them)
    |g| = one global L2 norm over ALL parameters of the raw gradient
    d   = g + wd * x        (buf = mu * buf + d, d = buf   if mu > 0, as torch.optim.SGD)
    x  <- x - min(lr, clip / |g|) * d

A step whose gradient norm is not finite is skipped (parameters and momentum buffer
unchanged) and counted. ``clip = inf`` is plain SGD; with ``wd = mu = 0`` the step equals
``clip_grad_norm_(max_norm=clip / lr)`` followed by SGD(lr).

A client applies it to its own stochastic gradient (``strategies.core.local_update.local_update``); the
naive parallel-clipping server (``strategies.flower_api.naive_strategy``) applies it to the clients' averaged
gradient. ``clipped_sgd_step`` is functional (returns new tensors), so it also runs under
``torch.func.vmap`` on N stacked clients in the fast engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["StepConfig", "clipped_sgd_step", "grad_norm", "step_size"]


@dataclass(frozen=True)
class StepConfig:
    """Hyper-parameters of one round of local steps (already scheduled by the server)."""

    lr: float
    clip: float = math.inf
    weight_decay: float = 0.0
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not self.clip > 0:  # also rejects NaN
            raise ValueError(f"clip must be > 0, or \"off\" to disable clipping, got {self.clip}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight-decay must be >= 0, got {self.weight_decay}")
        if not (0 <= self.momentum < 1):
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


def grad_norm(grads: list[Tensor]) -> Tensor:
    """One global L2 norm over all gradient tensors (fp32 accumulation)."""
    if not grads:
        raise ValueError("grads is empty: the model has no trainable parameters")
    squares = torch.stack([g.float().square().sum() for g in grads])
    return squares.sum().sqrt()


def step_size(norm: Tensor, lr: float | Tensor, clip: float | Tensor) -> Tensor:
    """min(lr, clip / norm); 0 where the norm is not finite (the step is skipped)."""
    size = torch.clamp(clip / norm, max=lr)  # lr as a bound: no host-to-device copy per step
    return torch.where(torch.isfinite(norm), size, torch.zeros_like(size))


def clipped_sgd_step(
    params: list[Tensor],
    grads: list[Tensor],
    bufs: list[Tensor] | None,
    cfg: StepConfig,
    lr_scale: float | Tensor = 1.0,
) -> tuple[list[Tensor], list[Tensor] | None, dict[str, Tensor]]:
    """One clipped-SGD step; returns (new_params, new_bufs, stats) without mutating inputs.

    ``lr_scale`` multiplies both lr and clip (the AWD-LSTM sequence-length scaling keeps
    clip / lr fixed, as the paper's schedule does). ``bufs`` is None when momentum is 0.
    ``stats``: ``grad-norm``, ``clipped`` (1.0 if clip / |g| < lr), ``skipped`` (1.0 if
    the norm was not finite), all 0-dim tensors.
    """
    if _plain_cpu(params, grads, lr_scale):
        return _cpu_step(params, grads, bufs, cfg, float(lr_scale))
    norm = grad_norm(grads)
    lr = cfg.lr * lr_scale
    clip = cfg.clip * lr_scale
    finite = torch.isfinite(norm)
    size = step_size(norm, lr, clip)
    clipped = (finite & (clip / norm < lr)).float()
    new_params, new_bufs = [], [] if bufs is not None else None
    for i, (x, g) in enumerate(zip(params, grads, strict=True)):
        d = g if cfg.weight_decay == 0 else g + cfg.weight_decay * x
        if bufs is not None:
            d = torch.where(finite, cfg.momentum * bufs[i] + d, bufs[i])
            new_bufs.append(d)
        new_params.append(torch.where(finite, x - size.to(x.dtype) * d, x))
    stats = {"grad-norm": norm, "clipped": clipped, "skipped": (~finite).float()}
    return new_params, new_bufs, stats


def _plain_cpu(params: list[Tensor], grads: list[Tensor], lr_scale: float | Tensor) -> bool:
    """Ordinary fp32 CPU tensors (not under vmap/grad): reading the norm costs no sync."""
    tensors = (*params, *grads) + ((lr_scale,) if isinstance(lr_scale, Tensor) else ())
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and not torch._C._functorch.is_functorch_wrapped_tensor(t)
        for t in tensors
    )


def _cpu_step(
    params: list[Tensor], grads: list[Tensor], bufs: list[Tensor] | None, cfg: StepConfig, lr_scale: float
) -> tuple[list[Tensor], list[Tensor] | None, dict[str, Tensor]]:
    """The same step on the CPU with a few fused foreach kernels instead of ~4 ops a tensor.

    On the CPU a host read is free, so the skip of a non-finite step is a Python branch;
    the update is ``x + (-size) * d`` as torch.optim.SGD computes it.
    """
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    n = float(norm)
    lr, clip = cfg.lr * lr_scale, cfg.clip * lr_scale
    if not math.isfinite(n):
        stats = {"grad-norm": norm, "clipped": torch.zeros(()), "skipped": torch.ones(())}
        return list(params), (list(bufs) if bufs is not None else None), stats
    ratio = clip / n if n > 0 else math.inf
    d = grads if cfg.weight_decay == 0 else torch._foreach_add(grads, params, alpha=cfg.weight_decay)
    new_bufs = None
    if bufs is not None:
        new_bufs = list(torch._foreach_add(torch._foreach_mul(bufs, cfg.momentum), d))
        d = new_bufs
    new_params = list(torch._foreach_add(params, d, alpha=-min(lr, ratio)))
    stats = {"grad-norm": norm, "clipped": torch.tensor(float(ratio < lr)), "skipped": torch.zeros(())}
    return new_params, new_bufs, stats
