"""The local update of CELGC: I clipped-SGD steps on one client's model, pure PyTorch.

The step itself (one global gradient norm, x <- x - min(lr, clip/|g|)(g + wd x), skip of
non-finite steps) is ``strategies.clipped_sgd.clipped_sgd_step``, shared with the naive
server and the fast engine; its names stay importable from here. ``local_update`` drives an
``nn.Module`` through a round's batches. Nothing here calls ``.item()`` inside the loop:
metrics stay on the device until the caller reads them once per round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# The pure step lives in strategies.clipped_sgd (the naive server applies it too); the
# names stay importable from here.
from strategies.client_metrics import COLUMNS, client_table
from strategies.clipped_sgd import StepConfig, clipped_sgd_step, grad_norm, step_size

__all__ = ["LossFn", "RoundStats", "split_loss", "StepConfig", "clipped_sgd_step", "grad_norm", "local_update", "step_size"]


@dataclass
class RoundStats:
    """Sums over one round's local steps, kept on the device until ``as_metrics``."""

    loss_sum: Tensor
    grad_norm_sum: Tensor  # over finite steps only
    clipped: Tensor
    skipped: Tensor
    steps: int = 0
    examples: int = 0
    ce_sum: Tensor | None = None  # cross-entropy alone, when the loss adds regularisers (train-ce)

    @classmethod
    def zeros(cls, device: torch.device | str) -> RoundStats:
        z = lambda: torch.zeros((), dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(), z(), z(), z())

    def add(self, loss: Tensor, stats: dict[str, Tensor], examples: int, ce: Tensor | None = None) -> None:
        self.loss_sum += loss.detach().double()
        if ce is not None:
            self.ce_sum = ce.detach().double() if self.ce_sum is None else self.ce_sum + ce.detach().double()
        ok = stats["skipped"] == 0
        self.grad_norm_sum += torch.where(ok, stats["grad-norm"].double(), 0.0)
        self.clipped += stats["clipped"].double()
        self.skipped += stats["skipped"].double()
        self.steps += 1
        self.examples += examples

    def table(self) -> Tensor:
        """Per-client metrics [n, COLUMNS] (``strategies.client_metrics.client_table``); the
        sums are scalars (one client) or [n] tensors (clients stepped together)."""
        loss = torch.atleast_1d(self.loss_sum)
        full = lambda v: torch.full_like(loss, float(v), dtype=torch.float64)  # noqa: E731
        return client_table(loss, torch.atleast_1d(self.grad_norm_sum), torch.atleast_1d(self.clipped),
                            torch.atleast_1d(self.skipped), full(self.steps), full(self.examples),
                            None if self.ce_sum is None else torch.atleast_1d(self.ce_sum))

    def as_metrics(self) -> dict[str, float | int]:
        """Read the sums once (one host sync) into the reply's metrics."""
        values = dict(zip(COLUMNS, self.table()[0].tolist(), strict=True))
        out: dict[str, float | int] = {
            "train-loss": values["train-loss"],
            "clip-fraction": values["clip-fraction"],
            "grad-norm": values["grad-norm"],
            "skipped-steps": int(values["skipped-steps"]),
            "num-steps": self.steps,
            "num-examples": self.examples,
        }
        if self.ce_sum is not None:
            out["train-ce"] = values["train-ce"]
        return out


LossFn = Callable[[nn.Module, object], "Tensor | tuple[Tensor, Tensor]"]


def split_loss(out: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    """(training loss, cross-entropy or None): a loss function returns the loss, or (loss, ce)
    when its loss adds regularisers (``tasks.protocol.training_loss``)."""
    return out if isinstance(out, tuple) else (out, None)


def local_update(
    model: nn.Module,
    batches: Iterable[object],
    loss_fn: LossFn,
    cfg: StepConfig,
    count: Callable[[object], int] = lambda batch: len(batch[0]),  # type: ignore[index]
) -> dict[str, float | int]:
    """Run clipped SGD on ``model`` in place over ``batches``; return the round's metrics.

    ``loss_fn(model, batch)`` returns the scalar training loss of one minibatch, or
    (loss, cross-entropy) (``split_loss``). The momentum buffer starts at zero each round.
    """
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    bufs = [torch.zeros_like(p) for p in params] if cfg.momentum > 0 else None
    totals = RoundStats.zeros(device)
    for batch in batches:
        for p in params:
            p.grad = None
        loss, ce = split_loss(loss_fn(model, batch))
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        with torch.no_grad():
            # a batch may carry its own step scale (AWD-LSTM: seq_len / bptt; scales lr and clip)
            scale = getattr(batch, "lr_scale", 1.0)
            new_params, bufs, stats = clipped_sgd_step(params, grads, bufs, cfg, lr_scale=scale)
            torch._foreach_copy_(params, new_params)
        totals.add(loss, stats, count(batch), ce)
    for p in params:
        p.grad = None
    return totals.as_metrics()
