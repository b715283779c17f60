"""The server-optimiser base (strategies/methods/fedopt.py) and its methods: FedAvgM, FedAdam and
FedYogi (Reddi et al., ICLR 2021, Algorithm 2, no bias correction).

* tiny scalar cases computed by hand: each rule's ``update`` over two steps, and the server side
  of whole rounds through the Flower strategy (replies whose average is known);
* the Flower path against a float64 reference written from the paper with plain loops (FedAvg's
  clients, the server's moments in float64);
* FedAvgM's checkpoint entries keep their names (``server-momentum.<parameter>``); the keys' errors.
"""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import nn

import tasks
from server.app import initial_model
from simulations.loopback import LoopbackGrid
from strategies.core.client_sampling import participants
from strategies.core.settings import Hyper
from strategies.flower_api.strategy import flower_strategy
from strategies.methods import METHODS
from strategies.methods.fedadam import FedAdam
from strategies.methods.fedavgm import FedAvgM
from strategies.methods.fedopt import FedOpt
from strategies.methods.fedyogi import FedYogi
from tasks import load_task
from tasks.config import RunConfig
from tasks.sampling import round_batches

#: beta_1 = 0.5, beta_2 = 0.75, tau = 0.5 (v starts at tau^2 = 0.25), eta = 0.5; x_0 = 1, g_1 = 1, g_2 = 0.5
ADAPTIVE = {"server-lr": 0.5, "beta1": 0.5, "beta2": 0.75, "tau": 0.5}
#: m_1 = 0.5 g_1 = 0.5, m_2 = 0.5 m_1 + 0.5 g_2 = 0.5 (both rules); Adam: v_1 = 0.75 * 0.25 + 0.25 * 1 = 0.4375,
#: v_2 = 0.75 * 0.4375 + 0.25 * 0.25 = 0.390625 = 0.625^2; Yogi: v_1 = 0.25 + 0.25 * 1 (v_0 < g_1^2) = 0.5,
#: v_2 = 0.5 - 0.25 * 0.25 (v_1 > g_2^2) = 0.4375; x_t = x_{t-1} - 0.5 m_t / (sqrt(v_t) + 0.5)
BY_HAND = {
    "fedadam": (1 - 0.25 / (math.sqrt(0.4375) + 0.5), 1 - 0.25 / (math.sqrt(0.4375) + 0.5) - 0.25 / 1.125),
    "fedyogi": (1 - 0.25 / (math.sqrt(0.5) + 0.5), 1 - 0.25 / (math.sqrt(0.5) + 0.5) - 0.25 / (math.sqrt(0.4375) + 0.5)),
    # beta = 0.5, eta_s = 0.5: v_1 = g_1 = 1, x_1 = 0.5; v_2 = 0.5 + 0.5 = 1, x_2 = 0
    "fedavgm": (0.5, 0.0),
}
OPTIONS = {"fedadam": ADAPTIVE, "fedyogi": ADAPTIVE, "fedavgm": {"server-momentum": 0.5, "server-lr": 0.5}}


def test_the_optimisers_are_registered_under_the_base():
    assert {name for name, cls in METHODS.items() if issubclass(cls, FedOpt)} == {"fedavgm", "fedadam", "fedyogi"}
    assert all(cls.needs_global for cls in (FedAvgM, FedAdam, FedYogi))  # they step from the global model


@pytest.mark.parametrize("name", BY_HAND)
def test_two_steps_by_hand(name):
    algorithm = METHODS[name](Hyper(), options=OPTIONS[name])
    x, slots = torch.tensor(1.0, dtype=torch.float64), {}
    for g, want in zip((1.0, 0.5), BY_HAND[name], strict=True):
        x = algorithm.update(x, torch.tensor(g, dtype=torch.float64), slots)
        assert x.item() == pytest.approx(want, abs=1e-15)


