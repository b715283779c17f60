"""The end of a round in the engine: clients' states and metrics -> one flat vector -> average.

The same semantics as the Flower path (``strategies.averaging`` and the CELGC strategy):

* a client whose floating-point state holds a non-finite value is rejected (not averaged,
  counted in ``rejected-replies``), as ``check_state`` rejects such a reply;
* the average is sum_i w_i x_i over the sound clients in float64, with w_i = 1/N
  (``uniform``) or n_i / sum n (``examples``) renormalised over the sound clients, and is
  cast back by ``strategies.averaging.finalize`` (integer buffers rounded, dtype kept);
* round metrics are those of ``strategies.client_metrics`` (per-client table, sums,
  finish), the definition the Flower strategies use.

What crosses processes is one float64 vector per process: its clients' weighted sums of
every state tensor, the weight total, and the metric sums. ``all_reduce_sum`` adds them and
every process finalises the same average.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from client.update import RoundStats
from strategies.averaging import AGGREGATIONS, finalize
from strategies.client_metrics import COLUMNS, SUMS_WIDTH, finish_metrics, metric_sums

from .distributed import World, all_reduce_sum

_TAIL = 2 + SUMS_WIDTH  # weight total, replies, then the client-metric sums
#: Up to this many numbers (clients x state size) a list of client states is stacked and summed
#: by one matmul; above it, summed client by client (no n-fold float64 copy of a large model).
STACK_LIMIT = 1 << 24


@dataclass
class ClientMetrics:
    """Per-client metrics of one round, a float64 table [n, len(COLUMNS)] on the device."""

    table: Tensor

    @classmethod
    def from_stats(cls, stats: RoundStats | Sequence[RoundStats]) -> ClientMetrics:
        """From one ``RoundStats`` whose sums are [n] tensors (vectorised clients) or from
        one ``RoundStats`` per client."""
        if isinstance(stats, RoundStats):
            return cls(stats.table())
        return cls(torch.cat([s.table() for s in stats]))

    def column(self, name: str) -> Tensor:
        return self.table[:, COLUMNS.index(name)]


def flat_states(stacked: Mapping[str, Tensor], keys: Sequence[str]) -> Tensor:
    """The clients' states as one float64 matrix [n, P] (keys in order, each flattened)."""
    first = stacked[keys[0]]
    return torch.cat([stacked[k].detach().reshape(first.shape[0], -1).to(torch.float64) for k in keys], 1)


def unflatten(vector: Tensor, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Split a flat vector back into tensors shaped as ``like`` (still float64)."""
    out, offset = {}, 0
    for key, ref in like.items():
        out[key] = vector[offset : offset + ref.numel()].view(ref.shape)
        offset += ref.numel()
    if offset != vector.numel():
        raise ValueError(f"flat vector has {vector.numel()} entries, the state needs {offset}")
    return out


def client_factors(metrics: ClientMetrics, aggregation: str, num_clients: int) -> Tensor:
    """Unnormalised averaging weight of each client: 1/N (uniform) or its examples."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
    if aggregation == "uniform":
        return torch.full_like(metrics.column("num-examples"), 1.0 / num_clients)
    return metrics.column("num-examples")


def _matrix_sum(matrix: Tensor, factors: Tensor, reject_nonfinite: bool) -> tuple[Tensor, Tensor, Tensor]:
    """sum_i w_i x_i over the rows of a [n, P] float64 matrix: one matmul (few kernels)."""
    ok = torch.isfinite(matrix).all(1) if reject_nonfinite else torch.ones_like(factors, dtype=torch.bool)
    w = torch.where(ok, factors, torch.zeros_like(factors))
    return w @ torch.where(ok[:, None], matrix, torch.zeros_like(matrix)), ok, w


def _streamed_sum(states: Sequence[Mapping[str, Tensor]], like: Mapping[str, Tensor], factors: Tensor,
                  reject_nonfinite: bool) -> tuple[Tensor, Tensor, Tensor]:
    """sum_i w_i x_i client by client into one float64 vector: no [n, P] copy (large models)."""
    device = factors.device
    if reject_nonfinite:
        ok = torch.stack([torch.stack([torch.isfinite(s[k]).all() for k in like]).all() for s in states])
    else:
        ok = torch.ones_like(factors, dtype=torch.bool)
    w = torch.where(ok, factors, torch.zeros_like(factors))
    out = torch.zeros(sum(v.numel() for v in like.values()), dtype=torch.float64, device=device)
    views = unflatten(out, like)
    for state, weight, sound in zip(states, w.tolist(), ok.tolist(), strict=True):
        if sound:  # a rejected client is skipped, not multiplied by 0 (0 * nan = nan)
            for key, view in views.items():
                view.add_(state[key].detach(), alpha=weight)
    return out, ok, w


def round_vector(states: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]], like: Mapping[str, Tensor],
                 metrics: ClientMetrics, factors: Tensor, reject_nonfinite: bool = True) -> Tensor:
    """This process's share of the round: [sum_i c_i x_i | sum c_i | replies | metric sums].

    ``states``: the clients' states stacked ({key: [n, ...]}, summed by one matmul) or one
    mapping per client (summed client by client, for models too large to copy n times)."""
    if not isinstance(states, Mapping) and len(states) * sum(v.numel() for v in like.values()) <= STACK_LIMIT:
        states = {k: torch.stack([s[k].detach() for s in states]) for k in like}  # small: fewer, larger kernels
    if isinstance(states, Mapping):
        weighted, ok, w = _matrix_sum(flat_states(states, list(like)), factors, reject_nonfinite)
    else:
        weighted, ok, w = _streamed_sum(states, like, factors, reject_nonfinite)
    tail = torch.cat([torch.stack([w.sum(), ok.double().sum()]), metric_sums(metrics.table, ok)])
    return torch.cat([weighted, tail.to(weighted.dtype)])


def finish_round(
    total: Tensor, like: Mapping[str, Tensor], num_clients: int
) -> tuple[dict[str, Tensor] | None, dict[str, float | int]]:
    """The all-reduced vector -> (average state or None if no client was sound, metrics)."""
    body, tail = total[:-_TAIL], total[-_TAIL:].tolist()  # the round's one host sync
    weight, replies = tail[0], int(round(tail[1]))
    metrics: dict[str, float | int] = {
        "replies": replies, "rejected-replies": num_clients - replies, "failed-replies": 0,
        **finish_metrics(tail[2:], replies),
    }
    if replies == 0 or weight <= 0:
        return None, metrics
    summed = unflatten(body if weight == 1.0 else body / weight, like)
    return finalize(summed, like), metrics


def average_round(
    states: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]], like: Mapping[str, Tensor],
    metrics: ClientMetrics, *, aggregation: str, num_clients: int, world: World, reject_nonfinite: bool = True,
) -> tuple[dict[str, Tensor] | None, dict[str, float | int]]:
    """Average the clients of all processes (ONE all-reduce); see the module docstring.

    ``states``: {key: [n, ...]} (stacked clients) or a list of the n clients' states."""
    vector = round_vector(states, like, metrics, client_factors(metrics, aggregation, num_clients), reject_nonfinite)
    return finish_round(all_reduce_sum(vector, world), like, num_clients)
