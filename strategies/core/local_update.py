"""The client's local work, pure PyTorch (no flwr): one step, the round's steps, one gradient.

A local step is forward, backward and a step RULE on the trainable parameters; the rule is
the method's (``clipped_rule``: CELGC's x <- x - min(lr, clip/|g|)(g + wd x); EPISODE's and
SCAFFOLD's corrected steps are rules of their own, ``strategies.methods``). ``take_step``
is that one step, for every caller: ``local_update`` (any ClientApp: any iterable of batches,
tuples, dicts, custom objects, a ``torch.utils.data.DataLoader``) and the executors of
``strategies.methods.executors`` (the engine's clients, this project's ClientApp). ``RoundStats``
keeps the round's sums on the device until the reply's metrics are read once
(``strategies.core.client_metrics``). ``gradient_at`` is the other client primitive: the gradient
of one minibatch at the model's point (naive parallel clipping, EPISODE's resample).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .client_metrics import client_table, row_metrics
from .clipped_sgd import StepConfig, clipped_sgd_step
from .settings import ConfigError, RoundSettings

__all__ = ["ConfigError", "LossFn", "RoundSettings", "RoundStats", "Rule", "clipped_rule", "count_examples", "default_count",
           "gradient_at", "local_update", "split_loss", "take_step"]

#: ``loss_fn(model, batch)``: the scalar training loss, or (loss, cross-entropy) when the loss
#: adds regularisers (the cross-entropy is reported apart as ``train-ce``)
LossFn = Callable[[nn.Module, Any], "Tensor | tuple[Tensor, Tensor]"]

#: ``fn(params, grads, bufs, cfg, lr_scale, extra) -> (new params, new bufs, stats)``, functional
StepFn = Callable[..., tuple[list[Tensor], "list[Tensor] | None", dict[str, Tensor]]]


@dataclass(frozen=True)
class Rule:
    """A local step rule: ``fn`` (functional, returns new tensors) and what it supports.

    ``extra``: the per-client tensors the rule reads (one per trainable parameter, e.g. a
    correction), or none. ``vmappable``: it runs under ``torch.func.vmap`` (no host reads).
    ``tensor_scale``: it accepts the batch's lr scale as a device tensor (no copy a step)."""

    fn: StepFn
    vmappable: bool = True
    tensor_scale: bool = True

    def __call__(self, params: list[Tensor], grads: list[Tensor], bufs: list[Tensor] | None, cfg: StepConfig,
                 lr_scale: float | Tensor = 1.0, extra: list[Tensor] | None = None):
        return self.fn(params, grads, bufs, cfg, lr_scale, extra)


def _clipped(params, grads, bufs, cfg, lr_scale, extra):
    return clipped_sgd_step(params, grads, bufs, cfg, lr_scale=lr_scale)


#: CELGC's local step: clipped SGD (``strategies.core.clipped_sgd``)
clipped_rule = Rule(_clipped)


