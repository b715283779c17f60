"""The executors against one client at a time (``strategies.core.local_update.local_update``), the
one averaging (``strategies.methods.reduce``) against ``strategies.core.averaging``, naive parallel clipping
against one machine at batch N*b, and the fallback for models vmap cannot take (nn.LSTM). No
flwr needed."""

import copy
import dataclasses
import math

import pytest
import torch
from torch import nn

from simulations.engine import EngineOptions, run_engine
from strategies.core.averaging import average_states, client_weights
from strategies.core.client_metrics import COLUMNS
from strategies.core.clipped_sgd import StepConfig, clipped_sgd_step
from strategies.core.local_update import RoundStats, local_update
from strategies.methods import reduce
from strategies.methods.executors import SequentialClients, VmapClients
from strategies.methods.reduce import ClientResults
from tasks.classification import ClassificationTask
from tasks.config import RunConfig
from tasks.digits import DigitsCNN, digits_task
from tasks.partition import partition
from tasks.sampling import round_batches

N, STEPS, B = 4, 3, 16
WEIGHTS = (0.1, 0.5, 1.0, 3.0)  # loss weights: very different gradient norms -> per-client clipping differs


def client_batches(task, k):
    g = torch.Generator().manual_seed(100 + k)
    idx = torch.randint(0, task.train_size, (STEPS, B), generator=g)
    return [(task.train_x[i], task.train_y[i], torch.tensor(WEIGHTS[k])) for i in idx]


def weighted_loss(model, batch):
    x, y, w = batch
    return nn.functional.cross_entropy(model(x), y) * w


def reference(model, task, cfg):
    """One client at a time through local_update: (states, metrics)."""
    states, metrics = [], []
    for k in range(N):
        m = copy.deepcopy(model)
        metrics.append(local_update(m, client_batches(task, k), weighted_loss, cfg))
        states.append(m.state_dict())
    return states, metrics


@pytest.mark.parametrize("wd, mu", [(0.0, 0.0), (1e-3, 0.9)])
def test_vmap_equals_one_client_at_a_time(wd, mu):
    task = digits_task()
    torch.manual_seed(0)
    model = DigitsCNN()
    cfg = StepConfig(lr=0.3, clip=1.5, weight_decay=wd, momentum=mu)
    states, metrics = reference(model, task, cfg)
    clients = VmapClients(copy.deepcopy(model), weighted_loss, N)
    clients.load(model.state_dict())
    totals = clients.run_round([iter(client_batches(task, k)) for k in range(N)], cfg)
    stacked = clients.stacked_state()
    for k in range(N):
        for key, ref in states[k].items():  # parameters, running_mean/var, num_batches_tracked
            assert stacked[key][k].dtype == ref.dtype
            assert torch.allclose(stacked[key][k].double(), ref.double(), atol=1e-5, rtol=0), (k, key)
    assert int(stacked["features.1.num_batches_tracked"][0]) == STEPS
    table = totals.table()
    column = lambda name: table[:, COLUMNS.index(name)]  # noqa: E731
    for k, m in enumerate(metrics):
        assert column("clip-fraction")[k].item() == m["clip-fraction"]
        assert column("grad-norm")[k].item() == pytest.approx(m["grad-norm"], rel=1e-5)
        assert column("train-loss")[k].item() == pytest.approx(m["train-loss"], rel=1e-5)
        assert column("num-examples")[k].item() == m["num-examples"] == STEPS * B
    fractions = {m["clip-fraction"] for m in metrics}
    assert 0.0 in fractions and 1.0 in fractions  # the test exercises per-client clipping both ways


def test_sequential_path_is_local_update_bit_for_bit():
    task = digits_task()
    torch.manual_seed(1)
    model = DigitsCNN()
    cfg = StepConfig(lr=0.3, clip=1.5, weight_decay=1e-3, momentum=0.5)
    states, metrics = reference(model, task, cfg)
    clients = SequentialClients(lambda: copy.deepcopy(model), weighted_loss, N, torch.device("cpu"))
    clients.load(model.state_dict())
    totals = clients.run_round([iter(client_batches(task, k)) for k in range(N)], cfg)
    stacked = clients.stacked_state()
    for k in range(N):
        assert all(torch.equal(stacked[key][k], ref) for key, ref in states[k].items())
        assert totals[k].as_metrics() == metrics[k]


