"""The whole app through Flower's ServerApp and ClientApp objects, in one process.

The real ``flwr run`` path (SuperLink, Ray, subprocesses) is tested in test_flwr_run.py.
"""

import json
import logging

import pytest
import torch

from client.app import app as client_app
from server.app import FederationError
from server.app import app as server_app
from simulations.loopback import LoopbackGrid, run_server_app
from tasks.config import RunConfig
from tasks.runs.results import load_weights, read_results


def run(tmp_path, name="run", num_nodes=None, num_partitions=None, node_configs=None, **overrides):
    values = {**RunConfig().to_mapping(), "num-rounds": 3, "local-steps": 4, "num-clients": 4,
              "results-dir": str(tmp_path), "run-name": name, "node-wait": 2.0, **overrides}
    grid = LoopbackGrid(client_app, values, num_nodes or values["num-clients"], num_partitions, node_configs)
    run_server_app(server_app, grid)
    return tmp_path / name, grid


def test_rounds_train_the_model_and_write_results(tmp_path):
    folder, grid = run(tmp_path, **{"num-rounds": 4})
    header, rows = read_results(folder / "results.jsonl")
    assert header["config"]["num-clients"] == 4 and header["versions"]["torch"] == torch.__version__
    assert [r["round"] for r in rows] == [0, 1, 2, 3, 4]
    last = rows[-1]
    for key in ("global-epoch", "communication-rounds", "bytes-sent", "bytes-received", "wall-clock", "train-loss",
                "test-loss", "test-accuracy", "clip-fraction", "rejected-replies", "failed-replies", "grad-norm"):
        assert key in last, key
    assert last["replies"] == 4 and last["num-steps"] == 16 and last["num-examples"] == 4 * 4 * 32
    assert last["global-epoch"] == pytest.approx(4 * 4 * 4 * 32 / header["train-size"])
    assert last["bytes-sent"] == 4 * header["model-bytes"] == last["bytes-received"]
    assert rows[-1]["test-accuracy"] > rows[0]["test-accuracy"] + 0.3
    assert rows[-1]["test-loss"] < rows[0]["test-loss"]
    train_msgs = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert len(train_msgs) == 4 * 4  # every client, every round
    state = load_weights(folder / "model.pt")
    assert set(state) >= {"head.1.weight", "features.1.running_mean", "features.1.num_batches_tracked"}
    assert state["features.1.num_batches_tracked"].dtype == torch.int64
    for line in (folder / "results.jsonl").read_text().splitlines():
        json.loads(line)


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    a, _ = run(tmp_path, "a")
    b, _ = run(tmp_path, "b")
    c, _ = run(tmp_path, "c", seed=1)
    wa, wb, wc = (load_weights(f / "model.pt") for f in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["head.1.weight"], wc["head.1.weight"])


def test_schedule_and_clip_off_reach_the_clients(tmp_path):
    folder, grid = run(tmp_path, **{"clip": "off", "lr-milestones": "1.0", "lr-decay": 0.5})
    _, rows = read_results(folder / "results.jsonl")
    lrs = [r["lr"] for r in rows[1:]]
    # 4 clients x 4 steps x 32 = 512 samples a round of 1,438: epoch 1 is passed after round 3
    assert lrs == [0.3, 0.3, 0.3]
    sent = [dict(m.content["config"]) for m in grid.sent if m.metadata.message_type == "train"]
    assert all(c["clip"] == float("inf") for c in sent)
    assert rows[-1]["clip-fraction"] == 0.0


