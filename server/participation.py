"""Partial participation on the Flower path: the nodes holding a round's K partitions.

``strategies.participation.participants`` picks the round's partition ids from (seed,
round) alone; ``node_selector`` turns them into the strategy's ``select`` hook: the
connected members holding those partitions (``WatchedGrid.partition_of``, known from the
federation check), in partition order. It also tells the grid that only these
partitions are expected to answer this round, so a member that was not sampled is
neither "offline" nor failed, and ``min-replies`` counts among the sampled ones.
"""

from __future__ import annotations

from collections.abc import Callable
from logging import WARNING

from flwr.supercore import log

from strategies.participation import participants
from tasks.config import RunConfig

from .faults import WatchedGrid


def node_selector(cfg: RunConfig, grid: WatchedGrid) -> Callable[[int, list[int]], list[int]]:
    """``select(server_round, node_ids)`` for ``ClippedSGDStrategy``: the round's participants' nodes."""

    def select(server_round: int, node_ids: list[int]) -> list[int]:
        chosen = participants(cfg.seed, server_round, cfg.num_clients, cfg.clients_per_round)
        unknown = [n for n in node_ids if n not in grid.partition_of]
        if unknown:
            raise ValueError(f"clients-per-round={cfg.clients_per_round} samples partitions, but node(s) {unknown} "
                             "did not report their partition-id (the ClientApp must answer the query message)")
        holder = {grid.partition_of[n]: n for n in node_ids}
        grid.expect_round(chosen)
        missing = [p for p in chosen if p not in holder]
        if missing:
            log(WARNING, "Round %d: sampled partition(s) %s have no node online", server_round, missing)
        return [holder[p] for p in chosen if p in holder]

    return select
