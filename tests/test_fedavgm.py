"""FedAvgM (strategies/methods/fedavgm.py, one file): the Flower path against Hsu et al.'s server
momentum written out with plain loops, the engine against the Flower path, beta = 0 and eta_s = 1
== FedAvg to rounding, resume == uninterrupted (v is checkpointed), and its keys' errors."""

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

CASE = {"algorithm": "fedavgm", "fedavgm.server-momentum": 0.7, "fedavgm.server-lr": 1.2, "num-clients": 4,
        "clients-per-round": 3, "num-rounds": 3, "local-steps": 2, "batch-size": 8, "lr": 0.2,
        "partitioner": "dirichlet", "dirichlet-alpha": 0.3}


def reference(values):
    """FedAvg's clients (I SGD steps from w_t); the server: Delta = w_t - mean_k w_k,
    v <- beta v + Delta, w_t+1 = w_t - eta_s v (Hsu, Qi, Brown 2019, FedAvgM)."""
    cfg = RunConfig.from_mapping(values)
    task, parts = load_task(cfg), tasks.partitions(cfg)
    model = initial_model(task, cfg.seed)
    names = [k for k, _ in model.named_parameters()]
    w = [p.detach().clone() for p in model.parameters()]
    v = [torch.zeros_like(t) for t in w]
    beta, eta = values["fedavgm.server-momentum"], values["fedavgm.server-lr"]

    def gradient(y, idx):
        for p, t in zip(model.parameters(), y, strict=True):
            p.data = t.clone()
        loss = nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx])
        return [g.detach() for g in torch.autograd.grad(loss, list(model.parameters()))]

    for r in range(1, cfg.num_rounds + 1):
        ys = []
        for i in participants(cfg.seed, r, cfg.num_clients, cfg.clients_per_round):
            y = [t.clone() for t in w]
            batches = round_batches(parts[i], seed=cfg.seed, partition_id=i, server_round=r,
                                    local_steps=cfg.local_steps, batch_size=cfg.batch_size)
            for s in range(cfg.local_steps):
                g = gradient(y, torch.from_numpy(batches[s]))
                y = [a - cfg.lr * b for a, b in zip(y, g, strict=True)]
            ys.append(y)
        mean = [sum(y[j] for y in ys) / len(ys) for j in range(len(w))]
        v = [beta * v[j] + (w[j] - mean[j]) for j in range(len(w))]
        w = [w[j] - eta * v[j] for j in range(len(w))]
    return dict(zip(names, w, strict=True))


def test_flower_path_equals_server_momentum_written_out(runs, mlp_digits):
    state, (_, rows) = runs.flower("fedavgm", **CASE)
    for k, v in reference(runs.values("fedavgm", **CASE)).items():
        assert torch.allclose(state[k], v, atol=1e-6, rtol=1e-5), k
    assert all(r["replies"] == 3 and r["rejected-replies"] == 0 for r in rows[1:])


def test_engine_equals_flower_path(runs, mlp_digits):
    flower_run = runs.flower("flower", **CASE)
    runs.same(flower_run, runs.engine("engine", "sequential", **CASE), exact=True)
    runs.same(flower_run, runs.engine("vmap", "vmap", **CASE), exact=False)


def test_no_momentum_is_fedavg(runs, mlp_digits):
    plain = runs.engine("m", "sequential", **{**CASE, "fedavgm.server-momentum": 0.0, "fedavgm.server-lr": 1.0})
    fedavg = runs.engine("f", "sequential", **{**CASE, "algorithm": "local-sgd", "fedavgm.server-momentum": 0.9,
                                               "fedavgm.server-lr": 1.0})
    for k, v in fedavg[0].items():
        assert torch.allclose(plain[0][k], v, atol=1e-6, rtol=0), k


def test_resume_equals_uninterrupted(runs, mlp_digits):
    whole = runs.engine("whole", "sequential", **CASE)
    runs.engine("part", "sequential", **{**CASE, "num-rounds": 2})
    resumed = runs.engine("part", "sequential", **{**CASE, "resume": True})
    for k, v in whole[0].items():
        assert torch.equal(resumed[0][k], v), k


@pytest.mark.parametrize("values, message", [
    ({"algorithm": "fedavgm", "fedavgm.server-momentum": 1.0}, r"fedavgm.server-momentum must be in \[0, 1\), got 1.0"),
    ({"algorithm": "fedavgm", "fedavgm.server-lr": 0}, r"fedavgm.server-lr must be a finite number > 0, got 0.0"),
    ({"algorithm": "celgc", "fedavgm.server-lr": 2.0},
     r"fedavgm.server-lr = 2.0 is a setting of algorithm 'fedavgm', not of the running algorithm 'celgc'"),
    ({"algorithm": "fedavgm", "server-lr": 2.0}, r"'server-lr' is a method's own key, written under the method's name: "
                                                 r".*fedavgm.server-lr.* \(the running algorithm 'fedavgm' reads "
                                                 r"fedavgm.server-lr\)"),
])
def test_its_keys_are_checked(values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_mapping(values)
