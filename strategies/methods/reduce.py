"""The end of an exchange: the clients' results -> one flat float64 vector -> the average (pure).

Every backend averages the same way (the Flower strategies, the engine on one process or
many): sum-then-finalise (``strategies.core.averaging``), in float64, cast back by
``strategies.core.averaging.finalize`` (integer buffers rounded, dtype kept):

* a client whose floating-point results hold a non-finite value is left out (not averaged,
  not counted among the replies);
* the average is sum_i w_i x_i over the sound clients with w_i = 1/N (``uniform``, N the
  clients asked) or their weights (``examples``), renormalised over the sound clients;
* ``median`` / ``trimmed-mean`` (``strategies.core.robust_statistics``) replace that sum by the statistic of
  the sound clients' values, coordinate by coordinate (the weights ignored);
* the round's client metrics are ``strategies.core.client_metrics``' (per-client table, sums,
  finish); per-client scalars (e.g. naive's ``lr-scale``) are averaged uniformly.

What crosses processes is ONE float64 vector per process -- its clients' weighted sums of
every tensor of the averaged groups, the weight total, the reply count, the metric sums and
the scalar sums -- summed by ``all_reduce`` (the engine's ``torch.distributed`` all-reduce; the
identity on one process), after which every process finalises the same average.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..core.averaging import AGGREGATIONS, finalize, finite_flag
from ..core.client_metrics import COLUMNS, SUMS_WIDTH, finish_metrics, metric_sums, row_metrics
from ..core.robust_statistics import ROBUST, aggregate

#: the clients' tensors of one group: stacked ({key: [n, ...]}) or one mapping per client
ClientArrays = Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]]
#: a sum over all processes (in place allowed); the identity on one process
AllReduce = Callable[[Tensor], Tensor]

#: Up to this many numbers (clients x state size) a list of client states is stacked and summed
#: by one matmul; above it, summed client by client (no n-fold float64 copy of a large model).
STACK_LIMIT = 1 << 24


def is_stacked(arrays: ClientArrays) -> bool:
    return isinstance(arrays, Mapping)


def num_clients(arrays: ClientArrays) -> int:
    if is_stacked(arrays):
        first = next(iter(arrays.values()), None)
        return 0 if first is None else int(first.shape[0])
    return len(arrays)


def per_client(arrays: ClientArrays) -> list[Mapping[str, Tensor]]:
    """One mapping per client (views into stacked tensors)."""
    if is_stacked(arrays):
        return [{k: v[i] for k, v in arrays.items()} for i in range(num_clients(arrays))]
    return list(arrays)


def client_nbytes(arrays: ClientArrays) -> int:
    """Bytes of all clients' tensors (what their replies carry)."""
    if is_stacked(arrays):
        return sum(v.numel() * v.element_size() for v in arrays.values())
    return sum(v.numel() * v.element_size() for state in arrays for v in state.values())


@dataclass
class ClientResults:
    """One exchange's results of this process's clients (``ids`` as the backend names them).

    ``arrays``: group name -> the clients' tensors (e.g. ``"arrays"``: their states;
    ``"grads"`` and ``"buffers"``); ``table``: per-client metrics [n, len(COLUMNS)] (float64,
    NaN where not reported); ``weights``: [n] averaging weights (examples, or a reply's
    ``weighted_by_key``); ``scalars``: name -> [n] per-client values averaged uniformly."""

    ids: list[int]
    arrays: dict[str, ClientArrays]
    table: Tensor
    weights: Tensor
    scalars: dict[str, Tensor] = field(default_factory=dict)
    #: nodes' clients summed where they ran (``node-aggregation``; Flower paths only): averaged with the rest
    node_sums: list[NodeSum] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.ids)
        if self.table.shape != (n, len(COLUMNS)):
            raise ValueError(f"metrics table of shape {tuple(self.table.shape)} for {n} clients")
        for name, arrays in self.arrays.items():
            if is_stacked(arrays) and not arrays:  # a group without tensors (a model without buffers)
                self.arrays[name] = [{} for _ in range(n)]
            elif num_clients(arrays) != n:
                raise ValueError(f"group {name!r} holds {num_clients(arrays)} clients' tensors, expected {n}")

    def __len__(self) -> int:
        return len(self.ids)

    def nbytes(self) -> int:
        return sum(client_nbytes(a) for a in self.arrays.values()) + sum(n.nbytes() for n in self.node_sums)

    def all_clients(self) -> int:
        """This process's clients and those in its node sums."""
        return len(self) + sum(len(n.clients) for n in self.node_sums)

    def metrics_of(self, position: int) -> dict[str, float | int]:
        """One client's metrics as its reply reports them (``client_metrics.row_metrics``, its
        scalars added)."""
        out = row_metrics(self.table[position].tolist())
        for name, v in self.scalars.items():
            out[name] = float(v[position])
        return out


