"""Parameter averaging, pure PyTorch: the server side of CELGC (no flwr import).

x_bar <- sum_i w_i x_i with w_i = 1/N (uniform, as in the paper) or n_i / sum n (weighted
by examples). Floating-point tensors (parameters and BatchNorm statistics) are averaged
with fp64 accumulation and cast back to their dtype; integer tensors (BatchNorm's
``num_batches_tracked``) are averaged and rounded to the nearest integer, keeping their
dtype. Averaging is sum-then-finalise so a distributed backend can sum locally, all-reduce
the sums and finalise once (``weighted_sum`` + ``finalize``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .robust_statistics import ROBUST

#: the weighted means: uniform (the paper) or by examples
WEIGHTED = ("uniform", "examples")
#: every ``aggregation``: the weighted means and the robust statistics (``strategies.core.robust_statistics``)
AGGREGATIONS = WEIGHTED + ROBUST


#: the end of ``check_state``'s reason for a non-finite tensor (a diverged client, not a malformed reply)
NON_FINITE = "holds non-finite values"


def client_weights(num_examples: Sequence[float], aggregation: str, key: str = "num-examples") -> list[float]:
    """Normalised averaging weights for the replies of one round (``key``: the weights' name in errors).

    The weights may be any real numbers >= 0 with a positive sum (examples, or a user's own
    weights such as 0.25, 0.4, 0.35)."""
    if aggregation not in WEIGHTED:
        raise ValueError(f"aggregation must be one of {', '.join(WEIGHTED)}, got {aggregation!r}")
    if not num_examples:
        raise ValueError("no client results to average")
    if aggregation == "uniform":
        return [1.0 / len(num_examples)] * len(num_examples)
    total = float(sum(num_examples))
    if total <= 0 or any(n < 0 for n in num_examples):
        raise ValueError(f"{key} must be >= 0 with a positive sum, got {list(num_examples)}")
    return [n / total for n in num_examples]


def weighted_sum(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """sum_i w_i * state_i per key, in float64."""
    if len(states) != len(weights):
        raise ValueError(f"{len(states)} states but {len(weights)} weights")
    out: dict[str, Tensor] = {}
    for state, w in zip(states, weights, strict=True):
        for key, value in state.items():
            term = value.detach().to(torch.float64) * w
            out[key] = term if key not in out else out[key] + term
    return out


def finalize(summed: Mapping[str, Tensor], like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Cast a float64 weighted sum back to each tensor's dtype (integers rounded)."""
    out = {}
    for key, ref in like.items():
        value = summed[key]
        if ref.dtype.is_floating_point or ref.dtype.is_complex:
            out[key] = value.to(ref.dtype)
        else:
            out[key] = value.round().to(ref.dtype)
    return out


def average_states(
    states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]
) -> dict[str, Tensor]:
    """The weighted average of client states (weights already normalised)."""
    if not states:
        raise ValueError("no client results to average")
    return finalize(weighted_sum(states, weights), states[0])


def check_state(state: Mapping[str, Tensor], reference: Mapping[str, Tensor]) -> str | None:
    """Why a client's returned state must not be averaged in, or None if it is sound."""
    if set(state) != set(reference):
        missing = sorted(set(reference) - set(state))
        extra = sorted(set(state) - set(reference))
        return f"keys differ from the global model (missing {missing}, unexpected {extra})"
    for key, ref in reference.items():
        value = state[key]
        if tuple(value.shape) != tuple(ref.shape):
            return f"{key} has shape {tuple(value.shape)}, expected {tuple(ref.shape)}"
        if value.dtype != ref.dtype:
            return f"{key} has dtype {value.dtype}, expected {ref.dtype}"
        if value.dtype.is_floating_point and not all_finite(value):
            return f"{key} {NON_FINITE}"
    return None


def finite_flag(tensor: Tensor) -> Tensor:
    """True (a 0-d bool tensor on the tensor's device, no host sync) where every value is finite:
    the smallest and largest value are (``aminmax`` propagates NaN; one pass, no tensor-sized
    boolean copy: 2.5 ms against 60 ms for ``isfinite().all()`` on 16M floats on one CPU core)."""
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    if tensor.is_complex():
        return torch.isfinite(tensor).all()
    low, high = torch.aminmax(tensor)
    return torch.isfinite(low) & torch.isfinite(high)


def all_finite(tensor: Tensor) -> bool:
    """Whether every value is finite (``finite_flag``, read on the host)."""
    return bool(finite_flag(tensor))


def state_nbytes(state: Mapping[str, Tensor]) -> int:
    """Bytes of a state's tensors (what one transfer of the model costs)."""
    return sum(v.numel() * v.element_size() for v in state.values())

