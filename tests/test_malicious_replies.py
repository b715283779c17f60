"""One malicious reply per case in a 3-client run with min-replies = 2: the run completes,
the reply is rejected with its reason and counted, and the final model equals that of the
same run in which that client failed in that round (the reply never arrived)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from deploy_support import DEPLOY_CONFIG, FaultyGrid, assert_same_weights
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from client.app import app as client_app
from server.app import FederationError
from server.app import app as server_app
from simulations.loopback import run_server_app
from strategies.flower_api.packing import PACKED, PAYLOAD, is_packed, pack, unpack
from tasks.config import RunConfig
from tasks.runs.results import read_results

CONFIG = {**DEPLOY_CONFIG, "num-clients": 3, "num-rounds": 2, "node-wait": 2.0, "min-replies": 2}
BAD_PARTITION, BAD_ROUND = 1, 2


class TamperingGrid(FaultyGrid):
    """Delivers every message to the real ClientApp, then lets ``tamper`` rewrite the train
    reply of partition BAD_PARTITION in round BAD_ROUND (what a lying client sends)."""

    def __init__(self, *args, tamper, raw: bool = False, **kwargs) -> None:
        super().__init__(*args, failures={}, **kwargs)
        self.tamper, self.raw = tamper, raw  # raw: tamper with the packed wire content itself

    def _deliver(self, msg):
        reply = super()._deliver(msg)
        pid = self.nodes[msg.metadata.dst_node_id].get("partition-id")
        if msg.metadata.message_type == "train" and pid == BAD_PARTITION and not reply.has_error() and \
                int(msg.content["config"]["server-round"]) == BAD_ROUND:
            packed = is_packed(reply.content) and not self.raw
            if packed:  # the lie is told in the reply's own wire format (strategies.flower_api.packing)
                reply.content = unpack(reply.content)[0]
            self.tamper(reply)
            if packed:
                reply.content = pack(reply.content)
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


def replace_arrays(fn):
    def tamper(reply):
        key = next(iter(reply.content.array_records))
        state = reply.content[key].to_torch_state_dict()
        reply.content[key] = ArrayRecord(fn(state))
    return tamper


def first_param(fn):
    return replace_arrays(lambda st: {k: (fn(v) if i == 0 else v) for i, (k, v) in enumerate(st.items())})


def set_key(key, fn, record=None):
    """Rewrite one tensor of the reply's array record (default: its first one)."""
    def tamper(reply):
        name = record or next(iter(reply.content.array_records))
        state = reply.content[name].to_torch_state_dict()
        state[key] = fn(state[key])
        reply.content[name] = ArrayRecord(state)
    return tamper


# the default model's first BatchNorm layer (momentum 0.1): what an honest client's I = 2 forwards can do to it
VAR, COUNT = "features.1.running_var", "features.1.num_batches_tracked"

# case -> (tamper, the reason recorded for the rejected reply); CELGC, I = 2, 3 clients
CASES = {
    "num-examples NaN": (set_metric("num-examples", math.nan), "num-examples must be a finite number >= 0, got nan"),
    "num-examples a list": (set_metric("num-examples", [1.0, 2.0]), "num-examples must be a finite number >= 0"),
    "num-examples negative": (set_metric("num-examples", -5), "num-examples must be a finite number >= 0, got -5"),
    "num-examples 1e15": (set_metric("num-examples", 10**15), "num-examples 1000000000000000 is not the 32 examples"),
    "num-steps inf": (set_metric("num-steps", math.inf), "num-steps must be finite, got inf"),
    "skipped-steps NaN": (set_metric("skipped-steps", math.nan), "skipped-steps must not be NaN"),
    "train-loss a list": (set_metric("train-loss", [0.1, 0.2]), "train-loss must be a number, got list"),
    "clip-fraction 7": (set_metric("clip-fraction", 7.0), "clip-fraction must be in [0, 1], got 7"),
    "huge arrays 1e30": (first_param(lambda v: torch.full_like(v, 1e30)), "more than the"),
    "finite poison 1e3 off": (first_param(lambda v: v + 1e3), "more than the"),
    "non-finite arrays": (first_param(lambda v: torch.full_like(v, math.nan)), "non-finite"),
    "wrong shape": (first_param(lambda v: v.flatten()[:3].clone()), "shape"),
    "wrong dtype": (first_param(lambda v: v.double()), "dtype"),
    "missing key": (replace_arrays(lambda st: dict(list(st.items())[1:])), "keys"),
    "two MetricRecords": (lambda r: r.content.__setitem__("extra", MetricRecord({"x": 1.0})),
                          "expected exactly one MetricRecord, got 2"),
    "spoofed partition-id": (set_metric("partition-id", 0), "spoofed partition-id 0 (the node holds partition 1)"),
    "stale round": (set_metric("server-round", BAD_ROUND - 1), "stale reply: server-round 1 in a reply to round 2"),
    "running_var -50": (set_key(VAR, lambda v: torch.full_like(v, -50.0)),
                        f"{VAR} holds negative values (min -50)"),
    "running_var below its floor": (set_key(VAR, lambda v: v * 0.5),  # 2 forwards keep >= 0.9^2 = 0.81 of it
                                    f"{VAR}[0] is"),
    "num_batches_tracked 2**63-1": (set_key(COUNT, lambda v: torch.full_like(v, 2**63 - 1)),
                                    f"{COUNT} is 9223372036854775807, but 2 training forwards from the global 2 make 4"),
    "num_batches_tracked one short": (set_key(COUNT, lambda v: v - 1),
                                      f"{COUNT} is 3, but 2 training forwards from the global 2 make 4"),
}

