"""Partial participation: which K of the M clients train in a round (pure, seeded).

``participants(seed, server_round, num_clients, per_round)`` draws ``per_round`` distinct
partition ids uniformly from ``range(num_clients)`` with a generator seeded by
(seed, round) alone, so the ServerApp (which maps them to nodes), the engine (which
stacks only them) and any rerun pick the same clients. ``per_round = num_clients`` (or 0)
is full participation, the paper's setting: every client, in order.
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
