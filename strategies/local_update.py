"""The client side of CELGC, pure PyTorch (no flwr): a round's settings and I clipped steps.

``RoundSettings.from_config`` reads the step settings the strategy sends every round (an
error names every missing key). ``local_update`` runs the ONE clipped step
(``strategies.clipped_sgd.clipped_sgd_step``) over any iterable of batches -- tuples, dicts,
custom objects, a ``torch.utils.data.DataLoader`` -- and returns the round's metrics
(``strategies.client_metrics``); ``RoundStats`` keeps the sums on the device until then.
Shared by this project's ClientApp, anyone's ClientApp (``strategies.clientapp``) and the
fast engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .client_metrics import COLUMNS, client_table
from .clipped_sgd import StepConfig, clipped_sgd_step
from .episode import clipping_round, episode_step

__all__ = ["ConfigError", "LossFn", "RoundSettings", "RoundStats", "count_examples", "episode_update", "local_update",
           "split_loss"]

#: ``loss_fn(model, batch)``: the scalar training loss, or (loss, cross-entropy) when the loss
#: adds regularisers (the cross-entropy is reported apart as ``train-ce``)
LossFn = Callable[[nn.Module, Any], "Tensor | tuple[Tensor, Tensor]"]


def split_loss(out: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    """(training loss, cross-entropy or None) of what a loss function returned."""
    return out if isinstance(out, tuple) else (out, None)

#: the round-config keys a clipped-SGD client needs (CELGC and NaiveParallelClip send them all)
REQUIRED_KEYS = ("server-round", "local-steps", "batch-size", "lr", "clip", "weight-decay", "momentum")


class ConfigError(ValueError):
    """The round's config lacks or mangles the settings of local clipped SGD."""


@dataclass(frozen=True)
class RoundSettings:
    """One round's settings, as the strategy sent them (already scheduled)."""

    server_round: int
    local_steps: int
    batch_size: int
    step: StepConfig
    mode: str = "local"  # "gradient": naive parallel clipping asks for the gradient, not a local update

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RoundSettings:
        """The settings of a round's ConfigRecord; an error names every missing or bad key."""
        missing = [k for k in REQUIRED_KEYS if k not in config]
        if missing:
            raise ConfigError(
                f"the round's config lacks {', '.join(repr(k) for k in missing)}: this ClientApp runs local clipped SGD "
                "and needs the CELGC (or NaiveParallelClip) strategy of `strategies` in the ServerApp, which sends "
                f"{', '.join(REQUIRED_KEYS)} every round"
            )
        ints = {k: config[k] for k in ("server-round", "local-steps", "batch-size")}
        bad = [f"{k}={v!r}" for k, v in ints.items()
               if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k == "server-round" else 1)]
        reals = {k: config[k] for k in ("lr", "clip", "weight-decay", "momentum")}
        bad += [f"{k}={v!r}" for k, v in reals.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            raise ConfigError(f"the round's config has bad values: {', '.join(bad)} (integers for server-round, "
                              "local-steps >= 1, batch-size >= 1; numbers for lr, clip, weight-decay, momentum)")
        step = StepConfig(lr=float(reals["lr"]), clip=float(reals["clip"]), weight_decay=float(reals["weight-decay"]),
                          momentum=float(reals["momentum"]))
        return cls(server_round=int(ints["server-round"]), local_steps=int(ints["local-steps"]),
                   batch_size=int(ints["batch-size"]), step=step, mode=str(config.get("mode", "local")))


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


def local_update(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: LossFn,
    cfg: RoundSettings | StepConfig,
    count: Callable[[Any], int] | int | None = None,
) -> dict[str, float | int]:
    """Run clipped SGD on ``model`` in place; return the round's metrics for the reply.

    ``loss_fn(model, batch)`` returns the scalar training loss of one minibatch (or
    (loss, cross-entropy), see ``split_loss``). With
    ``RoundSettings`` exactly ``local_steps`` batches are used (a DataLoader is restarted
    when it runs out); with a ``StepConfig`` every batch of ``batches``. ``count``: the
    examples of a batch (a function or an int per batch); default ``count_examples``. The
    momentum buffer starts at zero each round (clients are stateless between rounds).
    """
    def step(params, grads, bufs, cfg_, scale):
        return clipped_sgd_step(params, grads, bufs, cfg_, lr_scale=scale)
    return _run_steps(model, batches, loss_fn, cfg, count, step)


def episode_update(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: LossFn,
    cfg: RoundSettings | StepConfig,
    correction: Mapping[str, Tensor],
    global_norm: float,
    count: Callable[[Any], int] | int | None = None,
) -> dict[str, float | int]:
    """EPISODE's local steps (``strategies.episode.episode_step``) on ``model`` in place.

    ``correction``: c_i = G_r - G_r^i by trainable parameter name (every one of them);
    ``global_norm``: ‖G_r‖, which decides once for the whole round whether it clips
    (``clip-fraction`` is then 1.0, else 0.0). Otherwise as ``local_update``.
    """
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    if set(correction) != set(names):
        raise ValueError(f"the correction must hold every trainable parameter: missing "
                         f"{sorted(set(names) - set(correction))}, unexpected {sorted(set(correction) - set(names))}")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    corr = [correction[k].to(device) for k in names]
    step_cfg = cfg.step if isinstance(cfg, RoundSettings) else cfg

    def step(params, grads, bufs, cfg_, scale):
        return episode_step(params, grads, corr, bufs, cfg_, clipping_round(global_norm, step_cfg, scale), scale)
    return _run_steps(model, batches, loss_fn, cfg, count, step)


def _run_steps(model: nn.Module, batches: Iterable[Any], loss_fn: LossFn, cfg: RoundSettings | StepConfig,
               count: Callable[[Any], int] | int | None, step_fn: Callable[..., Any]) -> dict[str, float | int]:
    """The loop of a round: forward, backward, ``step_fn(params, grads, bufs, step, lr_scale)``."""
    if isinstance(cfg, RoundSettings):
        step, batches = cfg.step, _exactly(batches, cfg.local_steps)
    else:
        step = cfg
    counter = (lambda _: count) if isinstance(count, int) else (count or count_examples)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    bufs = [torch.zeros_like(p) for p in params] if step.momentum > 0 else None
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
            new_params, bufs, stats = step_fn(params, grads, bufs, step, scale)
            torch._foreach_copy_(params, new_params)
        totals.add(loss, stats, counter(batch), ce)
    for p in params:
        p.grad = None
    return totals.as_metrics()
