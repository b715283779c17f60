"""FedProx (strategies/methods/fedprox.py, one file): the Flower path against the paper's Algorithm 2
written out with plain loops, the engine against the Flower path (bit for bit one client after
another, to rounding with vmap), mu = 0 == local SGD, and its key's errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tasks
from server.app import initial_model
from strategies.core.client_sampling import participants
from tasks import load_task
from tasks.config import RunConfig
from tasks.sampling import round_batches

CASE = {"algorithm": "fedprox", "fedprox.proximal-mu": 0.5, "num-clients": 4, "clients-per-round": 3, "num-rounds": 3,
        "local-steps": 3, "batch-size": 8, "lr": 0.2, "partitioner": "dirichlet", "dirichlet-alpha": 0.3}


def reference(values):
    """Algorithm 2 of Li et al. (MLSys 2020): each sampled client takes I SGD steps on
    h_k(w; w_t) = F_k(w) + mu/2 |w - w_t|^2 from w_t; w_t+1 is their mean."""
    cfg = RunConfig.from_mapping(values)
    task, parts = load_task(cfg), tasks.partitions(cfg)
    model = initial_model(task, cfg.seed)
    names = [k for k, _ in model.named_parameters()]
    w = [p.detach().clone() for p in model.parameters()]
    mu, lr = values["fedprox.proximal-mu"], cfg.lr

    def proximal_gradient(y, start, idx):
        for p, v in zip(model.parameters(), y, strict=True):
            p.data = v.clone()
        loss = nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx])
        loss = loss + mu / 2 * sum(((a - b) ** 2).sum() for a, b in zip(model.parameters(), start, strict=True))
        return [g.detach() for g in torch.autograd.grad(loss, list(model.parameters()))]

    for r in range(1, cfg.num_rounds + 1):
        ys = []
        for i in participants(cfg.seed, r, cfg.num_clients, cfg.clients_per_round):
            y = [t.clone() for t in w]
            batches = round_batches(parts[i], seed=cfg.seed, partition_id=i, server_round=r,
                                    local_steps=cfg.local_steps, batch_size=cfg.batch_size)
            for s in range(cfg.local_steps):
                g = proximal_gradient(y, w, torch.from_numpy(batches[s]))
                y = [a - lr * b for a, b in zip(y, g, strict=True)]
            ys.append(y)
        w = [sum(y[j] for y in ys) / len(ys) for j in range(len(w))]
    return dict(zip(names, w, strict=True))


def test_flower_path_equals_the_papers_algorithm(runs, mlp_digits):
    state, (_, rows) = runs.flower("fedprox", **CASE)
    for k, v in reference(runs.values("fedprox", **CASE)).items():
        assert torch.allclose(state[k], v, atol=1e-6, rtol=1e-5), k
    assert all(r["replies"] == 3 and r["rejected-replies"] == 0 for r in rows[1:])
    assert rows[-1]["clip-fraction"] == 0.0  # clip off: FedProx's default


def test_the_proximal_term_pulls_towards_the_global_model(runs, mlp_digits):
    far = reference(runs.values("a", **{**CASE, "fedprox.proximal-mu": 0.0}))
    near = reference(runs.values("b", **{**CASE, "fedprox.proximal-mu": 5.0}))
    start = {k: v for k, v in initial_model(load_task(RunConfig.from_mapping(runs.values("c", **CASE))), 0)
             .state_dict().items() if k in far}
    moved = lambda s: sum(float((s[k] - start[k]).norm() ** 2) for k in s) ** 0.5  # noqa: E731
    assert moved(near) < moved(far)


def test_engine_equals_flower_path(runs, mlp_digits):
    flower_run = runs.flower("flower", **CASE)
    runs.same(flower_run, runs.engine("engine", "sequential", **CASE), exact=True)
    runs.same(flower_run, runs.engine("vmap", "vmap", **CASE), exact=False)


def test_zero_mu_is_local_sgd(runs, mlp_digits):
    local = {**CASE, "algorithm": "local-sgd", "fedprox.proximal-mu": 0.0}
    prox = runs.engine("prox", "sequential", **{**CASE, "fedprox.proximal-mu": 0.0})
    sgd = runs.engine("sgd", "sequential", **local)
    for k, v in sgd[0].items():
        assert torch.equal(prox[0][k], v), k


@pytest.mark.parametrize("values, message", [
    ({"algorithm": "fedprox", "fedprox.proximal-mu": -0.1}, r"fedprox.proximal-mu must be a finite number >= 0, got -0.1"),
    ({"algorithm": "celgc", "fedprox.proximal-mu": 0.1},
     r"fedprox.proximal-mu = 0.1 is a setting of algorithm 'fedprox', not of the running algorithm 'celgc'"),
    ({"algorithm": "fedprox", "fedprox.proximal-m": 0.1}, r"did you mean 'fedprox.proximal-mu' for 'fedprox.proximal-m'\?"),
])
def test_its_key_is_checked(values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_mapping(values)
