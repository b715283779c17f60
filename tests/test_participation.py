"""Partial participation (clients-per-round = K of num-clients = M): the Flower path (real
ServerApp + ClientApp on the loopback grid) trains exactly the round's ``participants()``,
the engine stacks only them, and both give the same run bit for bit; epochs, schedule and
bytes count K clients a round; a member that was not sampled is not offline; a stateful
client keeps its state through the rounds it sits out."""

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import MessageType  # noqa: E402

from client.app import app as client_app  # noqa: E402
from server.app import app as server_app  # noqa: E402
from server.faults import WatchedGrid  # noqa: E402
from simulations.engine import EngineOptions, run_engine  # noqa: E402
from simulations.loopback import LoopbackGrid, run_server_app  # noqa: E402
from strategies.core.client_sampling import participants  # noqa: E402
from strategies.flower_api.celgc_strategy import CELGC  # noqa: E402
from tasks.config import RunConfig  # noqa: E402
from tasks.runs.results import load_weights, read_results  # noqa: E402

M, K, ROUNDS = 6, 2, 3


def lm_values(tmp_path, **kw):
    return {**RunConfig().to_mapping(), "task": "ptb", "data-dir": str(tmp_path / "data"), "num-clients": 1,
            "batch-size": 2, "local-steps": 3, "num-rounds": 4, "lr": 5.0, "clip": 0.5, "device": "cpu",
            "weight-decay": 1.2e-6, "node-wait": 2.0, "results-dir": str(tmp_path / "res"), **kw}
BASE = {"num-clients": M, "clients-per-round": K, "num-rounds": ROUNDS, "batch-size": 16, "device": "cpu",
        "node-wait": 2.0, "seed": 3}
CASES = {
    "celgc": {"local-steps": 3, "weight-decay": 1e-3, "lr-milestones": "0.01", "lr-decay": 0.5},
    "naive": {"algorithm": "naive", "local-steps": 1, "momentum": 0.5},
}

def flower(tmp_path, name, **overrides):
    values = {**RunConfig().to_mapping(), **BASE, "results-dir": str(tmp_path), "run-name": name, **overrides}
    grid = LoopbackGrid(client_app, values, M)
    run_server_app(server_app, grid)
    trained: dict[int, list[int]] = {}
    for msg in grid.sent:
        if msg.metadata.message_type == MessageType.TRAIN:
            server_round = next(iter(msg.content.config_records.values()))["server-round"]
            trained.setdefault(server_round, []).append(grid.nodes[msg.metadata.dst_node_id]["partition-id"])
    run = load_weights(tmp_path / name / "model.pt"), read_results(tmp_path / name / "results.jsonl")
    return run, trained

def engine(tmp_path, name, path, **overrides):
    cfg = RunConfig.from_mapping({**BASE, "results-dir": str(tmp_path), "run-name": name, **overrides})
    run_engine(cfg, EngineOptions(path=path), show_progress=False)
    return load_weights(tmp_path / name / "model.pt"), read_results(tmp_path / name / "results.jsonl")

@pytest.mark.parametrize("case", list(CASES))
def test_flower_trains_the_sampled_partitions_and_the_engine_matches_bit_for_bit(tmp_path, runs, case):
    ref, trained = flower(tmp_path, "flower", **CASES[case])
    expected = {r: participants(BASE["seed"], r, M, K) for r in range(1, ROUNDS + 1)}
    assert trained == expected
    assert len({tuple(p) for p in expected.values()}) > 1  # the rounds really sample different clients
    head, rows = ref[1]
    for row in rows[1:]:
        assert row["replies"] == K and row["failed-replies"] == 0 and row["failed-nodes"] == []
        assert "failures" not in row  # a member that was not sampled is not offline
    runs.same(ref, engine(tmp_path, "engine", "auto", **CASES[case]), exact=True)

def test_sampled_clients_on_nodes_that_serve_several_are_named_and_match_the_engine(tmp_path, runs):
    """Partial participation with fewer nodes than clients: a node whose only sampled client is one of
    several it serves gets a message naming it (the plain format would leave the node guessing)."""
    two = runs.flower("two-nodes", num_nodes=2, **BASE, **CASES["celgc"])
    assert all(row["replies"] == K for row in two[1][1][1:])
    runs.same(two, engine(tmp_path, "engine-two", "auto", **CASES["celgc"]), exact=True)


@pytest.mark.parametrize("case", list(CASES))
def test_vectorised_engine_runs_only_the_sampled_clients(tmp_path, smooth_digits, runs, case):
    ref, _ = flower(tmp_path, "flower", **CASES[case])
    runs.same(ref, engine(tmp_path, "vmap", "vmap", **CASES[case]), exact=False)

@pytest.mark.parametrize("case", list(CASES))
def test_epochs_schedule_and_bytes_count_k_clients(tmp_path, case):
    state, (head, rows) = engine(tmp_path, "engine", "auto", **CASES[case])
    cfg = RunConfig.from_mapping({**BASE, **CASES[case]})
    train_size, model_bytes = head["train-size"], head["model-bytes"]
    for r, row in enumerate(rows):
        assert row["global-epoch"] == r * K * cfg.local_steps * cfg.batch_size / train_size
        if r:
            assert row["bytes-sent"] == K * model_bytes
    if case == "celgc":  # milestone at 0.01 epochs: round 1 before it, the later rounds after (K, not M, count)
        epoch_1 = K * cfg.local_steps * cfg.batch_size / train_size
        assert epoch_1 >= 0.01 > 0
        assert rows[1]["lr"] == cfg.lr and rows[2]["lr"] == cfg.lr * 0.5 and rows[2]["clip"] == cfg.clip * 0.5

