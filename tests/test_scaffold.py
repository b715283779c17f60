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
from controls_support import checkpointed_controls
from flwr.app import ArrayRecord
from torch import nn

import tasks
from server.app import initial_model
from simulations.engine import Engine, EngineOptions, run_engine
from simulations.engine.distributed import World
from strategies import SCAFFOLD
from strategies.core.client_sampling import participants
from strategies.methods.reduce import per_client
from tasks import load_task
from tasks.config import RunConfig
from tasks.runs.checkpoint import load_checkpoint
from tasks.runs.results import load_weights, read_results
from tasks.sampling import round_batches

ROOT = Path(__file__).resolve().parents[1]
CASE = {"algorithm": "scaffold", "clip": "off", "num-clients": 5, "clients-per-round": 3, "num-rounds": 4,
        "local-steps": 3, "batch-size": 8, "lr": 0.2, "partitioner": "dirichlet", "dirichlet-alpha": 0.3}


def reference(values, dropped=None, controls=False):
    """Algorithm 1 of Karimireddy et al. (ICML 2020), option II, eta_g = 1, written out in float64
    (``dropped``: round -> clients whose reply the server does not average; they keep their c_i;
    ``controls``: also return c and every c_i)."""
    cfg = RunConfig.from_mapping(values)
    task, parts = load_task(cfg), tasks.partitions(cfg)
    model = initial_model(task, cfg.seed).double()
    names = [k for k, _ in model.named_parameters()]
    x = [p.detach().clone() for p in model.parameters()]
    c = [torch.zeros_like(t) for t in x]
    c_i = {i: [torch.zeros_like(t) for t in x] for i in range(cfg.num_clients)}
    lr, steps, n = cfg.lr, cfg.local_steps, cfg.num_clients

    def gradient(y, idx):
        for p, v in zip(model.parameters(), y, strict=True):
            p.data = v.clone()
        loss = nn.functional.cross_entropy(model(task.train_x[idx].double()), task.train_y[idx])
        return [g.detach() for g in torch.autograd.grad(loss, list(model.parameters()))]

    for r in range(1, cfg.num_rounds + 1):
        sampled = participants(cfg.seed, r, n, cfg.clients_per_round or n)
        ys, dcs = [], []
        for i in sampled:
            y = [t.clone() for t in x]
            batches = round_batches(parts[i], seed=cfg.seed, partition_id=i, server_round=r, local_steps=steps,
                                    batch_size=cfg.batch_size)
            for s in range(steps):
                g = gradient(y, torch.from_numpy(batches[s]))
                y = [y[j] - lr * (g[j] - c_i[i][j] + c[j]) for j in range(len(y))]
            if i in (dropped or {}).get(r, ()):
                continue  # its reply never counts: its c_i stays, as the server keeps it
            new = [c_i[i][j] - c[j] + (x[j] - y[j]) / (steps * lr) for j in range(len(x))]
            dcs.append([new[j] - c_i[i][j] for j in range(len(x))])
            c_i[i] = new
            ys.append(y)
        x = [sum(y[j] for y in ys) / len(ys) for j in range(len(x))]
        c = [c[j] + len(ys) / n * sum(d[j] for d in dcs) / len(dcs) for j in range(len(x))]
    model_state = {k: v.float() for k, v in zip(names, x, strict=True)}
    if not controls:
        return model_state
    as_dict = lambda ts: {k: v.float() for k, v in zip(names, ts, strict=True)}  # noqa: E731
    return model_state, as_dict(c), {i: as_dict(ci) for i, ci in c_i.items()}


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
    for r, row in enumerate(rows[1:], start=1):  # x and c to each; c_i to a client that trained before / y_i, c_i+
        again = sum(1 for i in picks[r - 1] if any(i in p for p in picks[:r - 1]))
        assert row["bytes-sent"] == 3 * (model_bytes + trainable) + again * trainable, r
        assert row["bytes-received"] == 3 * (model_bytes + trainable), r
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
def test_two_engine_processes_resume_with_every_processs_controls(tmp_path, command):
    """torchrun, 2 gloo processes each holding its clients' c_i: the checkpoint gathers them, and a
    run stopped after round 2 and resumed ends bit for bit where the uninterrupted one does."""
    keys = {**CASE, "clients-per-round": 0, "num-clients": 3, "num-rounds": 3, "device": "cpu",
            "checkpoint-every": 1, "results-dir": str(tmp_path)}

    def torchrun(name, **more):
        overrides = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={str(v).lower()}"
                             for k, v in {**keys, **more, "run-name": name}.items())
        command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                 "simulations.engine", "--config", str(ROOT / "pyproject.toml"), "--quiet", "--run-config", overrides])

    torchrun("whole")
    torchrun("part", **{"num-rounds": 2})
    held = load_checkpoint(tmp_path / "part").strategy_state
    assert sorted({k.split("/")[1] for k in held if k.startswith("client-control/")}) == ["0", "1", "2"]
    torchrun("part", resume=True)
    whole, resumed = load_weights(tmp_path / "whole" / "model.pt"), load_weights(tmp_path / "part" / "model.pt")
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), key


