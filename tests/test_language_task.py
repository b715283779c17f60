"""The language-model task on the Flower path: windows, partitions, hidden state, lr scale,
determinism, and PTB end to end through the ServerApp and ClientApp (tiny corpus, tiny model)."""

import math

import numpy as np
import pytest
import torch

import client.local_round as client_round
import tasks as local_round
import tasks.language as language
from simulations.loopback import run_in_process
from strategies.core.clipped_sgd import StepConfig, clipped_sgd_step
from strategies.core.local_update import RoundSettings, local_update
from tasks import load_task
from tasks.config import RunConfig
from tasks.runs.results import read_results
from tasks.text import text_regions, text_shards


@pytest.fixture
def tiny_ptb(tiny_lm):
    return tiny_lm(6000)


def cfg_for(tmp_path, **kw):
    values = {"task": "ptb", "data-dir": str(tmp_path / "data"), "num-clients": 2, "batch-size": 2,
              "local-steps": 3, "lr": 5.0, "clip": 0.5, "device": "cpu", "weight-decay": 1.2e-6, **kw}
    return RunConfig.from_mapping(values)


def test_round_windows_walk_the_rows_with_shared_jitter():
    w1 = language.round_windows(10_000, seed=3, server_round=1, local_steps=4, bptt=70)
    w2 = language.round_windows(10_000, seed=3, server_round=2, local_steps=4, bptt=70)
    assert w1 == language.round_windows(10_000, seed=3, server_round=1, local_steps=4, bptt=70)
    assert w1 != language.round_windows(10_000, seed=4, server_round=1, local_steps=4, bptt=70)
    assert w1[0][0] == 0 and w2[0][0] == 4 * 70  # rounds start at (r - 1) I bptt
    for windows in (w1, w2):
        assert [w[3] for w in windows] == [True, False, False, False]  # hidden reset at round start only
        for (i, n, scale, _), (j, _, _, _) in zip(windows, windows[1:]):
            assert j == i + n and n >= 5 and scale == pytest.approx(n / 70)  # back to back, lr ~ seq_len
    lengths = [n for r in range(1, 200) for _, n, _, _ in
               language.round_windows(10**6, seed=0, server_round=r, local_steps=2, bptt=70)]
    assert min(lengths) >= 5 and 60 < np.mean(lengths) < 70 and any(n < 50 for n in lengths)


def test_round_windows_wrap_around_and_reset():
    windows = language.round_windows(101, seed=0, server_round=2, local_steps=4, bptt=20)
    starts = [w[0] for w in windows]
    assert starts[0] == (1 * 4 * 20) % 100
    assert any(w[3] and w[0] == 0 for w in windows[1:])  # wrapped to the start with a fresh state
    assert all(i + n <= 100 for i, n, _, _ in windows)


def test_split_stream_modes():
    stream = torch.arange(10_000)
    assert all(torch.equal(a, b) for a, b in zip(language.split_stream(stream, 4, "homogeneous", block_len=100),
                                                 text_shards(stream, 4, 100)))
    assert all(torch.equal(a, b) for a, b in zip(language.split_stream(stream, 4, "similarity", 0.0, block_len=100),
                                                 text_regions(stream, 4)))
    mixed = language.split_stream(stream, 4, "similarity", 50.0, seed=1, block_len=100)
    assert len({len(p) for p in mixed}) == 1
    flat = torch.cat(mixed)
    assert len(torch.unique(flat)) == len(flat)  # disjoint
    assert all(torch.equal(a, b) for a, b in zip(mixed, language.split_stream(stream, 4, "similarity", 50.0, seed=1,
                                                                               block_len=100)))
    with pytest.raises(ValueError, match="not defined for text"):
        language.split_stream(stream, 4, "dirichlet")