# naive parallel clipping (one step a round, gradients up)
NAIVE = {"algorithm": "naive", "local-steps": 1}
NAIVE_CASES = {
    "lr-scale NaN": (set_metric("lr-scale", math.nan), "lr-scale must not be NaN"),
    "lr-scale 1e6": (set_metric("lr-scale", 1e6), "lr-scale must be in (0, 1], got 1000000.0"),
    "lr-scale 0": (set_metric("lr-scale", 0.0), "lr-scale must be in (0, 1], got 0.0"),
    "non-finite gradient": (lambda r: r.content.__setitem__("grads", ArrayRecord(
        {k: torch.full_like(v, math.inf) for k, v in r.content["grads"].to_torch_state_dict().items()})), "non-finite"),
    "gradient of a buffer only": (lambda r: r.content.__setitem__("grads", ArrayRecord(
        dict(list(r.content["grads"].to_torch_state_dict().items())[:1]))), "keys"),
    "buffers: num_batches_tracked 2**63-1": (set_key(COUNT, lambda v: torch.full_like(v, 2**63 - 1), "buffers"),
                                             f"buffers: {COUNT} is 9223372036854775807, but 1 training forward from"),
    "buffers: running_var negative": (set_key(VAR, lambda v: -v, "buffers"), f"buffers: {VAR} holds negative values"),
}


def wire(fn):
    """Rewrite the packed payload itself (the reply as it travels; ``raw`` tampering)."""
    def tamper(reply):
        assert is_packed(reply.content), "this project's ServerApp and ClientApp exchange packed messages"
        payload = reply.content[PACKED][PAYLOAD].numpy()
        reply.content[PACKED] = ArrayRecord({PAYLOAD: Array(np.ascontiguousarray(fn(payload)))})
    return tamper


def plain_beside_packed(reply):
    assert is_packed(reply.content)
    reply.content["arrays"] = ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32))})