@dataclass
class Mean:
    """The average of one exchange over all processes' sound clients."""

    arrays: dict[str, dict[str, Tensor]] | None  # group -> averaged tensors; None: no sound client
    replies: int  # sound clients (all processes)
    metrics: dict[str, float | int]  # the round's client metrics (strategies.core.client_metrics)
    scalars: dict[str, float]  # uniform means of the per-client scalars over the sound clients
    ok: Tensor  # [n] this process's sound clients
    sums: dict[str, float] = field(default_factory=dict)  # the ``sums`` given, summed over all processes


@dataclass
class NodeSum:
    """One node's clients summed where they ran (``node-aggregation``), in place of their arrays.

    ``sums[group][key]`` = sum_i w_i (x_i - r) over the node's sound clients (``ok``), with w_i 1
    (uniform: the server divides by the exchange's N, which the node does not know) or the client's
    weight (examples), and r the global group for a
    state or buffers group (the update, not the parameters, is summed) or zero for a gradient-like
    group (``node_sums``); ``clients``: their ids, metrics, weights and scalars, no arrays."""

    clients: ClientResults
    ok: Tensor
    sums: dict[str, dict[str, Tensor]]

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for group in self.sums.values() for v in group.values())


def node_sums(results: ClientResults, like: Mapping[str, Mapping[str, Tensor]],
              reference: Mapping[str, Mapping[str, Tensor] | None], aggregation: str,
              ) -> tuple[dict[str, dict[str, Tensor]], Tensor]:
    """What a node sends instead of its clients' arrays (``NodeSum``): per group of ``like``, the
    float64 sum_i w_i (x_i - r) over its clients whose values are all finite (``r``: ``reference``'s
    group, or zero where it has none), summed exactly as ``mean`` sums one process's clients; and
    which clients it holds ([n] bool)."""
    if aggregation in ROBUST:
        raise ValueError(f"aggregation={aggregation!r} takes a statistic of every client's values: a node cannot "
                         "sum them (node-aggregation needs uniform or examples)")
    device = results.table.device
    n = len(results)
    groups = {name: _Group(results.arrays[name], ref, n, device) for name, ref in like.items()}
    ok = torch.ones(n, dtype=torch.bool, device=device)
    for group in groups.values():
        ok &= group.finite()
    w = torch.where(ok, factors(results, aggregation, 1), torch.zeros(n, dtype=torch.float64, device=device))
    out = {}
    weight = float(w.sum())
    for name, group in groups.items():
        flat = group.weighted_sum(w, ok)
        ref = reference.get(name)
        if ref is not None and ref and weight:
            offset = 0
            for value in ref.values():  # in place, entry by entry: no model-sized float64 temporary
                flat[offset:offset + value.numel()].sub_(value.detach().to(device).reshape(-1), alpha=weight)
                offset += value.numel()
        out[name] = unflatten(flat, like[name])
    return out, ok


def factors(results: ClientResults, aggregation: str, expected: int) -> Tensor:
    """Unnormalised averaging weight of each client: 1/N (uniform) or its weight (examples)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
    if aggregation in ROBUST:  # the weights only tell sound clients (>0) from none; the statistic ignores them
        return torch.ones(len(results), dtype=torch.float64, device=results.table.device)
    if aggregation == "uniform":
        return torch.full((len(results),), 1.0 / max(expected, 1), dtype=torch.float64, device=results.table.device)
    return results.weights.to(torch.float64)


def _scalar_sums(results: ClientResults, ok: Tensor, names: Sequence[str]) -> list[Tensor]:
    zero = torch.zeros((), dtype=torch.float64, device=ok.device)
    return [torch.where(ok, results.scalars[k].to(ok.device, torch.float64), 0.0).sum() if k in results.scalars
            else zero for k in names]


def _add_node(vector: Tensor, node: NodeSum, like: Mapping[str, Mapping[str, Tensor]],
              reference: Mapping[str, Mapping[str, Tensor] | None], aggregation: str, expected: int,
              scalars: Sequence[str], counters: int) -> None:
    """Add a node's sums to ``vector`` in ``mean``'s layout of one process's vector, in place: r W +
    its sum per group, its weight, sound clients, metric and scalar sums (its counters none: the round
    counts its clients); no model-sized temporary."""
    device = vector.device
    w = torch.where(node.ok, factors(node.clients, aggregation, expected),
                    torch.zeros(len(node.clients), dtype=torch.float64, device=device))
    weight = w.sum()
    unit = 1.0 / max(expected, 1) if aggregation == "uniform" else 1.0  # the node summed with factor 1
    offset = 0
    for name, ref in like.items():
        base = reference.get(name)
        for key, value in ref.items():
            segment = vector[offset:offset + value.numel()]
            segment.add_(node.sums[name][key].to(device).reshape(-1), alpha=unit)
            if base is not None and base:
                segment.add_(base[key].detach().to(device).reshape(-1), alpha=float(weight))
            offset += value.numel()
    tail = [weight, node.ok.double().sum(), *metric_sums(node.clients.table, node.ok).unbind(),
            *_scalar_sums(node.clients, node.ok, scalars), *([torch.zeros((), dtype=torch.float64, device=device)] * counters)]
    vector[offset:] += torch.stack(tail).to(device, torch.float64)


def unflatten(vector: Tensor, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Split a flat vector back into tensors shaped as ``like`` (still float64)."""
    out, offset = {}, 0
    for key, ref in like.items():
        out[key] = vector[offset : offset + ref.numel()].view(ref.shape)
        offset += ref.numel()
    if offset != vector.numel():
        raise ValueError(f"flat vector has {vector.numel()} entries, the tensors need {offset}")
    return out