def test_task_batches_carry_hidden_and_scale_the_step(tiny_ptb):
    cfg = cfg_for(tiny_ptb)
    task = load_task(cfg)
    assert task.train_size == task.corpus.train.numel() // 10
    part = local_round.partitions(cfg)[1]
    torch.manual_seed(0)
    model = task.build_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    batches = list(task.round_batches(part, seed=0, partition_id=1, server_round=2, local_steps=3,
                                      batch_size=2, device=torch.device("cpu")))
    assert [b.reset for b in batches] == [True, False, False] and batches[0].carry is batches[1].carry
    assert batches[0].x.shape[1] == 2 and torch.equal(batches[0].x[1:], batches[0].y[:-1])
    step = StepConfig(lr=5.0, clip=0.5, weight_decay=1.2e-6)
    metrics = local_update(model, iter(batches), task.loss, step, count=task.count_examples)
    assert metrics["num-examples"] == 6 and metrics["num-steps"] == 3

    # Replay by hand: same dropout seeds, hidden carried, each step scaled by seq_len / bptt.
    ref = task.build_model()
    ref.load_state_dict(start)
    ref.train()
    params = list(ref.parameters())
    batches = list(task.round_batches(part, seed=0, partition_id=1, server_round=2, local_steps=3,
                                      batch_size=2, device=torch.device("cpu")))
    for b in batches:
        grads = torch.autograd.grad(task.loss(ref, b), params)
        assert all(not h.requires_grad for pair in language.hidden_state(b.carry) for h in pair)
        with torch.no_grad():
            new, _, _ = clipped_sgd_step(params, list(grads), None, step, lr_scale=b.lr_scale)
            torch._foreach_copy_(params, new)
    for k, v in ref.state_dict().items():
        assert torch.allclose(v, model.state_dict()[k], atol=1e-6), k

    # The second window's loss depends on the hidden state carried from the first.
    ref.eval()
    b = batches[1]
    carried = task.loss(ref, b)
    fresh = task.loss(ref, b._replace(reset=True))
    assert not torch.isclose(carried, fresh)


def test_missing_corpus_says_where_to_put_it(tmp_path):
    language._corpus.cache_clear()
    with pytest.raises(FileNotFoundError, match="ptb.train.txt"):
        load_task(RunConfig.from_mapping({"task": "ptb", "data-dir": str(tmp_path)}))


@pytest.mark.parametrize("algorithm, steps, rounds", [("celgc", 3, 3), ("naive", 1, 4)])
def test_ptb_through_server_and_client_apps(tiny_ptb, algorithm, steps, rounds):
    cfg = cfg_for(tiny_ptb, **{"algorithm": algorithm, "local-steps": steps, "num-rounds": rounds,
                               "results-dir": str(tiny_ptb / "res"), "run-name": algorithm, "node-wait": 2.0})
    run_in_process(cfg.to_mapping())
    header, rows = read_results(tiny_ptb / "res" / algorithm / "results.jsonl")
    vocab = len(load_task(cfg).corpus.vocab)
    assert rows[0]["valid-perplexity"] == pytest.approx(vocab, rel=0.3)  # ~uniform at init
    assert rows[-1]["valid-perplexity"] < rows[0]["valid-perplexity"]
    assert all(math.isfinite(r["test-perplexity"]) for r in rows)
    assert rows[-1]["global-epoch"] == pytest.approx(rounds * 2 * steps * 2 / header["train-size"])
    assert rows[-1]["num-examples"] == 2 * steps * 2
    assert rows[-1]["bytes-sent"] == 2 * header["model-bytes"]


def test_rounds_are_deterministic(tiny_ptb):
    cfg = cfg_for(tiny_ptb)
    model = load_task(cfg).build_model()
    state = model.state_dict()
    hp = {"local-steps": 2, "lr": 5.0, "clip": 0.5, "weight-decay": 0.0, "momentum": 0.0, "batch-size": 2}
    settings = RoundSettings.from_config({**hp, "server-round": 5})
    a, ma = client_round.train_round(cfg, 0, settings, state)
    b, mb = client_round.train_round(cfg, 0, settings, state)
    assert ma == mb and all(torch.equal(a[k], b[k]) for k in a)
    c, _ = client_round.train_round(cfg, 1, settings, state)
    assert not torch.equal(a["encoder.weight"], c["encoder.weight"])
