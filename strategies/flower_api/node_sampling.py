"""Which connected nodes train in a round, for the Flower strategies (FedAvg's sampling, or a hook)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from logging import INFO

from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import sample_nodes
from flwr.supercore import log

#: ``select(server_round, node_ids) -> node_ids``: the round's nodes among the connected ones
Select = Callable[[int, list[int]], Sequence[int]]
#: ``assign(server_round, node_ids) -> {node: [client ids]}``: the round's clients and their nodes
Assign = Callable[[int, list[int]], Mapping[int, Sequence[int]]]


def sample(grid: Grid, *, num_clients: int | None, fraction: float, min_train_nodes: int, min_available_nodes: int,
           select: Select | None = None, server_round: int | None = None) -> list[int]:
    """This round's clients: ``num_clients`` of the connected nodes (FedAvg's ``fraction``
    without it), at least ``min_train_nodes`` (waited for); with ``select``, the nodes it
    picks for ``server_round`` (it must return distinct connected node ids)."""
    if select is not None:
        if server_round is None:
            raise ValueError("sample(grid, server_round) needs the round when the strategy has a select function")
        _, everyone = sample_nodes(grid, min_available_nodes, 0)  # waits for min_available_nodes
        connected = sorted(everyone)
        node_ids = [int(n) for n in select(server_round, connected)]
        strays = sorted(set(node_ids) - set(connected))
        if strays or len(set(node_ids)) != len(node_ids):
            raise ValueError(f"select({server_round}, ...) must return distinct connected node ids, got {node_ids} "
                             f"(connected: {connected})")
        log(INFO, "configure_train: Selected %s nodes (out of %s)", len(node_ids), len(connected))
        return node_ids
    connected = len(list(grid.get_node_ids()))
    if num_clients is None:
        size = max(int(connected * fraction), min_train_nodes)
    else:
        size = max(min(num_clients, connected), min_train_nodes)
    node_ids, everyone = sample_nodes(grid, min_available_nodes, size)
    log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_ids), len(everyone))
    return node_ids