def test_bf16_and_channels_last_against_fp32():
    task = digits_task()
    torch.manual_seed(2)
    model = DigitsCNN()
    cfg = StepConfig(lr=0.1, clip=math.inf)
    out, loss = {}, {}
    for name, kw in {"fp32": {}, "bf16": {"bf16": True}, "cl": {"channels_last": True}}.items():
        clients = VmapClients(copy.deepcopy(model), weighted_loss, N, **kw)
        clients.load(model.state_dict())
        loss[name] = clients.run_round([iter(client_batches(task, k)[:2]) for k in range(N)], cfg).loss_sum
        out[name] = clients.stacked_state()
    init = model.state_dict()
    err = ref = 0.0
    for key, value in out["fp32"].items():
        assert torch.allclose(out["cl"][key].double(), value.double(), atol=1e-4, rtol=0), key  # other conv kernels
        assert out["bf16"][key].dtype == value.dtype, key  # the update stays fp32
        if value.is_floating_point():
            step = value.double() - init[key].double()
            err += (out["bf16"][key].double() - init[key].double() - step).square().sum().item()
            ref += step.square().sum().item()
    assert math.sqrt(err / ref) < 0.1  # bf16 forward/backward: the update within 10% of fp32's
    assert torch.allclose(loss["bf16"], loss["fp32"], rtol=1e-2)


def test_the_one_average_is_strategies_averaging_and_rejects_nonfinite(monkeypatch):
    g = torch.Generator().manual_seed(0)
    like = {"w": torch.zeros(3, 2), "bn.mean": torch.zeros(2), "bn.n": torch.zeros((), dtype=torch.int64)}
    states = [{"w": torch.randn(3, 2, generator=g), "bn.mean": torch.randn(2, generator=g),
               "bn.n": torch.tensor(k + 2)} for k in range(4)]
    states[2]["w"][0, 0] = float("nan")  # rejected, as check_state rejects a non-finite reply
    stacked = {k: torch.stack([s[k] for s in states]) for k in like}
    stats = []
    for k in range(4):
        s = RoundStats.zeros("cpu")
        for step in range(2):
            s.add(torch.tensor(1.0 + k), {"grad-norm": torch.tensor(2.0 + step), "clipped": torch.tensor(float(k % 2)),
                                          "skipped": torch.tensor(0.0)}, 8 * (k + 1))
        stats.append(s)
    for aggregation, form, limit in (("uniform", stacked, 0), ("examples", stacked, 0), ("uniform", states, 0),
                                     ("examples", states, 0), ("uniform", states, 1 << 24)):
        # stacked clients (one matmul) or a list of client states (streamed, for large models): the same
        monkeypatch.setattr(reduce, "STACK_LIMIT", limit)
        table = torch.cat([s.table() for s in stats])
        results = ClientResults([0, 1, 2, 3], {"arrays": form}, table, table[:, COLUMNS.index("num-examples")])
        average = reduce.mean(results, {"arrays": like}, aggregation=aggregation, expected=4)
        avg = average.arrays["arrays"]
        metrics = {"replies": average.replies, "rejected-replies": 4 - average.replies, **average.metrics}
        sound = [0, 1, 3]
        ref = average_states([states[k] for k in sound],
                             client_weights([stats[k].examples for k in sound], aggregation))
        for key in like:
            assert avg[key].dtype == like[key].dtype
            assert torch.allclose(avg[key].double(), ref[key].double(), atol=1e-7), key
        rounded = {"uniform": round((2 + 3 + 5) / 3), "examples": round((16 * 2 + 32 * 3 + 64 * 5) / 112)}
        assert avg["bn.n"].item() == rounded[aggregation]  # integer buffer: rounded mean, dtype kept
        assert metrics["replies"] == 3 and metrics["rejected-replies"] == 1
        assert metrics["num-examples"] == 2 * 8 * (1 + 2 + 4) and metrics["num-steps"] == 6
        assert metrics["train-loss"] == pytest.approx((1 + 2 + 4) / 3)
        assert metrics["clip-fraction"] == pytest.approx(2 / 3) and metrics["grad-norm"] == pytest.approx(2.5)


@pytest.mark.parametrize("path", ["vmap", "sequential"])
@pytest.mark.parametrize("clip, momentum", [(0.5, 0.0), ("off", 0.5)])
def test_naive_equals_one_machine_at_batch_n_b(path, clip, momentum, mlp):
    """N clients x batch b, gradients averaged, one clipped step == clipped SGD at batch N*b
    on the union of the same samples (a BatchNorm-free model: no batch statistics)."""
    n, b, rounds = 4, 8, 5
    task = dataclasses.replace(digits_task(), build_model=mlp)
    cfg = RunConfig.from_mapping({"algorithm": "naive", "local-steps": 1, "num-clients": n, "batch-size": b,
                                  "num-rounds": rounds, "lr": 0.5, "clip": clip, "momentum": momentum,
                                  "weight-decay": 1e-3, "device": "cpu", "eval-every": rounds})
    parts = partition(task.labels, n, "homogeneous", cfg.seed)
    result = run_engine(cfg, EngineOptions(path=path), task=task, parts=parts, write_results=False,
                        show_progress=False)
    assert result.path == path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = mlp()
    params = list(model.parameters())
    step = StepConfig(lr=0.5, clip=cfg.clip, weight_decay=1e-3, momentum=momentum)
    bufs = [torch.zeros_like(p) for p in params] if momentum else None
    clipped = 0
    for r in range(1, rounds + 1):
        idx = torch.cat([torch.from_numpy(round_batches(parts[i], seed=cfg.seed, partition_id=i, server_round=r,
                                                        local_steps=1, batch_size=b)[0]) for i in range(n)])
        loss = nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx])
        with torch.no_grad():
            new, bufs, stats = clipped_sgd_step(params, list(torch.autograd.grad(loss, params)), bufs, step)
            torch._foreach_copy_(params, new)
        clipped += int(stats["clipped"])
    for key, value in model.state_dict().items():
        assert torch.allclose(result.state[key], value, atol=1e-6, rtol=1e-5), key
    assert sum(row["clip-fraction"] for row in result.rows[1:]) == clipped
    assert clipped == 0 if clip == "off" else clipped > 0


