"""SCAFFOLD, the method added as one module (strategies/methods/scaffold.py): the Flower path
against a reference written from the paper's Algorithm 1 with plain loops (partial
participation: clients keep c_i while not sampled), the engine against the Flower path
(sequential bit for bit, vmap to rounding), torchrun 2 processes == 1, flwr run == in-process,
and its configuration errors."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tasks
from server.app import initial_model
from simulations.engine import Engine, EngineOptions, run_engine
from simulations.engine.distributed import World
from strategies import SCAFFOLD
from strategies.core.client_sampling import participants
from tasks import load_task
from tasks.config import RunConfig
from tasks.runs.results import load_weights, read_results
from tasks.sampling import round_batches

ROOT = Path(__file__).resolve().parents[1]
CASE = {"algorithm": "scaffold", "clip": "off", "num-clients": 5, "clients-per-round": 3, "num-rounds": 4,
        "local-steps": 3, "batch-size": 8, "lr": 0.2, "partitioner": "dirichlet", "dirichlet-alpha": 0.3}


def reference(values):
    """Algorithm 1 of Karimireddy et al. (ICML 2020), option II, eta_g = 1, written out."""
    cfg = RunConfig.from_mapping(values)
    task, parts = load_task(cfg), tasks.partitions(cfg)
    model = initial_model(task, cfg.seed)
    names = [k for k, _ in model.named_parameters()]
    x = [p.detach().clone() for p in model.parameters()]
    c = [torch.zeros_like(t) for t in x]
    c_i = {i: [torch.zeros_like(t) for t in x] for i in range(cfg.num_clients)}
    lr, steps, n = cfg.lr, cfg.local_steps, cfg.num_clients

    def gradient(y, idx):
        for p, v in zip(model.parameters(), y, strict=True):
            p.data = v.clone()
        loss = nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx])
        return [g.detach() for g in torch.autograd.grad(loss, list(model.parameters()))]

    for r in range(1, cfg.num_rounds + 1):
        sampled = participants(cfg.seed, r, n, cfg.clients_per_round)
        ys, dcs = [], []
        for i in sampled:
            y = [t.clone() for t in x]
            batches = round_batches(parts[i], seed=cfg.seed, partition_id=i, server_round=r, local_steps=steps,
                                    batch_size=cfg.batch_size)
            for s in range(steps):
                g = gradient(y, torch.from_numpy(batches[s]))
                y = [y[j] - lr * (g[j] - c_i[i][j] + c[j]) for j in range(len(y))]
            new = [c_i[i][j] - c[j] + (x[j] - y[j]) / (steps * lr) for j in range(len(x))]
            dcs.append([new[j] - c_i[i][j] for j in range(len(x))])
            c_i[i] = new
            ys.append(y)
        x = [sum(y[j] for y in ys) / len(ys) for j in range(len(x))]
        c = [c[j] + len(sampled) / n * sum(d[j] for d in dcs) / len(dcs) for j in range(len(x))]
    return dict(zip(names, x, strict=True))


def test_flower_path_equals_the_papers_algorithm(runs, mlp_digits, mlp):
    """K = 3 of M = 5 a round: c_i of a client that sits out stays for its next round."""
    state, (header, rows) = runs.flower("scaffold", **CASE)
    picks = [participants(0, r, 5, 3) for r in range(1, 5)]
    assert any(set(picks[r]) - set(picks[r + 1]) for r in range(3))  # someone sits out and comes back
    ref = reference(runs.values("scaffold", **CASE))
    for k, v in ref.items():
        assert torch.allclose(state[k], v, atol=1e-6, rtol=1e-5), k
    model_bytes = header["model-bytes"]
    trainable = sum(p.numel() * p.element_size() for p in mlp().parameters())
    assert all(r["replies"] == 3 and r["rejected-replies"] == 0 for r in rows[1:])
    assert rows[-1]["bytes-sent"] == rows[-1]["bytes-received"] == 3 * (model_bytes + trainable)  # x, c / y_i, dc_i
    assert rows[-1]["clip-fraction"] == 0.0


def test_engine_equals_flower_path(runs, mlp_digits):
    """One client after another: bit for bit; stacked with vmap: to float rounding."""
    flower_run = runs.flower("flower", **CASE)
    runs.same(flower_run, runs.engine("engine", "sequential", **CASE), exact=True)
    runs.same(flower_run, runs.engine("vmap", "vmap", **CASE), exact=False)


def test_default_model_with_batch_statistics_engine_equals_flower(runs):
    case = {**CASE, "clients-per-round": 0, "num-clients": 3, "num-rounds": 2, "weight-decay": 1e-3}
    runs.same(runs.flower("flower", **case), runs.engine("engine", "auto", **case), exact=True)


def test_configuration_errors_name_the_fix():
    with pytest.raises(ValueError, match="clip must be \"off\" for algorithm 'scaffold'"):
        RunConfig.from_mapping({"algorithm": "scaffold", "clip": 1.0})
    with pytest.raises(ValueError, match="clip must be \"off\" for algorithm 'scaffold'"):
        SCAFFOLD(lr=0.1, clip=1.0)
    cfg = RunConfig.from_mapping({**CASE, "device": "cpu"})
    with pytest.raises(ValueError, match="algorithm 'scaffold' .* runs on one process only"):
        Engine(cfg, EngineOptions(), World(rank=0, size=2))


@pytest.mark.parametrize("keys, message", [
    ({"momentum": 0.9}, r"momentum must be 0 for algorithm 'scaffold', got 0.9: its control update"),
    ({"aggregation": "median"}, r"aggregation 'median' is refused for algorithm 'scaffold'"),
    ({"aggregation": "trimmed-mean"}, r"aggregation 'trimmed-mean' is refused for algorithm 'scaffold'"),
    ({"task": "ptb"}, r"task 'ptb' is refused for algorithm 'scaffold': its batches scale each step's lr"),
    ({"task": "wikitext2"}, r"task 'wikitext2' is refused for algorithm 'scaffold'"),
])
def test_combinations_the_paper_does_not_define_are_refused(keys, message):
    """Momentum, lr-scaled batches, robust aggregation: refused, naming the key (the config, and the strategy
    a user builds)."""
    with pytest.raises(ValueError, match=message):
        RunConfig.from_mapping({**CASE, **keys})
    if "task" not in keys:
        with pytest.raises(ValueError, match=message):
            SCAFFOLD(lr=0.1, clip=math.inf, **{k.replace("-", "_"): v for k, v in keys.items()})


@pytest.mark.realproc
def test_two_engine_processes_give_the_one_process_result(tmp_path, command, close):
    """torchrun, 2 gloo processes holding 2 + 1 clients and their controls: the same run as one."""
    keys = {**CASE, "clients-per-round": 0, "num-clients": 3, "num-rounds": 3, "device": "cpu",
            "results-dir": str(tmp_path)}
    overrides = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in keys.items())
    command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
             "simulations.engine", "--config", str(ROOT / "pyproject.toml"), "--quiet",
             "--run-config", f"{overrides} run-name=two"])
    one = run_engine(RunConfig.from_mapping({**keys, "run-name": "one"}), show_progress=False)
    close(load_weights(tmp_path / "two" / "model.pt"), one.state, 1e-6)
    (head, rows), (_, one_rows) = (read_results(tmp_path / n / "results.jsonl") for n in ("two", "one"))
    assert head["world-size"] == 2 and [r["replies"] for r in rows[1:]] == [3, 3, 3]
    assert [r["bytes-sent"] for r in rows[1:]] == [r["bytes-sent"] for r in one_rows[1:]]


@pytest.mark.realproc
def test_flwr_run_keeps_the_controls_in_context_state(tmp_path, runs):
    """The real Flower simulation (SuperLink, Ray): each node's c_i lives in its Context.state
    from round to round; the run equals the in-process apps."""
    from simulations.flower import LocalSuperLink, run_app

    case = {**CASE, "num-rounds": 3, "device": "cpu", "results-dir": str(tmp_path), "run-name": "flwr"}
    (tmp_path / "superlink").mkdir()
    with LocalSuperLink(cwd=tmp_path / "superlink") as superlink:
        run = run_app(ROOT, case, {"num-supernodes": 5}, timeout=400, superlink=superlink)
    assert run["status"] == "finished:completed"
    flower = load_weights(tmp_path / "flwr" / "model.pt")
    loop, _ = runs.flower("loop", **{**case, "run-name": "loop"})
    for key in flower:
        torch.testing.assert_close(flower[key], loop[key], rtol=0, atol=1e-6)


def test_a_lost_reply_is_said_in_the_rows_controls_unaccounted(tmp_path):
    """Partition 1's ClientApp fails in round 2 (its reply never averaged): from then on c may not be
    the mean of the clients' c_i, and every row says how many replies c does not include."""
    from deploy_support import DEPLOY_CONFIG, FaultyGrid

    from client.app import app as client_app
    from server.app import app as server_app
    from simulations.loopback import run_server_app

    values = {**RunConfig().to_mapping(), **DEPLOY_CONFIG, "algorithm": "scaffold", "clip": math.inf,
              "num-clients": 3, "num-rounds": 3, "node-wait": 2.0, "min-replies": 2, "results-dir": str(tmp_path),
              "run-name": "lost"}
    run_server_app(server_app, FaultyGrid(client_app, values, 3, failures={1: {2}}))
    _, rows = read_results(tmp_path / "lost" / "results.jsonl")
    assert [r["replies"] for r in rows[1:]] == [3, 2, 3]
    assert "controls-unaccounted" not in rows[1]
    assert [r["controls-unaccounted"] for r in rows[2:]] == [1, 1]