class _Group:
    """One group's tensors of this process's clients, ready to sum: as one float64 matrix
    [n, P] (stacked clients, or small ones: one matmul, few kernels) or client by client
    (large models: no n-fold float64 copy)."""

    def __init__(self, arrays: ClientArrays, like: Mapping[str, Tensor], n: int, device: torch.device) -> None:
        self.like, self.n, self.device = like, n, device
        self.size = sum(v.numel() for v in like.values())
        self.matrix: Tensor | None = None
        self.states: Sequence[Mapping[str, Tensor]] | None = None
        if n == 0 or not like:
            return
        keys = list(like)
        if not is_stacked(arrays) and n * self.size <= STACK_LIMIT:
            arrays = {k: torch.stack([s[k].detach().to(device) for s in arrays]) for k in keys}
        if is_stacked(arrays):
            self.matrix = torch.cat([arrays[k].detach().to(device).reshape(n, -1).to(torch.float64) for k in keys], 1)
        else:
            self.states = arrays

    def finite(self) -> Tensor:
        """[n] True where every value of the client is finite."""
        if self.matrix is not None:
            return torch.isfinite(self.matrix).all(1)
        if self.states is not None:
            return torch.stack([torch.stack([finite_flag(s[k]) for k in self.like]).all().to(self.device)
                                for s in self.states])
        return torch.ones(self.n, dtype=torch.bool, device=self.device)

    def rows(self, ok: Tensor) -> Tensor:
        """The clients' values as one float64 matrix [n, P], zero where a client is not ``ok``
        (what a robust statistic and the gather across processes work on)."""
        if self.matrix is not None:
            matrix = self.matrix
        elif self.states is not None:
            matrix = torch.stack([torch.cat([s[k].detach().to(self.device).reshape(-1).to(torch.float64)
                                             for k in self.like]) for s in self.states])
        else:
            return torch.zeros(self.n, self.size, dtype=torch.float64, device=self.device)
        return torch.where(ok[:, None], matrix, torch.zeros_like(matrix))

    def weighted_sum(self, w: Tensor, ok: Tensor) -> Tensor:
        """sum_i w_i x_i over the sound clients ``ok``, one float64 vector."""
        if self.matrix is not None:
            return w @ torch.where(ok[:, None], self.matrix, torch.zeros_like(self.matrix))
        out = torch.zeros(self.size, dtype=torch.float64, device=self.device)
        if self.states is not None:
            views = unflatten(out, self.like)
            for state, weight, sound in zip(self.states, w.tolist(), ok.tolist(), strict=True):
                if sound:  # a rejected client is skipped, not multiplied by 0 (0 * nan = nan)
                    for key, view in views.items():
                        view.add_(state[key].detach().to(self.device), alpha=weight)
        return out