# the packed wire format lied about: rejected like any malformed reply
WIRE_CASES = {
    "payload cut short": (wire(lambda p: p[: len(p) // 2]), "packed arrays could not be read: the layout asks for more"),
    "bytes beyond the layout": (wire(lambda p: np.concatenate([p, np.zeros(4, np.uint8)])),
                                "4 bytes sent beyond the layout"),
    "not this project's header": (wire(lambda p: np.concatenate([np.zeros(8, np.uint8), p[8:]])), "packing header"),
    "plain arrays beside packed ones": (plain_beside_packed, "a packed message carries no other ArrayRecord"),
}


@pytest.mark.parametrize("case", sorted(WIRE_CASES))
def test_a_malformed_packed_reply_is_rejected_and_the_run_equals_a_failed_client(case, tmp_path, failed_reference):
    tamper, reason = WIRE_CASES[case]
    folder = run(tmp_path, "run", TamperingGrid, tamper=tamper, raw=True)
    _, rows = read_results(folder / "results.jsonl")
    bad = rows[BAD_ROUND]
    assert bad["replies"] == 2 and bad["rejected-replies"] == 1, bad
    assert any(f.startswith(f"partition {BAD_PARTITION}: rejected, ") and reason in f for f in bad["failures"]), \
        bad["failures"]
    assert_same_weights(folder, failed_reference)


def run(folder, name, grid_cls, config=None, **kw):
    return run_grid(folder, name, grid_cls, config, **kw)[0]


def run_grid(folder, name, grid_cls, config=None, **kw):
    values = {**RunConfig().to_mapping(), **CONFIG, **(config or {}), "results-dir": str(folder), "run-name": name}
    grid = grid_cls(client_app, values, 3, **kw)
    run_server_app(server_app, grid)
    return folder / name, grid


@pytest.fixture(scope="module")
def failed_reference(tmp_path_factory):
    """The same run in which partition 1 failed in round 2 (its reply never arrived)."""
    return run(tmp_path_factory.mktemp("ref"), "ref", FaultyGrid, failures={BAD_PARTITION: {BAD_ROUND}})


@pytest.fixture(scope="module")
def failed_naive_reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ref"), "ref", FaultyGrid, NAIVE, failures={BAD_PARTITION: {BAD_ROUND}})


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malicious_reply_is_rejected_and_the_run_equals_a_failed_client(case, tmp_path, failed_reference):
    check_case(tmp_path, *CASES[case], failed_reference)


@pytest.mark.parametrize("case", sorted(NAIVE_CASES))
def test_a_malicious_naive_reply_is_rejected_and_the_run_equals_a_failed_client(case, tmp_path,
                                                                              failed_naive_reference):
    check_case(tmp_path, *NAIVE_CASES[case], failed_naive_reference, NAIVE)


def check_case(tmp_path, tamper, reason, reference, config=None):
    folder = run(tmp_path, "run", TamperingGrid, config, tamper=tamper)
    _, rows = read_results(folder / "results.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2]
    bad = rows[BAD_ROUND]
    assert bad["replies"] == 2 and bad["rejected-replies"] == 1, bad
    assert any(f.startswith(f"partition {BAD_PARTITION}: rejected, ") and reason in f for f in bad["failures"]), \
        bad["failures"]
    assert rows[1]["replies"] == 3 and rows[1]["rejected-replies"] == 0
    assert math.isfinite(bad["test-loss"])
    assert_same_weights(folder, reference)


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


class QueryLiar(FaultyGrid):
    """Partition 1's node answers the federation query with ``answer`` (a MetricRecord's
    values, or a whole RecordDict) and would train honestly."""

    def __init__(self, *args, answer, **kwargs) -> None:
        super().__init__(*args, failures={}, **kwargs)
        self.answer = answer

    def _deliver(self, msg):
        reply = super()._deliver(msg)
        if msg.metadata.message_type == "query" and self.nodes[msg.metadata.dst_node_id]["partition-id"] == 1:
            content = self.answer if isinstance(self.answer, RecordDict) else \
                RecordDict({"node": MetricRecord({**dict(reply.content["node"]), **self.answer})})
            reply = Message(content, reply_to=msg)
            reply.metadata.__dict__["_src_node_id"] = msg.metadata.dst_node_id
        return reply


# the node's answer -> the reason it is excluded (3 nodes, min-replies = 2)
QUERY_LIES = {
    "num-partitions NaN": ({"num-partitions": math.nan}, "num-partitions=nan is not an integer >= 1"),
    "num-partitions inf": ({"num-partitions": math.inf}, "num-partitions=inf is not an integer >= 1"),
    "num-partitions a list": ({"num-partitions": [1, 2]}, "num-partitions=[1, 2] is not an integer >= 1"),
    "num-partitions 3.0": ({"num-partitions": 3.0}, "num-partitions=3.0 is not an integer >= 1"),
    "num-partitions 0": ({"num-partitions": 0}, "num-partitions=0 is not an integer >= 1"),
    "num-partitions 99": ({"num-partitions": 99, "partition-id": 1},
                          "num-partitions=99 differs from the federation's 3 (what 2 of 3 nodes report)"),
    "partition-id NaN": ({"partition-id": math.nan}, "partition-id=nan is not an integer >= 0"),
    "partition-id -1": ({"partition-id": -1}, "partition-id=-1 is not an integer >= 0"),
    "partition-id 5": ({"partition-id": 5}, "partition-id=5 is not below its num-partitions=3"),
    "partition-id of another node": ({"partition-id": 0}, "nodes 1000 and 1001 both claim partition-id=0"),
    "a ConfigRecord only": (RecordDict({"c": ConfigRecord({"partition-id": 1})}),
                            "the query reply carries 0 MetricRecords, expected exactly one"),
}


@pytest.fixture(scope="module")
def absent_reference(tmp_path_factory):
    """The same run without partition 1's node (it never connected: the run starts after
    node-wait with min-replies = 2)."""
    nodes = [{"partition-id": p, "num-partitions": 3} for p in (0, 2)]
    return run(tmp_path_factory.mktemp("ref"), "ref", FaultyGrid, failures={}, node_configs=nodes)


@pytest.mark.parametrize("case", sorted(QUERY_LIES))
def test_a_lying_query_reply_excludes_its_node_and_the_run_goes_on(case, tmp_path, absent_reference):
    answer, reason = QUERY_LIES[case]
    folder, grid = run_grid(tmp_path, "run", QueryLiar, answer=answer)
    _, rows = read_results(folder / "results.jsonl")
    assert [r["replies"] for r in rows[1:]] == [2, 2]
    assert 1001 not in {m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "train"}
    assert any(f.startswith("node 1001: query reply excluded, ") and reason in f for f in rows[1]["failures"]), \
        rows[1]["failures"]
    assert_same_weights(folder, absent_reference)


def test_a_lying_query_reply_without_min_replies_is_a_clear_error(tmp_path):
    with pytest.raises(FederationError, match=r"only 2 of the federation's 3 nodes connected within node-wait=2 s; "
                                              r"node 1001 excluded: num-partitions=nan is not an integer >= 1"):
        run_grid(tmp_path, "run", QueryLiar, {"min-replies": 0}, answer={"num-partitions": math.nan})