def test_yogi_and_adam_differ_only_in_v():
    """From the same v and g^2: Adam moves v a share (1 - beta_2) towards g^2; Yogi by (1 - beta_2) g^2
    in the direction of g^2 (v = 0.25, g^2 = 1: Adam 0.4375, Yogi 0.5; v = 1, g^2 = 0.25: Adam 0.8125,
    Yogi 0.9375; v = g^2: both unchanged)."""
    adam, yogi = FedAdam(Hyper(), options=ADAPTIVE), FedYogi(Hyper(), options=ADAPTIVE)
    v, g2 = torch.tensor([0.25, 1.0, 0.36]), torch.tensor([1.0, 0.25, 0.36])
    assert adam.second_moment(v, g2).tolist() == pytest.approx([0.4375, 0.8125, 0.36])
    assert yogi.second_moment(v, g2).tolist() == pytest.approx([0.5, 0.9375, 0.36])


class Reply:
    """What aggregate_train reads from a reply Message."""

    def __init__(self, state):
        self.content = RecordDict({"arrays": ArrayRecord(state), "metrics": MetricRecord(
            {"num-examples": 4, "num-steps": 2, "train-loss": 1.0, "clip-fraction": 0.0, "grad-norm": 1.0,
             "skipped-steps": 0})})
        self.error = None
        self.metadata = type("M", (), {"src_node_id": 1})()

    def has_error(self):
        return False


@pytest.mark.parametrize("name", BY_HAND)
def test_whole_rounds_by_hand(name):
    """The server side through the Flower strategy: x_0 = 1; round 1 the two clients return 0.5 and
    -0.5 (mean 0, g_1 = 1), round 2 they return x_1 - 1 and x_1 (mean x_1 - 0.5, g_2 = 0.5); buffers
    take the average (the ServerApp names the trainable parameters: ``bound_keys``). The float32 model
    gives the by-hand values to float32 rounding."""
    strategy = flower_strategy(METHODS[name])(lr=0.1, batch_size=4, local_steps=2, num_clients=2, bound_keys=["w"],
                                              **{k.replace("-", "_"): v for k, v in OPTIONS[name].items()})
    grid = LoopbackGrid(lambda m, c: None, {}, 2)
    x = 1.0
    for server_round, (low, high) in enumerate([(0.5, -0.5), (None, None)], 1):
        if low is None:
            low, high = x - 1.0, x
        state = {"w": torch.tensor([x]), "bn.mean": torch.tensor([0.0])}
        list(strategy.configure_train(server_round, ArrayRecord(state), ConfigRecord(), grid))
        arrays, metrics = strategy.aggregate_train(server_round, [
            Reply({"w": torch.tensor([low]), "bn.mean": torch.tensor([2.0])}),
            Reply({"w": torch.tensor([high]), "bn.mean": torch.tensor([4.0])})])
        out = arrays.to_torch_state_dict()
        assert metrics["replies"] == 2 and out["bn.mean"].item() == 3.0
        x = out["w"].item()
        assert x == pytest.approx(BY_HAND[name][server_round - 1], abs=1e-6)
    assert set(strategy.algorithm.state_dict()) == {f"{p}w" for p in METHODS[name].slots.values()}


def test_fedavgm_keeps_its_checkpoint_names():
    """A checkpoint written before the base (``server-momentum.<parameter>``) loads; another entry is refused."""
    m = FedAvgM(Hyper())
    m.load_state_dict({"server-momentum.w": torch.tensor([1.0])})
    assert m.state_dict() == {"server-momentum.w": torch.tensor([1.0])}
    with pytest.raises(ValueError, match=r"fedavgm keeps only its server optimiser's v \(server-momentum\.\*\), "
                                         r"the checkpoint holds \['server-v.w'\]"):
        m.load_state_dict({"server-v.w": torch.tensor([1.0])})


