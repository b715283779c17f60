"""Which clients train in a round (K of M, seeded) and which node serves them (pure).

``participants(seed, server_round, num_clients, per_round)`` draws ``per_round`` distinct
partition ids uniformly from ``range(num_clients)`` with a generator seeded by
(seed, round) alone, so the ServerApp (which maps them to nodes), the engine (which
stacks only them) and any rerun pick the same clients. ``per_round = num_clients`` (or 0)
is full participation, the paper's setting: every client, in order. ``node_clients`` is which
clients a node serves when there are fewer nodes than clients (multi-client nodes: the
ClientApp and the ServerApp compute the same spread from the node's ``partition-id`` and
``num-partitions``).
"""

from __future__ import annotations

import numpy as np

TAG = 0x5A3B1E  # separates this stream from the minibatch streams of tasks.sampling


def participants(seed: int, server_round: int, num_clients: int, per_round: int = 0) -> list[int]:
    """Sorted partition ids of the clients that train in ``server_round``."""
    if num_clients < 1:
        raise ValueError(f"num-clients must be >= 1, got {num_clients}")
    if per_round == 0 or per_round == num_clients:
        return list(range(num_clients))
    if not 1 <= per_round <= num_clients:
        raise ValueError(f"clients-per-round must be in [1, num-clients={num_clients}] (0: all), got {per_round}")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, server_round, TAG])))
    return sorted(int(i) for i in rng.choice(num_clients, size=per_round, replace=False))


def node_clients(node: int, num_nodes: int, num_clients: int) -> list[int]:
    """The clients (partition ids) node ``node`` of ``num_nodes`` serves when ``num_clients``
    clients are spread over the nodes: every ``num_nodes``-th one, from ``node`` (8 clients on 2
    nodes: [0, 2, 4, 6] and [1, 3, 5, 7]); one each when ``num_nodes == num_clients``."""
    if not 1 <= num_nodes <= num_clients:
        raise ValueError(f"{num_nodes} nodes cannot serve {num_clients} clients: at most one node per client "
                         "(num-supernodes <= num-clients)")
    if not 0 <= node < num_nodes:
        raise ValueError(f"node (partition-id) must be in [0, {num_nodes - 1}], got {node}")
    return list(range(node, num_clients, num_nodes))
