"""Multi-client nodes: a federation of fewer nodes than clients, each node serving every K-th
client with one call of its executor -- the same run as one client per node and as the engine,
bit for bit, for every method, partial participation and kept client state included."""

from __future__ import annotations

import pytest
import torch

from strategies.core.client_sampling import node_clients

CASES = {
    "celgc": {"local-steps": 3, "weight-decay": 1e-3, "momentum": 0.5},
    "local-sgd": {"algorithm": "local-sgd", "clip": "off", "local-steps": 2},
    "naive": {"algorithm": "naive", "local-steps": 1, "num-rounds": 3, "momentum": 0.5},
    "episode": {"algorithm": "episode", "local-steps": 2, "clip": 0.5},
    "scaffold": {"algorithm": "scaffold", "clip": "off", "local-steps": 2, "partitioner": "dirichlet",
                 "dirichlet-alpha": 0.5},
}
BASE = {"num-clients": 5, "num-rounds": 2, "batch-size": 16}


def test_the_spread_of_clients_over_nodes():
    assert [node_clients(i, 2, 8) for i in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [node_clients(i, 3, 5) for i in range(3)] == [[0, 3], [1, 4], [2]]
    assert node_clients(2, 5, 5) == [2]
    with pytest.raises(ValueError, match="at most one node per client"):
        node_clients(0, 6, 5)


@pytest.mark.parametrize("partial", [False, True], ids=["all", "3 of 5"])
@pytest.mark.parametrize("case", list(CASES))
def test_multi_client_nodes_equal_one_client_per_node_and_the_engine(runs, case, partial):
    config = {**BASE, **CASES[case], **({"clients-per-round": 3} if partial else {})}
    spread = runs.flower("two-nodes", num_nodes=2, **config)
    runs.same(spread, runs.engine("engine", "sequential", **config), exact=True)
    single = runs.flower("five-nodes", **config)
    for key, value in single[0].items():
        assert torch.equal(spread[0][key], value), key
    strip = lambda rows: [{k: v for k, v in r.items() if k != "wall-clock"} for r in rows]  # noqa: E731
    assert strip(spread[1][1]) == strip(single[1][1])
    sent = [m for m in runs.grids["two-nodes"].sent if m.metadata.message_type == "train"]
    assert {m.metadata.dst_node_id for m in sent} <= {1000, 1001}  # one message a node an exchange
    assert all(len(m.content["config"]["clients"]) >= 1 for m in sent)


def test_kept_client_state_lives_per_client_on_its_node(runs, tiny_lm):
    """The language model's hidden state and place in its text, per client in its node's
    Context.state: 2 nodes x 2 clients == the engine with state kept, and != stateless."""
    data = tiny_lm(400)
    config = {"task": "ptb", "data-dir": str(data / "data"), "num-clients": 4, "num-rounds": 3, "local-steps": 2,
              "batch-size": 2, "lr": 5.0, "clip": 0.5, "eval-every": 3}
    spread = runs.flower("two-nodes", num_nodes=2, **config)
    runs.same(spread, runs.engine("engine", "sequential", **config), exact=True)
    contexts = runs.grids["two-nodes"].contexts
    assert sorted(k for c in contexts.values() for k in c.state if k.startswith("client-state.")) == [
        f"client-state.{p}" for p in range(4)]
    reset = runs.engine("reset", "sequential", **{**config, "client-state": "reset"})
    assert not torch.equal(reset[0]["encoder.weight"], spread[0]["encoder.weight"])


def test_kept_client_state_survives_an_engine_resume_and_a_flower_resume_says_it_reset(runs, tiny_lm):
    """The engine keeps its clients' state (hidden state, place in the text) in the checkpoint: a
    resumed run equals the uninterrupted one bit for bit. On the Flower path that state lives in the
    nodes' Context.state, which a resumed (new) run starts empty: its first row says so."""
    data = tiny_lm(400)
    config = {"task": "ptb", "data-dir": str(data / "data"), "num-clients": 2, "num-rounds": 3, "local-steps": 2,
              "batch-size": 2, "lr": 5.0, "clip": 0.5, "eval-every": 3, "checkpoint-every": 1}
    whole = runs.engine("whole", "sequential", **config)
    runs.engine("part", "sequential", **{**config, "num-rounds": 2})
    resumed = runs.engine("part", "sequential", **{**config, "resume": True})
    for key, value in whole[0].items():
        assert torch.equal(resumed[0][key], value), key
    assert all("resume-reset" not in r for r in resumed[1][1])
    reset = runs.engine("reset", "sequential", **{**config, "client-state": "reset"})
    assert not torch.equal(reset[0]["encoder.weight"], whole[0]["encoder.weight"])  # the state matters

    runs.flower("flower", **{**config, "num-rounds": 2})
    _, (_, rows) = runs.flower("flower", **{**config, "resume": True})
    assert [r["round"] for r in rows if "resume-reset" in r] == [3]
    assert "client-state=keep" in next(r["resume-reset"] for r in rows if "resume-reset" in r)
