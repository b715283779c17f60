"""The local update of CELGC: clipped SGD on one client, pure PyTorch.

One local step, as in Liu et al. 2022 (arXiv 2205.05040), Algorithm 1::

    g   = grad F_i(x; xi)                    stochastic gradient
    |g| = one global L2 norm over ALL parameters of the raw gradient
    d   = g + wd * x        (buf = mu * buf + d, d = buf   if mu > 0, as torch.optim.SGD)
    x  <- x - min(lr, clip / |g|) * d

A step whose gradient norm is not finite is skipped (parameters and momentum buffer
unchanged) and counted. ``clip = inf`` is plain SGD; with ``wd = mu = 0`` the step equals
``clip_grad_norm_(max_norm=clip / lr)`` followed by SGD(lr).

``clipped_sgd_step`` is functional (returns new tensors) so the same code runs on one
client's parameters here and, under ``torch.func.vmap``, on N stacked clients in the fast
engine. ``local_update`` drives an ``nn.Module`` through I steps. Nothing here calls
``.item()``: metrics stay on the device until the caller reads them once per round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


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
            raise ValueError(f"clip must be > 0 (or inf for no clipping), got {self.clip}")
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
    size = torch.minimum(torch.as_tensor(lr, dtype=norm.dtype, device=norm.device), clip / norm)
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


@dataclass
class RoundStats:
    """Sums over one round's local steps, kept on the device until ``as_metrics``."""

    loss_sum: Tensor
    grad_norm_sum: Tensor  # over finite steps only
    clipped: Tensor
    skipped: Tensor
    steps: int = 0
    examples: int = 0

    @classmethod
    def zeros(cls, device: torch.device | str) -> RoundStats:
        z = lambda: torch.zeros((), dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(), z(), z(), z())

    def add(self, loss: Tensor, stats: dict[str, Tensor], examples: int) -> None:
        self.loss_sum += loss.detach().double()
        ok = stats["skipped"] == 0
        self.grad_norm_sum += torch.where(ok, stats["grad-norm"].double(), 0.0)
        self.clipped += stats["clipped"].double()
        self.skipped += stats["skipped"].double()
        self.steps += 1
        self.examples += examples

    def as_metrics(self) -> dict[str, float | int]:
        """Read the sums once (one host sync) into the reply's metrics."""
        loss, gsum, clipped, skipped = torch.stack(
            [self.loss_sum, self.grad_norm_sum, self.clipped, self.skipped]
        ).tolist()
        steps = max(self.steps, 1)
        finite_steps = self.steps - int(skipped)
        return {
            "train-loss": loss / steps,
            "clip-fraction": clipped / steps,
            "grad-norm": gsum / finite_steps if finite_steps else float("nan"),
            "skipped-steps": int(skipped),
            "num-steps": self.steps,
            "num-examples": self.examples,
        }


LossFn = Callable[[nn.Module, object], Tensor]


def local_update(
    model: nn.Module,
    batches: Iterable[object],
    loss_fn: LossFn,
    cfg: StepConfig,
    count: Callable[[object], int] = lambda batch: len(batch[0]),  # type: ignore[index]
) -> dict[str, float | int]:
    """Run clipped SGD on ``model`` in place over ``batches``; return the round's metrics.

    ``loss_fn(model, batch)`` returns the scalar training loss of one minibatch. The
    momentum buffer starts at zero each round (clients are stateless between rounds).
    """
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    bufs = [torch.zeros_like(p) for p in params] if cfg.momentum > 0 else None
    totals = RoundStats.zeros(device)
    for batch in batches:
        for p in params:
            p.grad = None
        loss = loss_fn(model, batch)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        with torch.no_grad():
            new_params, bufs, stats = clipped_sgd_step(params, grads, bufs, cfg)
            torch._foreach_copy_(params, new_params)
        totals.add(loss, stats, count(batch))
    for p in params:
        p.grad = None
    return totals.as_metrics()