def split_loss(out: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    """(training loss, cross-entropy or None) of what a loss function returned."""
    return out if isinstance(out, tuple) else (out, None)


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
        """Per-client metrics [n, COLUMNS] (``strategies.core.client_metrics.client_table``); the
        sums are scalars (one client) or [n] tensors (clients stepped together)."""
        loss = torch.atleast_1d(self.loss_sum)
        full = lambda v: torch.full_like(loss, float(v), dtype=torch.float64)  # noqa: E731
        return client_table(loss, torch.atleast_1d(self.grad_norm_sum), torch.atleast_1d(self.clipped),
                            torch.atleast_1d(self.skipped), full(self.steps), full(self.examples),
                            None if self.ce_sum is None else torch.atleast_1d(self.ce_sum))

    def as_metrics(self) -> dict[str, float | int]:
        """Read the sums once (one host sync) into the reply's metrics."""
        return row_metrics(self.table()[0].tolist())


def default_count(batch: Any) -> int:
    """Examples in an (inputs, labels) batch (the tasks' default)."""
    return len(batch[0])


def count_examples(batch: Any) -> int:
    """Examples in a batch: the leading size of a tensor, of a tuple/list's first element, or
    of a dict's first tensor value; anything else is an error asking for ``count``."""
    if isinstance(batch, Mapping):
        first = next((v for v in batch.values() if _sized(v)), None)
    elif isinstance(batch, (tuple, list)):
        first = batch[0] if batch and _sized(batch[0]) else None
    else:
        first = batch if hasattr(batch, "shape") else None
    if first is None:
        raise TypeError(
            f"cannot tell how many examples a batch of type {type(batch).__name__} holds: pass count= to local_update "
            "(a function batch -> int, or an int)"
        )
    return int(first.shape[0]) if hasattr(first, "shape") else len(first)


def _sized(value: object) -> bool:
    return (hasattr(value, "shape") and len(value.shape) > 0) or isinstance(value, (list, tuple))


def _exactly(batches: Iterable[Any], steps: int) -> Iterator[Any]:
    """``steps`` batches: a re-iterable (a DataLoader) is started again when it runs out."""
    once = isinstance(batches, Iterator)  # a generator or iterator cannot be restarted
    taken = 0
    while taken < steps:
        before = taken
        for batch in itertools.islice(iter(batches), steps - taken):
            taken += 1
            yield batch
        if taken < steps and (taken == before or once):
            raise ValueError(f"the batches ran out after {taken} of local-steps={steps}: pass a DataLoader "
                             "(restarted as needed) or an iterable of at least local-steps batches")


def take_step(model: nn.Module, params: list[Tensor], bufs: list[Tensor] | None, batch: Any, loss_fn: LossFn,
              rule: Rule, cfg: StepConfig, totals: RoundStats, examples: int, extra: list[Tensor] | None = None,
              one: Tensor | None = None) -> list[Tensor] | None:
    """One local step in place: forward, backward, ``rule`` on ``params``; adds to ``totals``;
    returns the new momentum buffers. ``one``: a device scalar 1 (CUDA) that turns the batch's
    lr scale into a device tensor for rules that take one (no host-to-device copy a step)."""
    for p in params:
        p.grad = None
    loss, ce = split_loss(loss_fn(model, batch))
    loss.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    with torch.no_grad():
        # a batch may carry its own step scale (AWD-LSTM: seq_len / bptt; scales lr and clip)
        scale = getattr(batch, "lr_scale", 1.0)
        if one is not None and rule.tensor_scale:
            scale = one * scale
        elif not rule.tensor_scale:
            scale = float(scale)
        new_params, bufs, stats = rule(params, grads, bufs, cfg, scale, extra)
        torch._foreach_copy_(params, new_params)
    totals.add(loss, stats, examples, ce)
    return bufs


def trainable(model: nn.Module) -> list[Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def local_update(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: LossFn,
    cfg: RoundSettings | StepConfig,
    count: Callable[[Any], int] | int | None = None,
    rule: Rule = clipped_rule,
) -> dict[str, float | int]:
    """Run clipped SGD on ``model`` in place; return the round's metrics for the reply.

    ``loss_fn(model, batch)`` returns the scalar training loss of one minibatch (or
    (loss, cross-entropy), see ``split_loss``). With ``RoundSettings`` exactly
    ``local_steps`` batches are used (a DataLoader is restarted when it runs out); with a
    ``StepConfig`` every batch of ``batches``. ``count``: the examples of a batch (a function
    or an int per batch); default ``count_examples``. The momentum buffer starts at zero each
    round (clients are stateless between rounds).
    """
    if isinstance(cfg, RoundSettings):
        step, batches = cfg.step, _exactly(batches, cfg.local_steps)
    else:
        step = cfg
    counter = (lambda _: count) if isinstance(count, int) else (count or count_examples)
    model.train()
    params = trainable(model)
    device = params[0].device if params else torch.device("cpu")
    bufs = [torch.zeros_like(p) for p in params] if step.momentum > 0 else None
    totals = RoundStats.zeros(device)
    for batch in batches:
        bufs = take_step(model, params, bufs, batch, loss_fn, rule, step, totals, counter(batch))
    for p in params:
        p.grad = None
    return totals.as_metrics()


def gradient_at(model: nn.Module, batch: Any, loss_fn: LossFn) -> tuple[dict[str, Tensor], Tensor, Tensor | None]:
    """(gradient of every trainable parameter by name -- zeros where unused --, loss, cross-entropy
    or None) of one minibatch at the model's point, in training mode; nothing is applied (the
    model's buffers keep what the forward pass wrote, e.g. BatchNorm statistics)."""
    model.train()
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    for _, p in named:
        p.grad = None
    loss, ce = split_loss(loss_fn(model, batch))
    loss.backward()
    grads = {k: p.grad.detach() if p.grad is not None else torch.zeros_like(p) for k, p in named}
    for _, p in named:
        p.grad = None  # the gradient now lives in ``grads`` only (no copy)
    return grads, loss.detach(), None if ce is None else ce.detach()
