"""EPISODE through the real ServerApp and ClientApp (loopback grid) against a reference written
from the paper's Algorithm 1 with plain loops, its reductions, the bytes of both exchanges,
and parity of the engine with the Flower path."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, Error, Message
from torch import nn

import client.local_round
import tasks as local_round
from client.app import app as client_app
from server.app import app as server_app
from server.app import build_strategy, initial_model
from simulations.engine import EngineOptions, run_engine
from simulations.loopback import LoopbackGrid, run_server_app
from strategies.core import bound
from strategies.core.episode_corrections import CORRECTION_KEY, RESAMPLE_MODE, resample_seed
from strategies.flower_api.episode_strategy import EPISODE
from strategies.flower_api.packing import pack, unpack
from tasks import load_task
from tasks.config import RunConfig
from tasks.runs.results import load_weights, read_results
from tasks.sampling import round_batches


def run_flower(tmp_path, name, n, **overrides):
    values = {**RunConfig().to_mapping(), "algorithm": "episode", "num-clients": n, "device": "cpu",
              "results-dir": str(tmp_path), "run-name": name, "node-wait": 2.0, **overrides}
    grid = LoopbackGrid(client_app, values, n)
    run_server_app(server_app, grid)
    header, rows = read_results(tmp_path / name / "results.jsonl")
    return values, grid, header, rows, load_weights(tmp_path / name / "model.pt")


def reference(values, parts):
    """Algorithm 1 of Crawshaw, Bao, Liu (ICLR 2023), written out with plain loops."""
    cfg = RunConfig.from_mapping(values)
    task = load_task(cfg)
    x_bar = [p.detach().clone() for p in initial_model(task, cfg.seed).parameters()]
    model = initial_model(task, cfg.seed)
    lr, clip, wd, n, steps, b = cfg.lr, cfg.clip, cfg.weight_decay, len(parts), cfg.local_steps, cfg.batch_size

    def gradient(x, idx):
        for p, v in zip(model.parameters(), x, strict=True):
            p.data = v.clone()  # a fresh leaf at the point x
        loss = nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx])
        return [g.detach() for g in torch.autograd.grad(loss, list(model.parameters()))]

    decisions = []
    for r in range(1, cfg.num_rounds + 1):
        resampled = []
        for i in range(n):  # line 4: G_r^i on a fresh minibatch at the global point
            idx = torch.from_numpy(round_batches(parts[i], seed=resample_seed(cfg.seed), partition_id=i,
                                                 server_round=r, local_steps=1, batch_size=b)[0])
            resampled.append(gradient(x_bar, idx))
        g_r = [sum(g[j] for g in resampled) / n for j in range(len(x_bar))]  # line 5
        norm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in g_r))
        clipping = norm >= clip / lr  # line 6: one decision for the round (>= as the authors' code)
        decisions.append(clipping)
        finals = []
        for i in range(n):
            x = [t.clone() for t in x_bar]
            batches = round_batches(parts[i], seed=cfg.seed, partition_id=i, server_round=r, local_steps=steps,
                                    batch_size=b)
            for s in range(steps):
                g = gradient(x, torch.from_numpy(batches[s]))
                d = [g[j] + wd * x[j] + (g_r[j] - resampled[i][j]) for j in range(len(x))]
                d_norm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in d))
                x = [x[j] - (clip / d_norm * d[j] if clipping else lr * d[j]) for j in range(len(x))]
            finals.append(x)
        x_bar = [sum(x[j] for x in finals) / n for j in range(len(x_bar))]
    names = [k for k, _ in model.named_parameters()]
    return dict(zip(names, x_bar, strict=True)), decisions


@pytest.mark.parametrize("n, clip", [(3, 0.05), (3, 5.0), (1, 0.05), (1, 5.0)])
def test_flower_path_equals_the_papers_algorithm(tmp_path, mlp_digits, mlp, n, clip):
    """N = 3 or 1 clients, I = 3, R = 2; clip 0.05 makes every round clip, 5.0 none."""
    values, grid, header, rows, fed = run_flower(
        tmp_path, "ep", n, **{"local-steps": 3, "num-rounds": 2, "batch-size": 8, "lr": 0.2, "clip": clip,
                              "weight-decay": 1e-3})
    ref, decisions = reference(values, local_round.partitions(RunConfig.from_mapping(values)))
    assert decisions == [clip < 1.0] * 2  # both the clipping and the non-clipping branch are exercised
    assert [r["clip-fraction"] for r in rows[1:]] == [float(d) for d in decisions]
    for k, v in ref.items():
        assert torch.allclose(fed[k], v, atol=1e-6, rtol=1e-5), k
    sent = [unpack(m.content)[0] for m in grid.sent if m.metadata.message_type == "train"]  # as the client reads them
    modes = [c["config"]["mode"] for c in sent]
    assert modes == ([RESAMPLE_MODE] * n + ["episode"] * n) * 2  # two exchanges a round
    corrections = [c[CORRECTION_KEY].to_torch_state_dict() for c in sent if CORRECTION_KEY in c]
    if n == 1:  # the reduction: no correction, SGD or normalised SGD chosen by |G_r|
        assert all(torch.count_nonzero(t) == 0 for c in corrections for t in c.values())
    else:
        assert any(torch.count_nonzero(t) > 0 for c in corrections for t in c.values())
    # bytes: the model down twice, the correction down, gradients + buffers up, the model up
    model_bytes = header["model-bytes"]
    trainable = sum(p.numel() * p.element_size() for p in mlp().parameters())  # the mlp_digits model
    assert rows[-1]["bytes-sent"] == n * (2 * model_bytes + trainable)
    assert rows[-1]["bytes-received"] == 2 * n * model_bytes
    assert rows[-1]["resample-failures"] == 0 and rows[-1]["global-grad-norm"] > 0


def test_identical_client_data_gives_no_correction(tmp_path, mlp_digits, monkeypatch):
    """Three clients holding the same 64 examples at full batch: every G_r^i is the same
    gradient, c_i = 0 (to summation order), and EPISODE is plain (normalised) gradient descent."""
    cfg_values = {"local-steps": 2, "num-rounds": 2, "batch-size": 64, "lr": 0.2, "clip": 0.05}
    same = None

    def identical(cfg):
        nonlocal same
        same = local_round.partitions(cfg)[0][:64]
        return (same,) * cfg.num_clients

    monkeypatch.setattr(client.local_round, "partitions", identical)
    values, grid, _, rows, fed = run_flower(tmp_path, "same", 3, **cfg_values)
    sent = [unpack(m.content)[0] for m in grid.sent]  # as the client reads them
    corrections = [c[CORRECTION_KEY].to_torch_state_dict() for c in sent if CORRECTION_KEY in c]
    assert len(corrections) == 6
    assert max(float(t.abs().max()) for c in corrections for t in c.values()) < 1e-6
    assert [r["clip-fraction"] for r in rows[1:]] == [1.0, 1.0]
    ref, decisions = reference(values, [same])  # one client: N = 1 on the same data
    assert decisions == [True, True]
    for k, v in ref.items():
        assert torch.allclose(fed[k], v, atol=1e-6, rtol=1e-5), k


def test_a_client_whose_resample_failed_is_left_out(tmp_path, mlp_digits):
    def flaky(msg, context):
        if msg.metadata.message_type == "train" and msg.content["config"].get("mode") == RESAMPLE_MODE \
                and context.node_config["partition-id"] == 1:
            return Message(Error(code=0, reason="resample failed"), reply_to=msg)
        return client_app(msg, context)

    values = {**RunConfig().to_mapping(), "algorithm": "episode", "num-clients": 3, "device": "cpu", "local-steps": 2,
              "num-rounds": 1, "min-replies": 2, "results-dir": str(tmp_path), "run-name": "flaky", "node-wait": 2.0}
    grid = LoopbackGrid(flaky, values, 3)
    run_server_app(server_app, grid)
    _, rows = read_results(tmp_path / "flaky" / "results.jsonl")
    second = [m for m in grid.sent if m.metadata.message_type == "train" and CORRECTION_KEY in unpack(m.content)[0]]
    assert sorted(m.metadata.dst_node_id for m in second) == [1000, 1002]
    assert rows[1]["replies"] == 2 and rows[1]["resample-failures"] == 1


def test_an_unsound_resample_is_rejected_and_named_in_the_rows(tmp_path, mlp_digits):
    """A resampled gradient holding NaN: rejected before G_r (the client is left out of the round),
    its reason kept in the round's row beside the second exchange's, and the run goes on."""
    def lying(msg, context):
        reply = client_app(msg, context)
        if msg.metadata.message_type == "train" and msg.content["config"].get("mode") == RESAMPLE_MODE \
                and context.node_config["partition-id"] == 1:
            content = unpack(reply.content)[0]  # the lie in the reply's own wire format
            grads = content["grads"].to_torch_state_dict()
            grads[next(iter(grads))].fill_(float("nan"))
            content["grads"] = ArrayRecord(grads)
            reply.content = pack(content)
        return reply

    values = {**RunConfig().to_mapping(), "algorithm": "episode", "num-clients": 3, "device": "cpu", "local-steps": 2,
              "num-rounds": 2, "min-replies": 2, "results-dir": str(tmp_path), "run-name": "lying", "node-wait": 2.0}
    run_server_app(server_app, LoopbackGrid(lying, values, 3))
    _, rows = read_results(tmp_path / "lying" / "results.jsonl")
    for row in rows[1:]:
        assert row["replies"] == 2 and row["resample-failures"] == 1 and row["rejected-replies"] == 0
        assert any(f.startswith("partition 1: episode-resample rejected, grads: ") and "non-finite" in f
                   for f in row["failures"]), row["failures"]


CASE = {"algorithm": "episode", "local-steps": 3, "num-rounds": 2, "weight-decay": 1e-3, "momentum": 0.5,
        "clip": 0.5}


def test_engine_equals_flower_bit_for_bit(runs):
    """The default digits CNN (BatchNorm: the resample's forward pass must not move the buffers)."""
    flower_run = runs.flower("flower", **CASE)
    runs.same(flower_run, runs.engine("engine", "auto", **CASE), exact=True)
    _, (_, rows) = flower_run
    assert [r["clip-fraction"] for r in rows[1:]] in ([1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0])


def test_engine_vmap_path_refuses_episode(tmp_path):
    cfg = RunConfig.from_mapping({**CASE, "num-clients": 2, "device": "cpu", "results-dir": str(tmp_path)})
    with pytest.raises(ValueError, match="engine-path=vmap does not run algorithm 'episode'"):
        run_engine(cfg, EngineOptions(path="vmap"), show_progress=False)


def test_config_and_strategy_choices():
    strategy = build_strategy(RunConfig.from_mapping({"algorithm": "episode", "local-steps": 4, "num-clients": 2}), 100)
    assert strategy.algorithm.name == "episode" and strategy.local_steps == 4
    with pytest.raises(ValueError, match="client-state = \"reset\""):
        RunConfig.from_mapping({"algorithm": "episode", "task": "ptb"})
    RunConfig.from_mapping({"algorithm": "episode", "task": "ptb", "client-state": "reset"})
    with pytest.raises(ValueError, match="resample_timeout must be > 0"):
        EPISODE(local_steps=2, lr=0.1, resample_timeout=0)


def test_engine_equals_flower_with_partial_participation(runs):
    """K of M clients a round (strategies.core.client_sampling): only they resample and train."""
    case = {**CASE, "num-clients": 4, "clients-per-round": 2}
    flower_run = runs.flower("flower-pp", **case)
    runs.same(flower_run, runs.engine("engine-pp", "auto", **case), exact=True)
    _, (_, rows) = flower_run
    assert all(r["replies"] == 2 for r in rows[1:])


def test_an_honest_heterogeneous_run_is_never_rejected_and_equals_the_engine(runs):
    """EPISODE bounds a reply only in a round that clips (I clip); in a round that does not, an
    honest client with skewed data moves as far as its corrected steps take it -- here well
    beyond I clip, which a CELGC-style filter rejected (main before the algorithm layer: "moved
    4.29 ... more than the 4.00 that 8 clipped steps allow"). The run completes, every reply
    sound, and the engine gives the same run bit for bit."""
    moved: dict[int, list[float]] = {}

    def measuring(msg, context):
        reply = client_app(msg, context)
        config = msg.content["config"] if msg.metadata.message_type == "train" else {}
        if config.get("mode") == "episode":
            glob = unpack(msg.content)[0]["arrays"].to_torch_state_dict()
            state = unpack(reply.content)[0]["arrays"].to_torch_state_dict()
            keys = [k for k in glob if k.endswith(("weight", "bias")) and "running" not in k]
            ratio = bound.displacement(state, glob, keys) / (config["local-steps"] * config["clip"])
            moved.setdefault(config["server-round"], []).append(ratio)
        return reply

    case = {**CASE, "num-clients": 6, "num-rounds": 3, "local-steps": 8, "batch-size": 32, "lr": 0.3, "clip": 0.5,
            "momentum": 0.0, "weight-decay": 0.0, "partitioner": "dirichlet", "dirichlet-alpha": 0.3}
    values = runs.values("honest", **case)
    run_server_app(server_app, LoopbackGrid(measuring, values, 6))
    flower_run = runs.read("honest")
    rows = flower_run[1][1]
    assert all(r["rejected-replies"] == 0 and r["replies"] == 6 and "failures" not in r for r in rows[1:]), rows
    calm = [r["round"] for r in rows[1:] if r["clip-fraction"] == 0.0]
    assert calm and len(calm) < 3, [r["global-grad-norm"] for r in rows[1:]]  # rounds of both kinds happened
    assert max(max(moved[r]) for r in calm) > 1.0  # and an honest reply moved beyond I clip in it
    for r in rows[1:]:
        if r["clip-fraction"] == 1.0:  # a clipping round: within I clip (the bound the filter checks)
            assert max(moved[r["round"]]) <= 1.0 + 1e-5
    runs.same(flower_run, runs.engine("honest-engine", "auto", **case), exact=True)
