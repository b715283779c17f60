"""Naive parallel clipping: the server step by hand, reply checks, and the exact equivalence
N clients x batch b == one machine x batch N*b, through the real ServerApp and ClientApp."""

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import nn

import client.local_round as client_round
import tasks as local_round
import tasks.digits
from client.app import app as client_app
from server.app import app as server_app
from server.app import build_strategy, initial_model
from simulations.loopback import LoopbackGrid, run_server_app
from strategies import NaiveParallelClip
from strategies.core.clipped_sgd import StepConfig, clipped_sgd_step
from strategies.core.local_update import RoundSettings
from tasks import load_task
from tasks.config import RunConfig
from tasks.runs.results import load_weights, read_results
from tasks.sampling import round_batches


class Reply:
    """What aggregate_train reads from a reply Message."""

    def __init__(self, content, node=1):
        self.content = content
        self.error = None
        self.metadata = type("M", (), {"src_node_id": node})()

    def has_error(self):
        return False


def grad_reply(grad, buffers=None, n=4, **metrics):
    m = {"num-examples": n, "num-steps": 1, "train-loss": 1.0, "grad-norm": 1.0, "skipped-steps": 0, **metrics}
    return Reply(RecordDict({"grads": ArrayRecord(grad), "buffers": ArrayRecord(buffers or {}),
                             "metrics": MetricRecord(m)}))


def configure(s, server_round, state):
    """The round's configure_train on a grid of num_clients nodes: the global model the replies answer."""
    grid = LoopbackGrid(lambda m, c: None, {}, s.num_clients)
    return list(s.configure_train(server_round, ArrayRecord({k: v.clone() for k, v in state.items()}), ConfigRecord(),
                                  grid))


def naive(x0, **kw):
    s = NaiveParallelClip(**{"lr": 0.5, "clip": 1.0, "batch_size": 4, "num_clients": 2, **kw})
    configure(s, 1, x0)
    return s


def test_server_averages_gradients_and_clips_the_step():
    x0 = {"w": torch.tensor([1.0, 1.0]), "bn.mean": torch.tensor([0.0]), "bn.n": torch.tensor(2)}
    s = naive(x0)
    replies = [grad_reply({"w": torch.tensor([6.0, 0.0])}, {"bn.mean": torch.tensor([1.0]), "bn.n": torch.tensor(3)}),
               grad_reply({"w": torch.tensor([0.0, 8.0])}, {"bn.mean": torch.tensor([3.0]), "bn.n": torch.tensor(3)})]
    arrays, metrics = s.aggregate_train(1, replies)
    out = arrays.to_torch_state_dict()
    # g_bar = (3, 4), |g_bar| = 5: step size min(0.5, 1/5) = 0.2 -> x = (1, 1) - 0.2 (3, 4)
    assert torch.allclose(out["w"], torch.tensor([0.4, 0.2]))
    assert out["bn.mean"].item() == 2.0 and out["bn.n"].item() == 3 and out["bn.n"].dtype == torch.int64
    assert metrics["grad-norm"] == pytest.approx(5.0) and metrics["clip-fraction"] == 1.0
    assert metrics["replies"] == 2 and metrics["client-grad-norm"] == 1.0
    nbytes = 2 * 4 + 4 + 8
    assert metrics["bytes-sent"] == 2 * nbytes and metrics["bytes-received"] == 2 * nbytes


def test_small_gradient_is_not_clipped_and_weight_decay_and_lr_scale_apply():
    x0 = {"w": torch.tensor([2.0])}
    s = naive(x0, weight_decay=0.1)
    arrays, metrics = s.aggregate_train(1, [grad_reply({"w": torch.tensor([0.5])}, **{"lr-scale": 0.5})])
    # |g| = 0.5, scaled lr 0.25 < clip 0.5 / 0.5: x = 2 - 0.25 (0.5 + 0.1 * 2)
    assert arrays.to_torch_state_dict()["w"].item() == pytest.approx(2 - 0.25 * 0.7)
    assert metrics["clip-fraction"] == 0.0 and metrics["skipped-steps"] == 0


