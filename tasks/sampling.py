"""Deterministic minibatch sampling: which examples a client uses in a given round.

A client's minibatches depend only on (seed, partition id, server round) and the round's
shape (local steps, batch size), never on which process, host or backend runs the client.
Sampling is without replacement within a pass over the partition, exactly like a
``DataLoader(shuffle=True, drop_last=True)`` that keeps running across rounds: pass k is
a permutation drawn from ``numpy.random.default_rng([seed, partition_id, k])``, it holds
``len(partition) // batch_size`` batches, and round r's local step s takes global batch
number ``(r - 1) * local_steps + s``. A client needs no state between rounds.
"""

from __future__ import annotations

import numpy as np


def _pass_permutation(n: int, seed: int, partition_id: int, k: int) -> np.ndarray:
    return np.random.default_rng([seed, partition_id, k]).permutation(n)


def round_batches(
    partition: np.ndarray,
    *,
    seed: int,
    partition_id: int,
    server_round: int,
    local_steps: int,
    batch_size: int,
) -> np.ndarray:
    """Dataset indices of the ``local_steps`` minibatches of one round: [I, batch_size]."""
    n = len(partition)
    if batch_size < 1:
        raise ValueError(f"batch-size must be an integer >= 1, got {batch_size}")
    if batch_size > n:
        raise ValueError(
            f"batch-size ({batch_size}) exceeds the {n} example{'' if n == 1 else 's'} of partition "
            f"{partition_id}: lower batch-size or use fewer clients"
        )
    if server_round < 1:
        raise ValueError(f"server-round must be >= 1, got {server_round}")
    if local_steps < 1:
        raise ValueError(f"local-steps must be an integer >= 1, got {local_steps}")
    per_pass = n // batch_size
    first = (server_round - 1) * local_steps
    out = np.empty((local_steps, batch_size), dtype=np.int64)
    cached_k, perm = -1, None
    for s in range(local_steps):
        k, j = divmod(first + s, per_pass)
        if k != cached_k:
            cached_k, perm = k, _pass_permutation(n, seed, partition_id, k)
        out[s] = partition[perm[j * batch_size : (j + 1) * batch_size]]
    return out