def test_fewer_nodes_than_clients_serve_them_all_the_same_run(tmp_path):
    """4 clients on 2 nodes (each serves every 2nd client, all with one call of its executor):
    one message a node a round, and the run of one node per client, bit for bit."""
    folder, grid = run(tmp_path, "two", num_nodes=2)
    one, _ = run(tmp_path, "four")
    (_, rows), (_, ref) = read_results(folder / "results.jsonl"), read_results(one / "results.jsonl")
    assert len([m for m in grid.sent if m.metadata.message_type == "train"]) == 2 * 3
    assert [m.content["config"]["clients"] for m in grid.sent if m.metadata.message_type == "train"][:2] == [[0, 2],
                                                                                                            [1, 3]]
    assert [{k: v for k, v in r.items() if k != "wall-clock"} for r in rows] == \
        [{k: v for k, v in r.items() if k != "wall-clock"} for r in ref]
    a, b = load_weights(folder / "model.pt"), load_weights(one / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_more_nodes_than_clients_fails_with_the_fix_first(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="flwr"), pytest.raises(FederationError) as err:
        run(tmp_path, num_nodes=5)
    assert str(err.value).startswith('run with --federation-config "num-supernodes=4" (or fewer')
    assert "num-partitions=5 but the run asks for num-clients=4" in str(err.value)
    # logged, with the exception's name, before Flower's traceback
    assert caplog.records[0].getMessage() == f"celgc run failed (CELGC I=4 on digits): FederationError: {err.value}"


def test_num_clients_zero_follows_the_federation(tmp_path):
    folder, grid = run(tmp_path, num_nodes=2, **{"num-clients": 0, "num-rounds": 2})
    header, rows = read_results(folder / "results.jsonl")
    assert header["config"]["num-clients"] == 2 and rows[-1]["replies"] == 2
    assert rows[-1]["global-epoch"] == pytest.approx(2 * 2 * 4 * 32 / header["train-size"])
    assert len([m for m in grid.sent if m.metadata.message_type == "train"]) == 2 * 2


def test_num_clients_zero_without_num_partitions_is_a_clear_error(tmp_path):
    nodes = [{"partition-id": i} for i in range(2)]
    with pytest.raises(FederationError, match="set num-clients=N: num-clients=0 follows the num-partitions"):
        run(tmp_path, node_configs=nodes, **{"num-clients": 0})


def test_too_few_nodes_fails_after_node_wait(tmp_path):
    nodes = [{"partition-id": i, "num-partitions": 4} for i in range(3)]
    with pytest.raises(FederationError, match="num-supernodes=K.*only 3 of the federation's 4 nodes connected within "
                                              "node-wait=2 s"):
        run(tmp_path, node_configs=nodes)


def test_a_second_node_claiming_a_partition_is_excluded_and_named(tmp_path):
    """A fifth node claiming partition 0 (held by the first): the run goes on with the four
    members, the fifth is never trained and round 1 names it with the fix."""
    nodes = [{"partition-id": i % 4, "num-partitions": 4} for i in range(5)]
    folder, grid = run(tmp_path, node_configs=nodes)
    _, rows = read_results(folder / "results.jsonl")
    assert [r["replies"] for r in rows[1:]] == [4, 4, 4]
    assert 1004 not in {m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "train"}
    assert rows[1]["failures"] == [
        'node 1004: query reply excluded, nodes 1000 and 1004 both claim partition-id=0: give every SuperNode its own '
        '--node-config "partition-id=i num-partitions=4" (i = 0..3); node 1000 answered first and keeps it']


def test_client_without_partition_id_fails_the_run_with_its_reason(tmp_path):
    nodes = [{"partition-id": i, "num-partitions": 4} for i in range(3)] + [{"num-partitions": 4}]
    with pytest.raises(RuntimeError, match="node config has no partition-id"):
        run(tmp_path, node_configs=nodes)


def test_more_clients_than_examples_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"num-clients \(2000\) exceeds the number of training examples \(1438\)"):
        run(tmp_path, **{"num-clients": 2000})


def test_batch_larger_than_a_client_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"batch-size \(1000\) exceeds the smallest client's 359 examples"):
        run(tmp_path, **{"batch-size": 1000})


def test_bad_run_config_fails_before_training(tmp_path):
    with pytest.raises(ValueError, match="local-steps must be an integer >= 1, got 0"):
        run(tmp_path, **{"local-steps": 0})


def test_the_server_log_names_the_method_and_the_clients_of_each_node(tmp_path, monkeypatch):
    import server.app

    lines = []
    monkeypatch.setattr(server.app, "log", lambda level, msg, *args: lines.append(msg % args))
    run(tmp_path, name="ep", num_nodes=2, **{"num-rounds": 1, "algorithm": "episode", "local-steps": 2})
    assert any(line.startswith(f"EPISODE I=2 run: digits -> results in {tmp_path / 'ep'}") for line in lines), lines
    assert "4 clients on 2 nodes: node i serves clients i, i + 2, i + 4, ..." in lines