def test_examples_weighting_and_schedule():
    x0 = {"w": torch.tensor([0.0])}
    s = naive(x0, clip=math.inf, aggregation="examples", lr_milestones=(1.0,), train_size=8, lr_decay=0.5)
    cfg = s.round_config(1, 2)
    assert cfg["mode"] == "gradient" and cfg["local-steps"] == 1
    assert s.round_config(2, 2)["lr"] == 0.25  # 2 clients x batch 4 = one epoch of 8 done
    arrays, _ = s.aggregate_train(1, [grad_reply({"w": torch.tensor([1.0])}, n=1),
                                      grad_reply({"w": torch.tensor([4.0])}, n=3)])
    assert arrays.to_torch_state_dict()["w"].item() == pytest.approx(-0.5 * (0.25 + 3.0))


def test_bad_replies_are_rejected_not_applied():
    x0 = {"w": torch.tensor([1.0, 1.0])}
    s = naive(x0)
    bad = [grad_reply({"w": torch.tensor([float("nan"), 0.0])}, node=2),
           grad_reply({"w": torch.zeros(3)}, node=3),
           Reply(RecordDict({"arrays": ArrayRecord({"w": torch.zeros(2)}),
                             "metrics": MetricRecord({"num-examples": 1})}), node=4)]
    arrays, metrics = s.aggregate_train(1, bad)
    assert arrays is None and metrics["rejected-replies"] == 3 and metrics["replies"] == 0
    arrays, metrics = s.aggregate_train(1, bad + [grad_reply({"w": torch.tensor([0.1, 0.0])})])
    assert metrics["rejected-replies"] == 3 and torch.allclose(arrays.to_torch_state_dict()["w"], torch.tensor([0.95, 1.0]))


def test_server_momentum_is_torch_sgd_on_the_averaged_gradient():
    x0 = {"w": torch.tensor([1.0, -2.0])}
    s = naive(x0, clip=math.inf, momentum=0.9, num_clients=1)
    ref = torch.tensor([1.0, -2.0], requires_grad=True)
    opt = torch.optim.SGD([ref], lr=0.5, momentum=0.9)
    state = x0
    for r, g in enumerate([torch.tensor([1.0, 2.0]), torch.tensor([-1.0, 0.5]), torch.tensor([0.3, 0.3])], 1):
        if r > 1:
            configure(s, r, state)
        arrays, _ = s.aggregate_train(r, [grad_reply({"w": g})])
        state = arrays.to_torch_state_dict()
        ref.grad = g.clone()
        opt.step()
    assert torch.allclose(state["w"], ref.detach())


def test_naive_takes_no_local_steps_and_server_picks_it():
    with pytest.raises(TypeError, match="no local_steps"):
        NaiveParallelClip(lr=0.1, local_steps=2)
    cfg = RunConfig.from_mapping({"algorithm": "naive", "local-steps": 1, "clip": 0.5})
    built = build_strategy(cfg, 100)
    assert built.algorithm.name == "naive" and type(built).__name__ == "NaiveParallelClip"
    assert build_strategy(cfg.replace(algorithm="celgc"), 100).algorithm.name == "celgc"


def test_gradient_round_returns_gradients_and_batchnorm_buffers():
    cfg = RunConfig.from_mapping({"num-clients": 2, "device": "cpu"})
    model = initial_model(load_task(cfg), 0)
    settings = RoundSettings.from_config({"server-round": 3, "local-steps": 1, "batch-size": 16, "lr": 0.1, "clip": 1.0,
                                          "weight-decay": 0.0, "momentum": 0.0, "mode": "gradient"})
    grads, buffers, metrics = client_round.gradient_round(cfg, 1, settings, model.state_dict())
    assert set(grads) == {k for k, _ in model.named_parameters()}
    assert set(buffers) == set(model.state_dict()) - set(grads)
    assert not torch.equal(buffers["features.1.running_mean"], model.state_dict()["features.1.running_mean"])
    assert metrics["num-examples"] == 16 and metrics["num-steps"] == 1 and metrics["grad-norm"] > 0