CASE = {"num-clients": 4, "clients-per-round": 3, "num-rounds": 3, "local-steps": 2, "batch-size": 8, "lr": 0.2,
        "partitioner": "dirichlet", "dirichlet-alpha": 0.3}


def adaptive_reference(values, rule):
    """Reddi et al.'s Algorithm 2 with FedAvg's clients, written out: each sampled client takes I SGD
    steps from x_t; Delta_t = mean_k x_k - x_t; m_t = beta_1 m_{t-1} + (1 - beta_1) Delta_t; v_t by
    ``rule`` (Adam or Yogi) from v_{-1} = tau^2; x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau) -- the
    server in float64, the clients in the model's float32."""
    cfg = RunConfig.from_mapping(values)
    o = cfg.method_options
    eta, b1, b2, tau = o["server-lr"], o["beta1"], o["beta2"], o["tau"]
    task, parts = load_task(cfg), tasks.partitions(cfg)
    model = initial_model(task, cfg.seed)
    names = [k for k, _ in model.named_parameters()]
    x = [p.detach().double() for p in model.parameters()]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.full_like(t, tau ** 2) for t in x]

    def gradient(y, idx):
        for p, t in zip(model.parameters(), y, strict=True):
            p.data = t.clone()
        loss = nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx])
        return [g.detach() for g in torch.autograd.grad(loss, list(model.parameters()))]

    for r in range(1, cfg.num_rounds + 1):
        ys = []
        for i in participants(cfg.seed, r, cfg.num_clients, cfg.clients_per_round):
            y = [t.float() for t in x]
            batches = round_batches(parts[i], seed=cfg.seed, partition_id=i, server_round=r,
                                    local_steps=cfg.local_steps, batch_size=cfg.batch_size)
            for s in range(cfg.local_steps):
                g = gradient(y, torch.from_numpy(batches[s]))
                y = [a - cfg.lr * b for a, b in zip(y, g, strict=True)]
            ys.append(y)
        for j in range(len(x)):
            delta = sum(y[j].double() for y in ys) / len(ys) - x[j]
            m[j] = b1 * m[j] + (1 - b1) * delta
            v[j] = rule(v[j], delta * delta, b2)
            x[j] = x[j] + eta * m[j] / (v[j].sqrt() + tau)
    return dict(zip(names, x, strict=True))


RULES = {
    "fedadam": lambda v, d2, b2: b2 * v + (1 - b2) * d2,
    "fedyogi": lambda v, d2, b2: v - (1 - b2) * d2 * torch.sign(v - d2),
}


@pytest.mark.parametrize("name", RULES)
def test_flower_path_equals_the_papers_algorithm_in_float64(runs, mlp_digits, name):
    case = {**CASE, "algorithm": name, f"{name}.server-lr": 0.05, f"{name}.tau": 0.01}
    state, (_, rows) = runs.flower(name, **case)
    for k, want in adaptive_reference(runs.values(name, **case), RULES[name]).items():
        torch.testing.assert_close(state[k].double(), want, rtol=1e-5, atol=1e-6, msg=k)
    assert all(r["replies"] == 3 and r["rejected-replies"] == 0 for r in rows[1:])
    assert rows[-1]["clip-fraction"] == 0.0  # FedAvg's clients: clip off by default


@pytest.mark.parametrize("values, message", [
    ({"algorithm": "fedadam", "fedadam.beta1": 1.0}, r"fedadam.beta1 must be in \[0, 1\), got 1.0"),
    ({"algorithm": "fedyogi", "fedyogi.tau": 0}, r"fedyogi.tau must be a finite number > 0, got 0.0"),
    ({"algorithm": "fedyogi", "fedadam.server-lr": 0.1},
     r"fedadam.server-lr = 0.1 is a setting of algorithm 'fedadam', not of the running algorithm 'fedyogi' .*the "
     r"running method's own is fedyogi.server-lr"),
])
def test_its_keys_are_checked(values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_mapping(values)