def mean(results: ClientResults, like: Mapping[str, Mapping[str, Tensor]], *, aggregation: str, expected: int,
         all_reduce: AllReduce | None = None, reject_nonfinite: bool = True,
         sums: Mapping[str, float] | None = None, trim_fraction: float = 0.0, population: int | None = None,
         fixed_denominator: bool = False, extra: Tensor | None = None, node_sums: Sequence[NodeSum] = (),
         node_reference: Mapping[str, Mapping[str, Tensor] | None] | None = None) -> Mean:
    """Average the groups named by ``like`` (group -> the keys, shapes and dtypes of its
    average) over the sound clients of every process, with ONE ``all_reduce``.

    ``expected``: the clients asked in the exchange (all processes): the uniform weight is
    1/expected, renormalised over the sound ones. ``sums``: this process's counters (bytes,
    clients) to add over all processes in the same collective. A robust ``aggregation``
    (``strategies.core.robust_statistics``: ``median``, ``trimmed-mean`` with ``trim_fraction``) takes the
    statistic of the sound clients' rows instead of their weighted sum; across processes the
    rows travel in the same all-reduce, each process writing its clients' rows at their ids
    (``population``: the number of client ids, needed then).

    ``fixed_denominator`` (a DP round, ``strategies.methods.privacy``): the sum is divided by
    ``expected`` whatever the number of sound clients (no renormalisation), and an average is
    returned even without one; ``extra``: a flat float64 vector added to this process's
    weighted sum before the all-reduce (the round's noise, already divided by ``expected``).

    ``node_sums`` (``node-aggregation``): nodes' clients summed where they ran, added to this
    process's sums (each as r W + its sum, ``node_reference`` naming r per group); the average
    equals the one of every client's arrays up to the order of the float64 sum."""
    if node_sums and (aggregation in ROBUST or fixed_denominator or extra is not None):
        raise ValueError("node sums (node-aggregation) hold no client's own values: they cannot take a robust "
                         "statistic or a DP release")
    sums = dict(sums or {})
    device = results.table.device
    n = len(results)
    groups = [_Group(results.arrays[name], ref, n, device) for name, ref in like.items()]
    ok = torch.ones(n, dtype=torch.bool, device=device)
    if reject_nonfinite:
        for group in groups:
            ok &= group.finite()
    w = torch.where(ok, factors(results, aggregation, expected), torch.zeros(n, dtype=torch.float64, device=device))
    robust = aggregation in ROBUST
    if not robust:
        parts = [group.weighted_sum(w, ok) for group in groups]
        if extra is not None:
            parts = [torch.cat(parts) + extra.to(device, torch.float64)]
    else:
        rows = torch.cat([group.rows(ok) for group in groups] + [ok.to(torch.float64)[:, None]], 1)  # [n, P + 1]
        if all_reduce is not None:  # gathered by the sum: every process writes its clients' rows at their ids
            if population is None or any(not 0 <= i < population for i in results.ids):
                raise ValueError(f"a robust aggregation across processes needs the population of client ids, got "
                                 f"{population!r} for ids {results.ids}")
            placed = torch.zeros(population, rows.shape[1], dtype=torch.float64, device=device)
            placed[torch.tensor(results.ids, dtype=torch.long, device=device)] = rows
            rows = placed
        parts = [rows.reshape(-1)]
    scalars = sorted(set(results.scalars).union(*(node.clients.scalars for node in node_sums)))
    counters = [torch.tensor(float(v), dtype=torch.float64, device=device) for v in sums.values()]
    tail = [w.sum(), ok.double().sum(), *metric_sums(results.table, ok).unbind(),
            *_scalar_sums(results, ok, scalars), *counters]
    vector = torch.cat([*parts, torch.stack(tail).to(torch.float64)])
    for node in node_sums:
        _add_node(vector, node, like, node_reference or {}, aggregation, expected, scalars, len(counters))
    if all_reduce is not None:
        vector = all_reduce(vector)
    width = len(tail)
    values = vector[-width:].tolist()  # the exchange's one host sync
    weight, replies = values[0], int(round(values[1]))
    metrics = finish_metrics(values[2:2 + SUMS_WIDTH], replies)
    means = {k: values[2 + SUMS_WIDTH + i] / replies for i, k in enumerate(scalars)} if replies else {}
    totals = dict(zip(sums, values[2 + SUMS_WIDTH + len(scalars):], strict=True))
    if (replies == 0 or weight <= 0) and not fixed_denominator:
        return Mean(None, replies, metrics, means, ok, totals)
    body = vector[:-width]
    if robust:
        gathered = body.view(-1, sum(g.size for g in groups) + 1)
        sound = gathered[gathered[:, -1] > 0.5, :-1]  # the sound clients of every process
        body = aggregate(sound, aggregation, trim_fraction)
    elif weight != 1.0 and not fixed_denominator:
        body = body / weight
    out, offset = {}, 0
    for name, ref in like.items():
        size = sum(v.numel() for v in ref.values())
        out[name] = finalize(unflatten(body[offset:offset + size], ref), ref)
        offset += size
    return Mean(out, replies, metrics, means, ok, totals)
