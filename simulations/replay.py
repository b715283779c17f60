"""A run that went through faults, replayed in process: the same model from its rows alone.

A deployed run's rows say which clients missed which round (``failed-nodes``: partition ids,
whatever the cause -- a host that was offline, hung, killed, cut off, or a reply that came too
late or not at all). ``replay`` runs the real ServerApp and ClientApp again on the in-process grid
(``simulations.loopback.FaultyGrid``) with exactly those clients failing in exactly those
rounds (a client whose node was offline when a round started is not asked in it, as deployed),
from the run's own config (its results header). For tasks whose clients keep no state
between rounds (digits, CIFAR-10) a client's minibatches are a function of (seed, partition,
round) and replies are averaged in partition order, so the replay ends with the deployed model
bit for bit -- at the deployed ClientApps' torch thread count (``threads``; a CPU kernel splits
its reductions by thread, tests/test_host_share.py). ``row_accounting`` counts the rounds a
results file lost or holds twice (a resumed run must do neither).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from tasks.runs.results import load_weights, read_results

#: keys that do not enter a round's arithmetic and are set for the replay itself
_REPLAY_KEYS = {"resume": False, "round-timeout": 30.0, "node-wait": 5.0, "tensorboard": False, "min-replies": 1}


def missed_rounds(rows: Iterable[Mapping[str, Any]]) -> dict[int, set[int]]:
    """{partition id: the rounds it failed in} from a run's round rows (``failed-nodes``); a failed
    client named otherwise than by its partition id (a host without one) cannot be replayed."""
    out: dict[int, set[int]] = {}
    for row in rows:
        for label in row.get("failed-nodes") or []:
            if isinstance(label, bool) or not isinstance(label, int):
                raise ValueError(f"round {row.get('round')}: failed client {label!r} has no partition id: a replay "
                                 "fails clients by partition id")
            out.setdefault(label, set()).add(int(row["round"]))
    return out


#: how a round's row names a client whose node was not online when the round started (server.faults)
OFFLINE = "offline (not online when the round started)"


def offline_rounds(rows: Iterable[Mapping[str, Any]]) -> dict[int, set[int]]:
    """{partition id: the rounds its node was not online when they started} from the rows'
    ``failures``: such a client was never asked, unlike one that was asked and failed, and the
    server's uniform weights (1/clients asked) differ between the two in the last bit."""
    out: dict[int, set[int]] = {}
    for row in rows:
        for line in row.get("failures") or []:
            head, _, reason = str(line).partition(": ")
            if reason == OFFLINE and head.startswith("partition ") and head[10:].isdigit():
                out.setdefault(int(head[10:]), set()).add(int(row["round"]))
    return out


def row_accounting(rows: Iterable[Mapping[str, Any]], last_round: int) -> dict[str, Any]:
    """Rounds 0..``last_round`` each exactly once? ``rows-lost`` (missing rounds), ``rows-duplicated``
    (rows beyond the first of a round), with the rounds named."""
    count = Counter(int(r["round"]) for r in rows)
    lost = [k for k in range(last_round + 1) if count[k] == 0]
    twice = sorted(k for k, n in count.items() if n > 1)
    beyond = sorted(k for k in count if not 0 <= k <= last_round)
    return {"rows-lost": len(lost), "rows-duplicated": sum(count[k] - 1 for k in twice) + sum(count[k] for k in beyond),
            "lost-rounds": lost, "duplicated-rounds": twice + beyond}


def replay(folder: str | Path, out: str | Path, *, threads: int = 1) -> Path:
    """Replay the run of ``folder`` (its ``results.jsonl``) in process into ``out``; the replay's
    run folder. Its failures are those of the rows; ``threads``: the deployed ClientApps' torch
    threads (``start_supernode.sh --threads``)."""
    from client.app import app as client_app
    from server.app import app as server_app
    from tasks.config import RunConfig

    from .loopback import FaultyGrid, run_server_app

    header, rows = read_results(Path(folder) / "results.jsonl")
    if not header.get("config"):
        raise ValueError(f"{folder}/results.jsonl has no header with the run's config")
    last = max((int(r["round"]) for r in rows), default=0)
    values = {**RunConfig().to_mapping(), **header["config"], **_REPLAY_KEYS, "num-rounds": max(last, 1),
              "results-dir": str(Path(out).resolve()), "run-name": "replay"}
    cfg = RunConfig.from_mapping(values)
    grid = FaultyGrid(client_app, values, cfg.with_clients(None).num_clients, failures=missed_rounds(rows),
                      offline=offline_rounds(rows))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run_server_app(server_app, grid)
    finally:
        torch.set_num_threads(before)
    return Path(out) / "replay"


def model_differences(a: str | Path, b: str | Path) -> dict[str, float]:
    """{key: largest absolute difference} of the two runs' ``model.pt`` where they are not equal bit for
    bit ({}: the same model); a key missing on one side counts as inf."""
    wa, wb = load_weights(Path(a) / "model.pt"), load_weights(Path(b) / "model.pt")
    out = {k: float("inf") for k in set(wa) ^ set(wb)}
    for k in set(wa) & set(wb):
        if not torch.equal(wa[k], wb[k]):
            same_shape = wa[k].shape == wb[k].shape
            out[k] = float((wa[k].double() - wb[k].double()).abs().max()) if same_shape else float("inf")
    return out