@pytest.mark.parametrize("clip, momentum", [(0.5, 0.0), ("off", 0.5)])
def test_n_clients_equal_one_machine_at_batch_n_b(tmp_path, mlp_digits, mlp, clip, momentum):
    n, b, rounds, lr = 4, 8, 6, 0.5
    values = {**RunConfig().to_mapping(), "algorithm": "naive", "local-steps": 1, "num-clients": n,
              "batch-size": b, "num-rounds": rounds, "lr": lr, "clip": clip, "momentum": momentum,
              "weight-decay": 1e-3, "device": "cpu", "results-dir": str(tmp_path), "run-name": "naive",
              "node-wait": 2.0}
    run_server_app(server_app, LoopbackGrid(client_app, values, n))
    header, rows = read_results(tmp_path / "naive" / "results.jsonl")
    assert [r["communication-rounds"] for r in rows] == list(range(rounds + 1))
    assert rows[-1]["bytes-sent"] == n * header["model-bytes"] == rows[-1]["bytes-received"]
    assert 0 < rows[-1]["global-epoch"] == pytest.approx(rounds * n * b / header["train-size"])
    fed = load_weights(tmp_path / "naive" / "model.pt")

    # One machine: clipped SGD at batch n*b on the union of the same samples.
    cfg = RunConfig.from_mapping(values)
    task = load_task(cfg)
    model = initial_model(task, cfg.seed)
    parts = local_round.partitions(cfg)
    params = list(model.parameters())
    step = StepConfig(lr=lr, clip=cfg.clip, weight_decay=1e-3, momentum=momentum)
    bufs = [torch.zeros_like(p) for p in params] if momentum else None
    clipped = 0
    for r in range(1, rounds + 1):
        idx = torch.cat([torch.from_numpy(round_batches(parts[i], seed=cfg.seed, partition_id=i, server_round=r,
                                                        local_steps=1, batch_size=b)[0]) for i in range(n)])
        loss = nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx])
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            new, bufs, stats = clipped_sgd_step(params, list(grads), bufs, step)
            torch._foreach_copy_(params, new)
        clipped += int(stats["clipped"])
    for k, v in model.state_dict().items():
        assert torch.allclose(fed[k], v, atol=1e-6, rtol=1e-5), k
    assert sum(r["clip-fraction"] for r in rows[1:]) == clipped
    if clip == "off":
        assert clipped == 0
    else:
        assert clipped > 0  # the test exercises the clipped branch


def test_naive_with_batchnorm_through_the_server_app(tmp_path):
    values = {**RunConfig().to_mapping(), "algorithm": "naive", "local-steps": 1, "num-clients": 3,
              "num-rounds": 12, "device": "cpu", "results-dir": str(tmp_path), "run-name": "bn", "node-wait": 2.0}
    grid = LoopbackGrid(client_app, values, 3)
    run_server_app(server_app, grid)
    _, rows = read_results(tmp_path / "bn" / "results.jsonl")
    assert rows[-1]["test-accuracy"] > rows[0]["test-accuracy"] + 0.2
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(train) == 3 * 12 and all(m.content["config"]["mode"] == "gradient" for m in train)
    state = load_weights(tmp_path / "bn" / "model.pt")
    assert state["features.1.num_batches_tracked"].item() == 12  # one forward pass a round


def test_naive_replies_without_configure_train_stop_the_round_naming_it():
    from flwr.serverapp.exception import InconsistentMessageReplies

    s = NaiveParallelClip(lr=0.5, clip=1.0, batch_size=4, num_clients=2)
    with pytest.raises(InconsistentMessageReplies, match="configure_train must run first"):
        s.aggregate_train(1, [grad_reply({"w": torch.ones(2)}), grad_reply({"w": torch.ones(2)})])
