"""node-aggregation: a multi-client node replies with its clients' sum; the average equals the one
of every client's arrays up to the float64 summation order, the node's average is checked as one
reply, and what cannot be summed is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from simulations.loopback import LoopbackGrid, run_in_process, run_server_app
from strategies.core.client_metrics import COLUMNS
from strategies.methods.reduce import ClientResults, NodeSum, mean, node_sums


def results(ids, states, weights=None, scalars=None) -> ClientResults:
    ids = list(ids)
    n = len(ids)
    table = torch.full((n, len(COLUMNS)), float("nan"), dtype=torch.float64)
    table[:, COLUMNS.index("train-loss")] = torch.tensor([float(i) for i in ids], dtype=torch.float64)
    w = torch.tensor(weights if weights else [1.0] * n, dtype=torch.float64)
    return ClientResults(list(ids), {"arrays": list(states)}, table, w, scalars or {})


def states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g),
             "count": torch.tensor(7 + i, dtype=torch.int64)} for i in range(n)]


@pytest.mark.parametrize("aggregation", ["uniform", "examples"])
def test_node_sums_average_as_every_client_s_arrays(aggregation):
    everyone = states(6)
    everyone[4]["w"][0, 0] = float("nan")  # a diverged client: left out either way
    weights = [32.0, 16.0, 8.0, 32.0, 4.0, 2.0]
    glob = {k: v.clone() for k, v in states(1, seed=9)[0].items()}
    like = {"arrays": glob}
    full = mean(results(range(6), everyone, weights), like, aggregation=aggregation, expected=6)
    nodes = []
    for members in ([0, 2, 4], [1, 3, 5]):  # node i serves clients i, i + 2, i + 4
        part = results(members, [everyone[i] for i in members], [weights[i] for i in members])
        sums, ok = node_sums(part, like, {"arrays": glob}, aggregation)
        part.arrays = {}
        nodes.append(NodeSum(part, ok, sums))
    empty = results([], [])
    empty.node_sums = nodes
    summed = mean(empty, like, aggregation=aggregation, expected=6, node_sums=nodes, node_reference={"arrays": glob})
    assert summed.replies == full.replies == 5
    assert summed.metrics == pytest.approx(full.metrics)
    for k, v in full.arrays["arrays"].items():
        got = summed.arrays["arrays"][k]
        assert got.dtype == v.dtype
        if v.is_floating_point():
            assert torch.allclose(got, v, rtol=0, atol=1e-6), k  # float32 rounding of a float64 sum in another order
        else:
            assert torch.equal(got, v), k


def test_a_robust_statistic_cannot_be_summed():
    part = results([0, 1], states(2))
    with pytest.raises(ValueError, match="node-aggregation needs uniform or examples"):
        node_sums(part, {"arrays": states(1)[0]}, {"arrays": None}, "median")


def rows(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()][1:]


def model(folder) -> dict[str, torch.Tensor]:
    return torch.load(folder / "model.pt", weights_only=True)


@pytest.mark.parametrize("extra", [{}, {"algorithm": "naive", "lr": 0.1, "local-steps": 1}, {"aggregation": "examples"},
                                   {"transport": "bfloat16"}])
def test_a_run_with_node_sums_equals_the_one_without(tmp_path, extra):
    """One round from the same model: every entry within one float32 ulp of the exact average plus
    2**-24 times the clients' mean absolute update (the node's update sum travels in float32; each
    client's update is at most I clip = 0.9 an entry); over rounds the differences feed the training."""
    for rounds in (1, 3):
        base = {"num-clients": 6, "num-rounds": rounds, "local-steps": 3, "results-dir": str(tmp_path / str(rounds)),
                "device": "cpu", "checkpoint-every": 0, **extra}  # (naive: one step a round)
        run_in_process({**base, "run-name": "clients"}, 2)
        run_in_process({**base, "run-name": "nodes", "node-aggregation": True}, 2)
        a, b = model(tmp_path / str(rounds) / "clients"), model(tmp_path / str(rounds) / "nodes")
        update = 0.9 if extra.get("algorithm") != "naive" else 0.1 * 10.0  # lr x a gradient entry, generously
        for k in a:
            if not a[k].is_floating_point():
                assert torch.equal(a[k], b[k]), k
            elif rounds == 1 and not extra.get("transport"):
                ulp = torch.from_numpy(np.spacing(a[k].abs().numpy()))
                assert torch.all((a[k] - b[k]).abs() <= ulp + 2**-24 * update), k
            else:
                assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5 if not extra.get("transport") else 1e-2), k
        for x, y in zip(rows(tmp_path / str(rounds) / "clients")[1:], rows(tmp_path / str(rounds) / "nodes")[1:], strict=True):
            assert x["replies"] == y["replies"] == 6 and y["rejected-replies"] == 0
            assert y["train-loss"] == pytest.approx(x["train-loss"], rel=1e-3 if not extra.get("transport") else 1e-2)


def test_a_node_whose_sum_moved_too_far_loses_its_clients_and_the_run_goes_on(tmp_path, monkeypatch):
    from client import app as client_app
    from server.app import app as server_app
    from tasks.config import RunConfig

    real = client_app.node_sums_asked

    def lying(msg, exchange, results, pids):
        sums = real(msg, exchange, results, pids)
        if sums is not None and 1 in pids:  # node 1 serves clients 1, 3: it adds 10 to every summed update
            groups, ok = sums
            groups = {g: {k: v + 10.0 if "running" not in k and "num_batches" not in k else v for k, v in s.items()}
                      for g, s in groups.items()}  # its parameters, not its BatchNorm statistics
            return groups, ok
        return sums

    monkeypatch.setattr(client_app, "node_sums_asked", lying)
    cfg = {**RunConfig().to_mapping(), "num-clients": 4, "num-rounds": 2, "local-steps": 2, "node-aggregation": True,
           "results-dir": str(tmp_path), "run-name": "liar", "device": "cpu", "checkpoint-every": 0, "min-replies": 2}
    run_server_app(server_app, LoopbackGrid(client_app.app, cfg, 2))
    got = rows(tmp_path / "liar")
    assert all(r["replies"] == 2 and r["rejected-replies"] == 2 for r in got[1:])  # rounds 1..
    assert any("its node's sum" in f and "moved" in f for f in got[1].get("failures", []))


@pytest.mark.parametrize("overrides, match", [
    ({"aggregation": "median"}, "uniform\" or \"examples"),
    ({"algorithm": "episode"}, "only averages"),
    ({"algorithm": "scaffold"}, "only averages"),
    ({"dp-noise-multiplier": 1.0}, "dp-noise-multiplier = 0"),
])
def test_what_cannot_be_summed_is_refused_by_name(overrides, match):
    from tasks.config import RunConfig

    with pytest.raises(ValueError, match="node-aggregation") as err:
        RunConfig.from_mapping({"node-aggregation": True, **overrides})
    assert match in str(err.value)


def test_the_strategy_refuses_node_sums_it_cannot_honour():
    from strategies import CELGC, SCAFFOLD

    with pytest.raises(ValueError, match="needs packed=True"):
        CELGC(local_steps=2, lr=0.1, node_sums=True)
    with pytest.raises(ValueError, match="only averages"):
        SCAFFOLD(lr=0.1, packed=True, node_sums=True)
    with pytest.raises(ValueError, match="robust statistic"):
        CELGC(local_steps=2, lr=0.1, packed=True, node_sums=True, aggregation="median")
    assert np.isfinite(CELGC(local_steps=2, lr=0.1, packed=True, node_sums=True).lr)
