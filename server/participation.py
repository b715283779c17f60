"""Which node serves which of a round's clients, on the Flower path.

``client_assignment`` is the strategy's ``assign`` hook: the round's clients -- all of them,
or under partial participation the K that ``strategies.core.client_sampling.participants`` draws
from (seed, round) alone, as every backend does -- each with the connected member that serves
it (``WatchedGrid.clients_of``: its own partition, or with fewer nodes than clients every
K-th one), in partition order. Under partial participation it also tells the grid that only
these clients are expected to answer this round, so a member that was not sampled is neither
"offline" nor failed, and ``min-replies`` counts among the sampled ones.
"""

from __future__ import annotations

from collections.abc import Callable
from logging import WARNING

from flwr.supercore import log

from strategies.core.client_sampling import participants
from strategies.flower_api.wire import NamedClients
from strategies.methods.privacy import Privacy
from tasks.config import RunConfig

from .faults import WatchedGrid


def client_assignment(cfg: RunConfig, grid: WatchedGrid, privacy: Privacy | None = None
                      ) -> Callable[[int, list[int]], dict[int, list[int]]]:
    """``assign(server_round, node_ids) -> {node: [partition ids]}`` for ``ClippedSGDStrategy``;
    a DP run's clients come from its ``privacy`` (a secure sample where amplification is claimed)."""
    partial = cfg.per_round < cfg.num_clients

    def assign(server_round: int, node_ids: list[int]) -> dict[int, list[int]]:
        unknown = [n for n in node_ids if n not in grid.partition_of]
        if unknown:
            raise ValueError(f"node(s) {unknown} did not report their partition-id: the ClientApp must answer the "
                             "query message (this project's does)")
        chosen = (privacy.participants(server_round) if privacy is not None else
                  participants(cfg.seed, server_round, cfg.num_clients, cfg.clients_per_round))
        if partial:
            grid.expect_round(chosen)
        taking = set(chosen)
        out = {n: [p for p in grid.clients_of(n) if p in taking] for n in node_ids}
        out = {n: ps for n, ps in sorted(out.items(), key=lambda nps: nps[1][:1]) if ps}
        if any(len(grid.clients_of(n)) > 1 for n in node_ids):  # a node's one sampled client must be named
            out = NamedClients(out)
        missing = sorted(taking - {p for ps in out.values() for p in ps})
        if missing:
            log(WARNING, "Round %d: client(s) %s have no node online", server_round, missing)
        return out

    return assign


def fewest_nodes(grid: WatchedGrid, nodes: list[int], clients: int) -> int:
    """The fewest of ``nodes`` that serve at least ``clients`` clients (what a round waits for)."""
    sizes = sorted((len(grid.clients_of(n)) for n in nodes), reverse=True)
    total = 0
    for k, size in enumerate(sizes, 1):
        total += size
        if total >= clients:
            return k
    return max(len(sizes), 1)
