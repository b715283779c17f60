"""What an honest client can do to the model's buffers in one exchange (pure, no flwr).

Buffers are replies too: the bound on the displacement covers the trainable parameters only,
so a client that sends BatchNorm ``running_var = 1e30`` (or -50, or ``num_batches_tracked =
2**63 - 1``) passes it. A training-mode forward of a BatchNorm layer with momentum m updates

    r <- (1 - a) r + a mean_B,   v <- (1 - a) v + a var_B (unbiased, >= 0),   n <- n + 1

with a = m, or a = 1 / n (the incremented count) where ``momentum=None`` (cumulative average).
After the F forwards of an exchange (its local steps; 1 for a gradient), from the global
(r_0, v_0, n_0):

* n_F = n_0 + F exactly (an integer the server knows);
* v_F >= c v_0 coordinate by coordinate, with c = (1 - m)^F, or n_0 / (n_0 + F) for the
  cumulative average: every term added is >= 0, and the old value shrinks by c at most;
  in particular v_F >= 0;
* r_F = c r_0 + (1 - c) mu, mu a convex combination of the batch means: the batch means are
  statistics of activations no update rule bounds, so neither is r_F (nor v_F from above).
  Those two are neutralised by a robust ``aggregation`` (median, trimmed mean), not here.

Every other integer buffer must stay within +-2**53, where the float64 average is exact.
``buffer_rules(model)`` reads each BatchNorm layer's momentum from the model (what the
ServerApp passes); without a model ``rules_from_keys`` knows the layers by their buffers'
names only and checks ``v >= 0`` and the integer range (a foreign client may take any number
of forwards). ``check_buffers`` returns the reason an honest client cannot have sent a state,
or None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

#: the relative float slack of the variance floor per forward (fp32 rounding of each EMA update)
REL_SLACK = 1e-5
#: integers beyond this magnitude are not exact in the float64 average
INT_LIMIT = 2 ** 53
#: what rules_from_keys knows a BatchNorm layer by
MEAN, VAR, COUNT = "running_mean", "running_var", "num_batches_tracked"


@dataclass(frozen=True)
class Norm:
    """One BatchNorm layer's buffers (``prefix``: the module's name with its dot) and momentum
    (None: cumulative average; ``known=False``: unknown, only the sign of v is checked)."""

    prefix: str
    momentum: float | None = 0.1
    known: bool = True

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"


def buffer_rules(model: nn.Module) -> tuple[Norm, ...]:
    """The BatchNorm layers of ``model`` that track running statistics, with their momentum."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            out.append(Norm(f"{name}." if name else "", module.momentum))
    return tuple(out)


def rules_from_keys(keys: Mapping[str, Tensor] | list[str]) -> tuple[Norm, ...]:
    """BatchNorm layers known by the names of their buffers (momentum unknown)."""
    names = set(keys)
    prefixes = sorted(k[: -len(VAR)] for k in names if k.endswith(VAR) and f"{k[: -len(VAR)]}{MEAN}" in names)
    return tuple(Norm(p, None, known=False) for p in prefixes)


def shrink(norm: Norm, forwards: int, count: int) -> float:
    """c: the factor the old variance shrinks by at most over ``forwards`` forwards."""
    if norm.momentum is None:
        return count / (count + forwards) if count + forwards > 0 else 0.0
    return (1.0 - float(norm.momentum)) ** forwards


def check_buffers(state: Mapping[str, Tensor], reference: Mapping[str, Tensor], rules: tuple[Norm, ...],
                  forwards: int | None) -> str | None:
    """Why ``state``'s buffers cannot come from an honest client that took ``forwards``
    training forwards from ``reference`` (the global state), or None. ``state`` is checked
    for keys, shapes, dtypes and finiteness already. ``forwards=None``: unknown (a foreign
    client), only the signs and ranges are checked."""
    for norm in rules:
        var, count = norm.key(VAR), norm.key(COUNT)
        if var in state:
            v = state[var]
            if bool((v < 0).any()):
                return f"{var} holds negative values (min {float(v.min()):.6g}): a running variance is >= 0"
        exact = norm.known and forwards is not None
        n0 = int(reference[count]) if count in reference and reference[count].numel() == 1 else None
        if exact and count in state and n0 is not None:
            got = int(state[count])
            if got != n0 + forwards:
                return (f"{count} is {got}, but {_forwards(forwards)} from the global {n0} make "
                        f"{n0 + forwards}")
        if exact and var in state and var in reference and n0 is not None:
            floor_c = shrink(norm, forwards, n0) * (1.0 - REL_SLACK * (forwards + 1))
            v0 = reference[var].to(state[var].device, torch.float64)
            short = state[var].double() < floor_c * v0 - 1e-30
            if bool(short.any()):
                i = int(short.nonzero()[0, 0]) if short.dim() else 0
                got = float(state[var].reshape(-1)[i]) if short.dim() else float(state[var])
                want = float(v0.reshape(-1)[i]) if short.dim() else float(v0)
                return (f"{var}[{i}] is {got:.6g}, below the {floor_c * want:.6g} that {_forwards(forwards)} with "
                        f"momentum {norm.momentum} leave of the global {want:.6g}")
    for key, value in state.items():
        if not (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool) and value.numel():
            top = max(int(value.max()), -int(value.min()))
            if top > INT_LIMIT:
                return f"{key} holds {top}, beyond the +-2**53 an integer buffer may hold"
    return None


def _forwards(n: int) -> str:
    return f"{n} training forward{'' if n == 1 else 's'}"
