"""One malicious reply per case in a 3-client run with min-replies = 2: the run completes,
the reply is rejected with its reason and counted, and the final model equals that of the
same run in which that client failed in that round (the reply never arrived)."""

from __future__ import annotations

import math

import pytest
from deploy_support import DEPLOY_CONFIG, FaultyGrid, assert_same_weights
from flwr.app import ArrayRecord, MetricRecord

from client.app import app as client_app
from loopback_grid import run_server_app
from server.app import app as server_app
from server.results import read_results
from tasks.config import RunConfig

CONFIG = {**DEPLOY_CONFIG, "num-clients": 3, "num-rounds": 2, "node-wait": 2.0, "min-replies": 2}
BAD_PARTITION, BAD_ROUND = 1, 2


class TamperingGrid(FaultyGrid):
    """Delivers every message to the real ClientApp, then lets ``tamper`` rewrite the train
    reply of partition BAD_PARTITION in round BAD_ROUND (what a lying client sends)."""

    def __init__(self, *args, tamper, **kwargs) -> None:
        super().__init__(*args, failures={}, **kwargs)
        self.tamper = tamper

    def _deliver(self, msg):
        reply = super()._deliver(msg)
        pid = self.nodes[msg.metadata.dst_node_id].get("partition-id")
        if msg.metadata.message_type == "train" and pid == BAD_PARTITION and not reply.has_error() and \
                int(msg.content["config"]["server-round"]) == BAD_ROUND:
            self.tamper(reply)
        return reply


def set_metric(key, value):
    def tamper(reply):
        record = reply.content["metrics"]
        values = dict(record)
        values[key] = value
        reply.content["metrics"] = MetricRecord(values)
    return tamper


def set_arrays(fn):
    def tamper(reply):
        state = reply.content["arrays"].to_torch_state_dict()
        reply.content["arrays"] = ArrayRecord(fn(state))
    return tamper


# case -> (tamper, the reason recorded for the rejected reply)
CASES = {
    "spoofed partition-id": (set_metric("partition-id", 0), "spoofed partition-id 0 (the node holds partition 1)"),
    "stale round": (set_metric("server-round", BAD_ROUND - 1), "stale reply: server-round 1 in a reply to round 2"),
}


def run(folder, name, grid_cls, **kw):
    return run_grid(folder, name, grid_cls, **kw)[0]


def run_grid(folder, name, grid_cls, **kw):
    values = {**RunConfig().to_mapping(), **CONFIG, "results-dir": str(folder), "run-name": name}
    grid = grid_cls(client_app, values, 3, **kw)
    run_server_app(server_app, grid)
    return folder / name, grid


@pytest.fixture(scope="module")
def failed_reference(tmp_path_factory):
    """The same run in which partition 1 failed in round 2 (its reply never arrived)."""
    return run(tmp_path_factory.mktemp("ref"), "ref", FaultyGrid, failures={BAD_PARTITION: {BAD_ROUND}})


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malicious_reply_is_rejected_and_the_run_equals_a_failed_client(case, tmp_path, failed_reference):
    tamper, reason = CASES[case]
    folder = run(tmp_path, "run", TamperingGrid, tamper=tamper)
    _, rows = read_results(folder / "results.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2]
    bad = rows[BAD_ROUND]
    assert bad["replies"] == 2 and bad["rejected-replies"] == 1, bad
    assert any(f.startswith(f"partition {BAD_PARTITION}: rejected, ") and reason in f for f in bad["failures"]), \
        bad["failures"]
    assert rows[1]["replies"] == 3 and rows[1]["rejected-replies"] == 0
    assert math.isfinite(bad["test-loss"])
    assert_same_weights(folder, failed_reference)


class LateStranger(FaultyGrid):
    """A fourth node appears after round 1 claiming partition 0 (whose member is online)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, failures={}, **kwargs)
        self.stranger = {"partition-id": 0, "num-partitions": 3}

    def get_node_ids(self):
        trained = any(m.metadata.message_type == "train" for m in self.sent)
        if trained and 2000 not in self.nodes:
            self.nodes[2000] = self.stranger
        return list(self.nodes)


def test_a_node_that_joins_later_claiming_a_held_partition_is_ignored(tmp_path):
    reference = run(tmp_path, "ref", FaultyGrid, failures={})
    folder, grid = run_grid(tmp_path, "run", LateStranger)
    _, rows = read_results(folder / "results.jsonl")
    assert [r["replies"] for r in rows[1:]] == [3, 3]
    sent = [(m.metadata.dst_node_id, m.metadata.message_type) for m in grid.sent]
    assert (2000, "query") in sent and (2000, "train") not in sent  # asked once, never trained
    assert_same_weights(folder, reference)