def test_lstm_model_falls_back_to_per_client_and_stays_exact(tiny_text):
    TinyTextTask, TinyLSTM = tiny_text, tiny_text.model
    g = torch.Generator().manual_seed(0)
    streams = [torch.randint(0, 12, (100,), generator=g) for _ in range(3)]
    task = TinyTextTask(streams)
    cfg = RunConfig.from_mapping({"num-clients": 3, "num-rounds": 2, "local-steps": 2, "batch-size": 4,
                                  "device": "cpu", "lr": 0.5, "clip": 0.2})
    result = run_engine(cfg, task=task, parts=streams, write_results=False, show_progress=False)
    assert result.path == "sequential"
    probe = VmapClients(TinyLSTM(), task.loss, 3)
    probe.load(TinyLSTM().state_dict())
    batches = [next(task.round_batches(s, seed=0, partition_id=i, server_round=1, local_steps=1, batch_size=4,
                                       device="cpu")) for i, s in enumerate(streams)]
    assert "no vmap batching rule" in probe.probe(batches, StepConfig(lr=0.5))  # what auto reports on CUDA
    # reference: every client through local_update, uniform average, two rounds
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        state = TinyLSTM().state_dict()
    for r in (1, 2):
        states = []
        for pid, stream in enumerate(streams):
            m = TinyLSTM()
            m.load_state_dict(state)
            local_update(m, task.round_batches(stream, seed=0, partition_id=pid, server_round=r, local_steps=2,
                                               batch_size=4, device="cpu"), task.loss, StepConfig(lr=0.5, clip=0.2))
            states.append(m.state_dict())
        state = average_states(states, [1 / 3] * 3)
    for key, value in state.items():
        assert torch.allclose(result.state[key], value, atol=1e-6, rtol=0), key
    with pytest.raises(RuntimeError, match="engine-path=vmap but this model cannot run under torch.func.vmap"):
        run_engine(cfg, EngineOptions(path="vmap"), task=task, parts=streams, write_results=False,
                   show_progress=False)


def test_random_model_goes_per_client_and_is_reproducible():
    """Dropout cannot be drawn per client under vmap(randomness='error') (engine-path=vmap says
    so); the per-client path reseeds each client's steps from (seed, round, client, step), so
    runs repeat exactly."""
    def dropout_mlp():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 10))

    task: ClassificationTask = dataclasses.replace(digits_task(), build_model=dropout_mlp)
    cfg = RunConfig.from_mapping({"num-clients": 2, "num-rounds": 2, "local-steps": 2, "device": "cpu"})
    parts = partition(task.labels, 2, "homogeneous", 0)
    a = run_engine(cfg, task=task, parts=parts, write_results=False, show_progress=False)
    b = run_engine(cfg, task=task, parts=parts, write_results=False, show_progress=False)
    assert a.path == "sequential"
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    with pytest.raises(RuntimeError, match="cannot run under torch.func.vmap.*random"):
        run_engine(cfg, EngineOptions(path="vmap"), task=task, parts=parts, write_results=False, show_progress=False)


def test_auto_path_says_which_path_and_why():
    task = digits_task()
    cfg = RunConfig.from_mapping({"num-clients": 2, "num-rounds": 1, "local-steps": 1, "device": "cpu"})
    parts = partition(task.labels, 2, "homogeneous", 0)
    auto = run_engine(cfg, task=task, parts=parts, write_results=False, show_progress=False)
    assert auto.path == "sequential" and "auto on the CPU" in auto.notes[0]

    class NoVmap(DigitsCNN):
        engine_vmap = False

    flagged = run_engine(cfg, task=dataclasses.replace(task, build_model=NoVmap), parts=parts, write_results=False,
                         show_progress=False)
    assert flagged.path == "sequential" and "NoVmap.engine_vmap is False" in flagged.notes[0]
