"""Clients that keep their state across rounds (the language model's hidden state and place in
its text): R rounds of I steps with N = 1 (averaging is the identity) equal one round of R*I
steps, hidden state included; the ClientApp keeps the state in Flower's Context.state; the
engine equals the Flower path with state carried; client-state = "reset" is the stateless
round; train-ce is reported apart from the AR/TAR terms."""

import math

import pytest
import torch

import client.local_round as client_round
import tasks
import tasks.language as language
from client.app import app as client_app
from client.app import state_key
from server.app import app as server_app
from simulations.engine import EngineOptions, run_engine
from simulations.loopback import LoopbackGrid, run_server_app
from strategies.core.local_update import RoundSettings
from tasks import initial_model, load_task
from tasks.config import RunConfig
from tasks.runs.results import load_weights, read_results

CPU = torch.device("cpu")


@pytest.fixture
def tiny_ptb(tiny_lm):
    return tiny_lm(160)


def values(tmp_path, **kw):
    return {**RunConfig().to_mapping(), "task": "ptb", "data-dir": str(tmp_path / "data"), "num-clients": 1,
            "batch-size": 2, "local-steps": 3, "num-rounds": 4, "lr": 5.0, "clip": 0.5, "device": "cpu",
            "weight-decay": 1.2e-6, "node-wait": 2.0, "results-dir": str(tmp_path / "res"), **kw}


def hp(cfg, steps, server_round):
    """The round's settings as the strategy sends them."""
    return RoundSettings.from_config({"server-round": server_round, "local-steps": steps, "lr": cfg.lr,
                                      "clip": cfg.clip, "weight-decay": cfg.weight_decay, "momentum": 0.0,
                                      "batch-size": cfg.batch_size})


def rounds(cfg, start, r, steps, keep=True):
    """r rounds of ``steps`` local steps of client 0 (N = 1: the global model is its model)."""
    state, client_state = start, ({} if keep else None)
    for k in range(1, r + 1):
        state, metrics = client_round.train_round(cfg, 0, hp(cfg, steps, k), state, client_state=client_state)
    return state, client_state, metrics


def test_rounds_of_I_steps_equal_one_run_of_R_I_steps(tiny_ptb):
    cfg = RunConfig.from_mapping(values(tiny_ptb))
    task = load_task(cfg)
    start = initial_model(task, cfg.seed).state_dict()
    rows = task._rows(tasks.partitions(cfg)[0], cfg.batch_size, CPU).shape[1]
    assert rows - 1 < 4 * 3 * 9  # 4 x 3 steps of about 10 tokens walk past the end of the rows
    split, split_state, _ = rounds(cfg, start, 4, 3)
    whole, whole_state, _ = rounds(cfg, start, 1, 12)
    assert all(torch.equal(split[k], whole[k]) for k in whole)
    assert set(split_state) == set(whole_state) >= {"position", "pass", "hidden.0.h", "hidden.1.c"}
    assert all(torch.equal(split_state[k], whole_state[k]) for k in whole_state)
    assert int(whole_state["pass"]) == 1  # wrapped once (new pass, zero hidden state) inside the run
    # stateless rounds restart the hidden state (and the place) every round: another model
    reset, none, _ = rounds(cfg, start, 4, 3, keep=False)
    assert none is None and not torch.equal(reset["encoder.weight"], whole["encoder.weight"])


def test_flower_path_carries_state_in_context_and_equals_one_run(tiny_ptb):
    vals = values(tiny_ptb, **{"run-name": "keep"})
    cfg = RunConfig.from_mapping(vals)
    grid = LoopbackGrid(client_app, vals, 1)
    run_server_app(server_app, grid)
    fed = load_weights(tiny_ptb / "res" / "keep" / "model.pt")
    whole, whole_state, _ = rounds(cfg, initial_model(load_task(cfg), cfg.seed).state_dict(), 1, 12)
    assert all(torch.equal(fed[k], whole[k]) for k in whole)
    (context,) = grid.contexts.values()
    kept = context.state[state_key(0)].to_torch_state_dict()
    assert all(torch.equal(kept[k], whole_state[k]) for k in whole_state)
    header, rows = read_results(tiny_ptb / "res" / "keep" / "results.jsonl")
    assert header["config"]["client-state"] == "keep"
    for row in rows[1:]:  # the cross-entropy alone, below the loss with AR/TAR
        assert math.isfinite(row["train-ce"]) and 0 < row["train-ce"] < row["train-loss"]