@pytest.mark.realproc
def test_flwr_run_equals_the_in_process_apps(tmp_path, runs):
    """The real Flower simulation (SuperLink, Ray): the server sends each client its c_i and keeps it;
    the run equals the in-process apps."""
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


FAULTY = {**CASE, "num-clients": 4, "clients-per-round": 0, "num-rounds": 4, "checkpoint-every": 1,
          "node-wait": 2.0, "min-replies": 2}


def consistent(folder, values, dropped):
    """The checkpointed c equals the mean of the N checkpointed c_i and both equal the float64
    reference in which the dropped replies never count; the model too."""
    c, held = checkpointed_controls(folder, values["num-clients"])  # c == mean of the c_i, checked there
    ref_x, ref_c, ref_ci = reference(values, dropped, controls=True)
    for k in c:
        torch.testing.assert_close(c[k], ref_c[k], rtol=1e-4, atol=1e-6)
        for i in held:
            torch.testing.assert_close(held[i][k], ref_ci[i][k], rtol=1e-4, atol=1e-6)
    weights = load_weights(folder / "model.pt")
    for k, v in ref_x.items():
        torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=1e-6)


def faulty_run(tmp_path, name, grid_cls, overrides=(), **kw):
    from client.app import app as client_app
    from server.app import app as server_app
    from simulations.loopback import run_server_app

    values = {**RunConfig().to_mapping(), **FAULTY, "device": "cpu", "results-dir": str(tmp_path), "run-name": name,
              **dict(overrides)}
    run_server_app(server_app, grid_cls(client_app, values, values["num-clients"], **kw))
    return tmp_path / name, values


@pytest.mark.parametrize("fault", ["error", "lost", "rejected", "non-finite"])
def test_controls_stay_the_mean_of_the_clients_controls_whatever_happens_to_a_reply(tmp_path, mlp_digits, fault):
    """The Flower path with a planted fault: client 1's reply in round 2 is an error (a crashed
    ClientApp), never comes (round-timeout), is rejected by a check (a wrong shape), or holds a
    non-finite c_i+ (left out of the average): the server commits no c_i+ for it, so c stays the
    mean of the N c_i, and c, every c_i and the model equal the reference that drops that reply."""
    from deploy_support import FaultyGrid
    from test_malicious_replies import TamperingGrid

    if fault in ("error", "lost"):
        folder, values = faulty_run(tmp_path, fault, FaultyGrid, {"round-timeout": 1.0} if fault == "lost" else {},
                                    failures={1: {2}}, silent=fault == "lost")
    else:
        bad = (lambda v: v[:1]) if fault == "rejected" else (lambda v: torch.full_like(v, math.nan))

        def tamper(reply):  # the first tensor of its c_i+
            state = reply.content["control"].to_torch_state_dict()
            first = next(iter(state))
            reply.content["control"] = ArrayRecord({**state, first: bad(state[first])})

        folder, values = faulty_run(tmp_path, fault, TamperingGrid, tamper=tamper)
    _, rows = read_results(folder / "results.jsonl")
    assert [r["replies"] for r in rows[1:]] == [4, 3, 4, 4]
    consistent(folder, values, {2: {1}})


def test_engine_leaves_a_non_finite_reply_out_of_c_and_of_the_c_i(tmp_path, mlp_digits, monkeypatch):
    """The engine's one fault (a client's non-finite results, left out of the average): the same
    consistency, against the same reference."""
    from strategies.methods.scaffold import SCAFFOLD as Method

    original = Method.client

    def faulty(cls, exchange, group):
        results = original.__func__(cls, exchange, group)
        if exchange.settings.server_round == 2 and 1 in group.ids:
            at = group.ids.index(1)
            controls = per_client(results.arrays["control"])
            results.arrays["control"] = [{k: v.clone().fill_(math.nan) for k, v in c.items()} if j == at else c
                                         for j, c in enumerate(controls)]
        return results

    monkeypatch.setattr(Method, "client", classmethod(faulty))
    values = {**RunConfig().to_mapping(), **FAULTY, "device": "cpu", "results-dir": str(tmp_path), "run-name": "e"}
    run_engine(RunConfig.from_mapping(values), EngineOptions(path="sequential"), show_progress=False)
    consistent(tmp_path / "e", values, {2: {1}})


def test_resume_on_the_flower_path_equals_the_uninterrupted_run(runs, mlp_digits):
    """c and every c_i live in the server's checkpoint: a resumed run of the in-process apps ends
    bit for bit where the uninterrupted one does (K = 3 of M = 5: clients sit out and come back)."""
    whole = runs.flower("whole", **{**CASE, "checkpoint-every": 1})
    runs.flower("part", **{**CASE, "checkpoint-every": 1, "num-rounds": 2})
    resumed = runs.flower("part", **{**CASE, "checkpoint-every": 1, "resume": True})
    for key, value in whole[0].items():
        assert torch.equal(resumed[0][key], value), key