class _Grid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)

def test_strategy_select_hook_chooses_the_nodes_and_is_checked():
    strategy = CELGC(local_steps=1, lr=0.1, select=lambda r, nodes: nodes[r - 1:r + 1])
    assert strategy.sample(_Grid([30, 10, 20]), 2) == [20, 30]  # connected ids arrive sorted
    with pytest.raises(ValueError, match="needs the round"):
        strategy.sample(_Grid([1, 2]))
    strategy.select = lambda r, nodes: [nodes[0], 99]
    with pytest.raises(ValueError, match=r"distinct connected node ids, got \[1, 99\]"):
        strategy.sample(_Grid([1, 2]), 1)
    with pytest.raises(ValueError, match="select must be callable"):
        CELGC(local_steps=1, lr=0.1, select=3)

def test_watched_grid_expects_only_the_rounds_partitions():
    watched = WatchedGrid(_Grid([]), min_clients=1, node_wait=1.0)
    watched.expect([], num_clients=4)
    watched.expect_round([1, 3])
    assert set(watched.take_failures()) == {1, 3}  # neither answered: offline; 0 and 2 were not sampled
    assert set(watched.take_failures()) == {0, 1, 2, 3}  # the next round without a sample expects all


@pytest.mark.realproc
def test_two_engine_processes_share_the_rounds_sample(tmp_path, command, close):
    """torchrun, 2 gloo processes: each runs its slots of the round's K = 3 of M = 5 clients
    (2 + 1); the same run as one process."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run, assert_close = command, close

    keys = {"num-clients": 5, "clients-per-round": 3, "num-rounds": 3, "local-steps": 2, "batch-size": 16,
            "device": "cpu", "results-dir": str(tmp_path)}
    overrides = " ".join(f"{k}={v}" for k, v in keys.items())
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
         "simulations.engine", "--config", str(root / "pyproject.toml"), "--quiet",
         "--run-config", f"{overrides} run-name=two"])
    one = run_engine(RunConfig.from_mapping({**keys, "run-name": "one"}), show_progress=False)
    assert_close(load_weights(tmp_path / "two" / "model.pt"), one.state, 1e-6)
    (_, rows), (_, one_rows) = (read_results(tmp_path / n / "results.jsonl") for n in ("two", "one"))
    assert [r["replies"] for r in rows[1:]] == [3, 3, 3] and rows[-1]["num-steps"] == 6
    assert [r["global-epoch"] for r in rows] == [r["global-epoch"] for r in one_rows]


class _FlakyGrid(LoopbackGrid):
    """Partition ``gone``'s node leaves once the first round has been sent."""

    def __init__(self, *args, gone: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.gone = 1000 + gone

    def get_node_ids(self):
        started = any(m.metadata.message_type == MessageType.TRAIN for m in self.sent)
        return [n for n in self.nodes if not (started and n == self.gone)]


def test_only_a_sampled_member_that_is_offline_fails(tmp_path):
    """seed 3, M = 6, K = 2 samples [0, 1], [2, 4], [1, 5], [1, 3]; partition 1 leaves after
    round 1: rounds 3 and 4 record it offline, round 2 (which did not sample it) nothing."""
    assert [participants(3, r, M, K) for r in range(1, 5)] == [[0, 1], [2, 4], [1, 5], [1, 3]]
    values = {**RunConfig().to_mapping(), **BASE, "num-rounds": 4, "min-replies": 1, "results-dir": str(tmp_path),
              "run-name": "flaky"}
    run_server_app(server_app, _FlakyGrid(client_app, values, M, gone=1))
    _, rows = read_results(tmp_path / "flaky" / "results.jsonl")
    assert [r["replies"] for r in rows[1:]] == [2, 2, 1, 1]
    assert [r["failed-nodes"] for r in rows[1:]] == [[], [], [1], [1]]
    assert "failures" not in rows[2] and "offline" in rows[3]["failures"][0]


def test_stateful_clients_keep_their_state_while_not_sampled(tiny_lm):
    """The language task carries each client's hidden state and place in its text: with K = 1 of
    M = 2 a client that sits out a round resumes where it stopped, on both backends alike."""
    tiny_ptb = tiny_lm(160)
    vals = lm_values(tiny_ptb, **{"num-clients": 2, "clients-per-round": 1, "num-rounds": 5, "seed": 0,
                               "local-steps": 2, "run-name": "flower"})
    picks = [participants(0, r, 2, 1) for r in range(1, 6)]
    assert [0] in picks and [1] in picks and any(picks[r] == picks[r + 1] for r in range(4))
    run_server_app(server_app, LoopbackGrid(client_app, vals, 2))
    f_state = load_weights(tiny_ptb / "res" / "flower" / "model.pt")
    result = run_engine(RunConfig.from_mapping({**vals, "run-name": "engine"}), EngineOptions(path="sequential"),
                        show_progress=False)
    assert all(torch.equal(result.state[k], f_state[k]) for k in f_state)
    stateless = run_engine(RunConfig.from_mapping({**vals, "run-name": "e2", "client-state": "reset"}),
                           EngineOptions(path="sequential"), show_progress=False)
    assert not torch.equal(stateless.state["encoder.weight"], f_state["encoder.weight"])