def test_reset_switch_is_the_stateless_round(tiny_ptb):
    vals = values(tiny_ptb, **{"run-name": "reset", "client-state": "reset"})
    cfg = RunConfig.from_mapping(vals)
    grid = LoopbackGrid(client_app, vals, 1)
    run_server_app(server_app, grid)
    fed = load_weights(tiny_ptb / "res" / "reset" / "model.pt")
    reset, _, _ = rounds(cfg, initial_model(load_task(cfg), cfg.seed).state_dict(), 4, 3, keep=False)
    assert all(torch.equal(fed[k], reset[k]) for k in reset)
    assert all(len(c.state) == 0 for c in grid.contexts.values())  # nothing kept


def test_a_restarted_client_starts_from_zero(tiny_ptb):
    cfg = RunConfig.from_mapping(values(tiny_ptb))
    start = initial_model(load_task(cfg), cfg.seed).state_dict()
    state, kept, _ = rounds(cfg, start, 2, 3)
    before = int(kept["position"])
    fresh: dict = {}
    fresh_round, _ = client_round.train_round(cfg, 0, hp(cfg, 3, 3), state, client_state=fresh)
    kept_round, _ = client_round.train_round(cfg, 0, hp(cfg, 3, 3), state, client_state=kept)
    assert int(fresh["position"]) < before < int(kept["position"])  # the restarted one: back at the start
    assert not torch.equal(fresh_round["encoder.weight"], kept_round["encoder.weight"])


@pytest.mark.parametrize("case", [{"local-steps": 2}, {"algorithm": "naive", "local-steps": 1}])
def test_engine_equals_flower_with_state_carried(tiny_ptb, case):
    vals = values(tiny_ptb, **{"num-clients": 2, "num-rounds": 5, "run-name": "flower", **case})
    run_server_app(server_app, LoopbackGrid(client_app, vals, 2))
    f_state = load_weights(tiny_ptb / "res" / "flower" / "model.pt")
    _, f_rows = read_results(tiny_ptb / "res" / "flower" / "results.jsonl")
    cfg = RunConfig.from_mapping({**vals, "run-name": "engine"})
    result = run_engine(cfg, EngineOptions(path="sequential"), show_progress=False)
    assert all(torch.equal(result.state[k], f_state[k]) for k in f_state)
    _, e_rows = read_results(tiny_ptb / "res" / "engine" / "results.jsonl")
    for f, e in zip(f_rows[1:], e_rows[1:], strict=True):
        assert e["train-ce"] == pytest.approx(f["train-ce"], rel=1e-6)
        assert e["valid-loss"] == pytest.approx(f["valid-loss"], rel=1e-6)
    # the same run with stateless clients ends elsewhere: the state did travel
    stateless = run_engine(RunConfig.from_mapping({**vals, "run-name": "e2", "client-state": "reset"}),
                           EngineOptions(path="sequential"), show_progress=False)
    assert not torch.equal(stateless.state["encoder.weight"], f_state["encoder.weight"])


def test_contiguous_split_rotates_regions_every_pass(tiny_ptb):
    """text-split = contiguous: N contiguous regions; client k reads region (k + e) mod N in
    its pass e, with a zero hidden state at the start of each pass (the authors' split)."""
    stream = torch.arange(1000)
    parts = language.rotated_regions(stream, 4)
    regions = stream.view(4, 250)
    for k, part in enumerate(parts):
        assert torch.equal(part.view(4, 250), regions[[(k + e) % 4 for e in range(4)]])
    cfg = RunConfig.from_mapping(values(tiny_ptb, **{"num-clients": 2, "text-split": "contiguous"}))
    task = load_task(cfg)
    assert task.regions == 2
    part = tasks.partitions(cfg)[1]
    half = task.corpus.train.numel() // 2
    assert torch.equal(part, torch.cat([task.corpus.train[half:2 * half], task.corpus.train[:half]]))
    rows = task._rows(part, 2, CPU)  # [regions, T, b]
    state: dict = {}
    seen = []
    for r in range(1, 40):
        for b in task.round_batches(part, seed=0, partition_id=1, server_round=r, local_steps=3, batch_size=2,
                                    device=CPU, state=state):
            p, i = int(state["pass"]), int(state["position"]) - b.x.shape[0]
            assert torch.equal(b.x, rows[p % 2, i : i + b.x.shape[0]])
            seen.append((p, b.reset))
            task.loss(task.build_model(), b)
    passes = sorted({p for p, _ in seen})
    assert passes[:3] == [0, 1, 2]  # region 1, then region 0, then region 1 again
    assert all(reset == (k > 0 and seen[k - 1][0] != p) for k, (p, reset) in enumerate(seen))
