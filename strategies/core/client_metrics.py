"""Client metrics of a round, one definition for every backend (pure PyTorch, no flwr).

Each client reports, for its round, the per-step means ``train-loss``, ``clip-fraction``,
``grad-norm`` (the mean over its finite steps) and, for tasks whose training loss adds
regularisers (the language models' AR/TAR), ``train-ce`` (the cross-entropy alone), and the counts ``num-examples``, ``num-steps``
and ``skipped-steps``. The round's value of a mean is the step-weighted mean over the sound
clients (a client's non-finite value is left out); a count is the sum. The Flower strategies
(one MetricRecord per reply) and the fast engine (a float64 table per process, all-reduced)
compute exactly this, as sum-then-finalise:

    client_table(...)  -> [n, COLUMNS] per-client values (from a round's step sums)
    metric_sums(table) -> [SUMS_WIDTH] (numerator, denominator) per mean, then the counts
    finish_metrics(sums, replies) -> {name: value}

A distributed backend adds ``metric_sums`` of its processes before ``finish_metrics``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

MEANS = ("train-loss", "clip-fraction", "grad-norm", "train-ce")
COUNTS = ("num-examples", "num-steps", "skipped-steps")
COLUMNS = MEANS + COUNTS
SUMS_WIDTH = 2 * len(MEANS) + len(COUNTS)


def client_table(loss_sum: Tensor, grad_norm_sum: Tensor, clipped: Tensor, skipped: Tensor, steps: Tensor,
                 examples: Tensor, ce_sum: Tensor | None = None) -> Tensor:
    """Per-client metrics [n, COLUMNS] (float64) from [n] sums over each client's local steps.

    ``grad_norm_sum`` sums the finite steps' norms only; a client whose steps were all
    skipped has grad-norm NaN (left out of the round's mean). ``ce_sum`` (None: the task
    reports no separate cross-entropy) gives ``train-ce``, else NaN (left out)."""
    loss, gsum, clipped, skipped = (t.double() for t in (loss_sum, grad_norm_sum, clipped, skipped))
    steps, examples = steps.double(), examples.double()
    per_step = steps.clamp(min=1.0)
    finite_steps = steps - skipped
    grad = torch.where(finite_steps > 0, gsum / finite_steps.clamp(min=1.0), torch.full_like(gsum, math.nan))
    ce = torch.full_like(loss, math.nan) if ce_sum is None else ce_sum.double() / per_step
    return torch.stack([loss / per_step, clipped / per_step, grad, ce, examples, steps, skipped], -1)


def _number(value: object) -> float:
    """A reported metric as a float; anything that is not a real number is NaN (left out)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return math.nan
    return float(value)


def table_from_records(records: Sequence[Mapping[str, object]]) -> Tensor:
    """The clients' reported metrics as a [n, COLUMNS] float64 table (NaN where absent)."""
    return torch.tensor([[_number(r.get(name, math.nan)) for name in COLUMNS] for r in records],
                        dtype=torch.float64).reshape(len(records), len(COLUMNS))


def metric_sums(table: Tensor, ok: Tensor | None = None) -> Tensor:
    """[SUMS_WIDTH] float64: per mean (sum of value x steps, sum of steps) over the sound
    clients ``ok`` with a finite value; then each count's sum (NaN if a sound client lacks it).
    A client that does not report ``num-steps`` weighs one step."""
    if ok is None:
        ok = torch.ones(table.shape[0], dtype=torch.bool, device=table.device)
    steps = table[:, COLUMNS.index("num-steps")]
    steps = torch.where(torch.isnan(steps), torch.ones_like(steps), steps)
    out = []
    for name in MEANS:
        v = table[:, COLUMNS.index(name)]
        valid = ok & torch.isfinite(v)
        out += [torch.where(valid, v * steps, 0.0).sum(), torch.where(valid, steps, 0.0).sum()]
    for name in COUNTS:
        out.append(torch.where(ok, table[:, COLUMNS.index(name)], 0.0).sum())
    return torch.stack(out)


def finish_metrics(sums: Sequence[float], replies: int) -> dict[str, float | int]:
    """The round's metrics from (all processes') ``metric_sums``: means, then counts."""
    out: dict[str, float | int] = {}
    for i, name in enumerate(MEANS):
        num, den = sums[2 * i], sums[2 * i + 1]
        if den > 0:
            out[name] = num / den
    for i, name in enumerate(COUNTS):
        value = sums[2 * len(MEANS) + i]
        if replies and math.isfinite(value):
            out[name] = int(round(value))
    return out


def row_metrics(values: Sequence[float]) -> dict[str, float | int]:
    """One client's row of the table as its reply reports it: the means (those it did not
    measure -- NaN: a gradient's clip fraction, the cross-entropy of a plain loss -- left out)
    and the counts as integers."""
    v = dict(zip(COLUMNS, values, strict=True))
    out: dict[str, float | int] = {"train-loss": v["train-loss"]}
    if not math.isnan(v["clip-fraction"]):
        out["clip-fraction"] = v["clip-fraction"]
    out["grad-norm"] = v["grad-norm"]
    for name in ("skipped-steps", "num-steps", "num-examples"):
        out[name] = int(v[name])
    if not math.isnan(v["train-ce"]):
        out["train-ce"] = v["train-ce"]
    return out


def aggregate_client_metrics(records: Sequence[Mapping[str, object]]) -> dict[str, float | int]:
    """The round's metrics of the replies' MetricRecords (what the strategies report)."""
    if not records:
        return {}
    return finish_metrics(metric_sums(table_from_records(records)).tolist(), len(records))
