"""FedAvg's contract, checked on CELGC with ``aggregation="examples"``.

Ported (rewritten, not copied) from what Flower 1.42 tests and documents for its message
strategies: ``serverapp/strategy/strategy_utils_test.py`` (weighted averaging of ArrayRecords
and MetricRecords with float weights and 0-dim arrays; reply consistency: one ArrayRecord,
one MetricRecord, the weight key present and a scalar, matching keys), ``fedavgm_test.py``
(``aggregate_train`` called on replies without a prior ``configure_train``), and the
parameters of ``FedAvg`` (``fraction_train``/``fraction_evaluate``, ``min_*_nodes``,
``weighted_by_key``, ``arrayrecord_key``, ``configrecord_key``, ``train_metrics_aggr_fn``,
``evaluate_metrics_aggr_fn``, ``server-round`` in every config, ``Strategy.start``).

Where CELGC is stricter than FedAvg, on purpose, the test says so: an inconsistent reply is
rejected (and the rest averaged) where FedAvg skips the whole round, unless every reply is
rejected for the same reason; the caller's config record is not mutated. Not ported:
FedAvg's averaging of integer arrays into floats (CELGC keeps integer buffers integer,
``test_strategy.py``), and waiting for ``min_available_nodes`` (Flower polls with a
one-second sleep; no timed tests here).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy import FedAvg

from simulations.loopback import LoopbackGrid
from strategies import CELGC


class Reply:
    """A reply Message as ``aggregate_train`` reads it (content, error, source node)."""

    def __init__(self, content: RecordDict, node: int = 1, error=None) -> None:
        self.content = content
        self.error = error
        self.metadata = type("Meta", (), {"src_node_id": node})()

    def has_error(self) -> bool:
        return self.error is not None


def arrays_reply(arrays: list[np.ndarray], node: int = 1, **metrics) -> Reply:
    return Reply(RecordDict({"arrays": ArrayRecord(arrays), "metrics": MetricRecord(metrics)}), node=node)


def celgc(**kw) -> CELGC:
    return CELGC(**{"local_steps": 2, "lr": 0.1, "aggregation": "examples", **kw})


def grid(nodes: int, client=None) -> LoopbackGrid:
    return LoopbackGrid(client or (lambda m, c: None), {}, nodes)


# --- aggregation of ArrayRecords ----------------------------------------------------------
def test_arrays_weighted_by_float_weights():
    rng = np.random.default_rng(0)
    weights = [0.25, 0.4, 0.35]
    arrays = [[rng.standard_normal((7, 3)).astype(np.float32) for _ in range(4)] for _ in weights]
    replies = [arrays_reply(a, node=i, weight=w) for i, (a, w) in enumerate(zip(arrays, weights))]
    out, _ = celgc(weighted_by_key="weight").aggregate_train(1, replies)
    expected = [np.average([a[i] for a in arrays], axis=0, weights=weights) for i in range(4)]
    for got, want in zip(out.to_numpy_ndarrays(), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_float_weights_are_not_truncated():
    replies = [arrays_reply([np.array([1.0], np.float32)], **{"num-examples": 1.5}),
               arrays_reply([np.array([3.0], np.float32)], **{"num-examples": 2.5})]
    out, _ = celgc().aggregate_train(1, replies)
    assert out.to_numpy_ndarrays()[0][0] == pytest.approx(2.25)  # (1.5 * 1 + 2.5 * 3) / 4, not 2.333


def test_zero_dim_arrays():
    replies = [arrays_reply([np.array(1.0, np.float32)], **{"num-examples": 1}),
               arrays_reply([np.array(3.0, np.float32)], **{"num-examples": 2})]
    out, _ = celgc().aggregate_train(1, replies)
    value = out.to_numpy_ndarrays()[0]
    assert value.shape == () and value == pytest.approx(7.0 / 3.0)


def test_aggregate_train_without_configure_train():
    w0 = [np.array([[1, 2, 3], [4, 5, 6]], np.float32), np.array([7, 8, 9, 10], np.float32)]
    w1 = [np.array([[29, 23, 19], [17, 13, 11]], np.float32), np.array([7, 5, 3, 2], np.float32)]
    out, metrics = celgc().aggregate_train(1, [arrays_reply(w0, **{"num-examples": 1}), arrays_reply(w1, **{"num-examples": 2})])
    for got, a, b in zip(out.to_numpy_ndarrays(), w0, w1):
        np.testing.assert_allclose(got, (a * 1 + b * 2) / 3, rtol=1e-6)
    assert metrics["replies"] == 2 and metrics["rejected-replies"] == 0


def test_without_configure_train_replies_are_checked_against_each_other():
    good = [np.zeros(3, np.float32)]
    one = {"num-examples": 1}
    replies = [arrays_reply(good, node=1, **one), arrays_reply([np.ones(3, np.float32)], node=2, **one),
               arrays_reply([np.zeros(4, np.float32)], node=3, **one)]
    s = celgc()
    out, metrics = s.aggregate_train(1, replies)
    np.testing.assert_allclose(out.to_numpy_ndarrays()[0], np.full(3, 0.5))
    assert metrics["rejected-replies"] == 1 and "node 3" in s.last_failures[0] and "shape" in s.last_failures[0]


def test_uniform_averaging_is_the_default():
    replies = [arrays_reply([np.array([1.0], np.float32)], **{"num-examples": 1}),
               arrays_reply([np.array([3.0], np.float32)], **{"num-examples": 3})]
    out, _ = CELGC(local_steps=2, lr=0.1).aggregate_train(1, replies)
    assert out.to_numpy_ndarrays()[0][0] == pytest.approx(2.0)  # the paper; FedAvg would give 2.5


# --- weighted_by_key and reply consistency -------------------------------------------------
def test_weighted_by_key_is_honoured():
    replies = [arrays_reply([np.array([1.0], np.float32)], n=1), arrays_reply([np.array([4.0], np.float32)], n=2)]
    out, _ = celgc(weighted_by_key="n").aggregate_train(1, replies)
    assert out.to_numpy_ndarrays()[0][0] == pytest.approx(3.0)


def test_replies_without_the_weight_key_stop_the_round_naming_it():
    replies = [arrays_reply([np.array([1.0], np.float32)], node=i, num_examples=1) for i in range(3)]
    with pytest.raises(InconsistentMessageReplies, match="num-examples"):
        celgc().aggregate_train(1, replies)  # keyed num_examples by the clients: FedAvg raises too


@pytest.mark.parametrize("content,needle", [
    (RecordDict({"a": ArrayRecord([np.zeros(2)]), "metrics": MetricRecord({"weight": [0.1]})}), "weight"),
    (RecordDict({"a": ArrayRecord([np.zeros(2)]), "metrics": MetricRecord({"loss": 0.1})}), "weight"),
    (RecordDict({"a": ArrayRecord([np.zeros(2)])}), "MetricRecord"),
    (RecordDict({"a": ArrayRecord([np.zeros(2)]), "b": ArrayRecord([np.zeros(2)]),
                 "metrics": MetricRecord({"weight": 1.0})}), "ArrayRecord"),
    (RecordDict({"a": ArrayRecord([np.zeros(2)]), "metrics": MetricRecord({"weight": 1.0}),
                 "more": MetricRecord({"loss": 0.3})}), "MetricRecord"),
])
def test_inconsistent_replies_stop_the_round(content, needle):
    with pytest.raises(InconsistentMessageReplies, match=needle):
        celgc(weighted_by_key="weight").aggregate_train(1, [Reply(content, node=i) for i in range(3)])


def test_one_inconsistent_reply_is_rejected_and_the_rest_averaged():
    good = [arrays_reply([np.array([2.0], np.float32)], node=i, **{"num-examples": 1}) for i in range(2)]
    bad = Reply(RecordDict({"arrays": ArrayRecord([np.array([9.0], np.float32)]),
                            "metrics": MetricRecord({"num-examples": [1.0]})}), node=5)
    s = celgc()
    out, metrics = s.aggregate_train(1, [*good, bad])
    assert out.to_numpy_ndarrays()[0][0] == 2.0 and metrics["rejected-replies"] == 1
    assert "node 5" in s.last_failures[0]


def test_arrays_with_other_keys_than_the_global_model_are_rejected():
    s = celgc()
    list(s.configure_train(1, ArrayRecord({"a": Array(np.zeros(2, np.float32))}), ConfigRecord(), grid(2)))
    replies = [Reply(RecordDict({"arrays": ArrayRecord({"b": Array(np.zeros(2, np.float32))}),
                                 "metrics": MetricRecord({"num-examples": 1})}), node=i) for i in range(2)]
    with pytest.raises(InconsistentMessageReplies, match="keys differ"):
        s.aggregate_train(1, replies)


def test_error_replies_are_skipped():
    err = Reply(RecordDict(), node=9, error=type("E", (), {"reason": "boom", "code": 0})())
    out, metrics = celgc().aggregate_train(1, [arrays_reply([np.array([5.0], np.float32)], **{"num-examples": 1}), err])
    assert out.to_numpy_ndarrays()[0][0] == 5.0 and metrics["failed-replies"] == 1


def test_reply_arrays_under_any_record_key():
    reply = Reply(RecordDict({"my-model": ArrayRecord([np.array([5.0], np.float32)]),
                              "my-metrics": MetricRecord({"num-examples": 1})}))
    out, _ = celgc().aggregate_train(1, [reply])
    assert out.to_numpy_ndarrays()[0][0] == 5.0


# --- configure_train / configure_evaluate ---------------------------------------------------
def test_record_keys_and_server_round_in_train_messages():
    s = celgc(arrayrecord_key="global-model", configrecord_key="settings", fraction_train=1.0, min_train_nodes=1)
    caller = ConfigRecord({"extra": 7})
    msgs = list(s.configure_train(4, ArrayRecord([np.zeros(2, np.float32)]), caller, grid(3)))
    assert len(msgs) == 3 and {m.metadata.dst_node_id for m in msgs} == {1000, 1001, 1002}
    for m in msgs:
        assert m.metadata.message_type == MessageType.TRAIN
        assert set(m.content) == {"global-model", "settings"}
        assert m.content["settings"]["server-round"] == 4 and m.content["settings"]["extra"] == 7
    assert dict(caller) == {"extra": 7}  # stricter than FedAvg, which writes server-round into it


def test_fraction_train_and_min_train_nodes_as_fedavg():
    for fraction, minimum, expected in ((0.5, 1, 2), (0.25, 3, 3), (1.0, 2, 4)):
        s = celgc(fraction_train=fraction, min_train_nodes=minimum, min_available_nodes=1)
        f = FedAvg(fraction_train=fraction, min_train_nodes=minimum, min_available_nodes=1)
        ours = list(s.configure_train(1, ArrayRecord([np.zeros(1)]), ConfigRecord(), grid(4)))
        theirs = list(f.configure_train(1, ArrayRecord([np.zeros(1)]), ConfigRecord(), grid(4)))
        assert len(ours) == len(theirs) == expected


def test_fraction_train_zero_trains_no_one():
    s = celgc(fraction_train=0.0)
    assert list(s.configure_train(1, ArrayRecord([np.zeros(1)]), ConfigRecord(), grid(3))) == []


def test_num_clients_is_exact():
    s = celgc(num_clients=2)
    msgs = list(s.configure_train(1, ArrayRecord([np.zeros(1)]), ConfigRecord(), grid(4)))
    assert len(msgs) == 2 and len({m.metadata.dst_node_id for m in msgs}) == 2


def test_configure_evaluate_as_fedavg():
    s = celgc(arrayrecord_key="am", configrecord_key="cf", fraction_evaluate=1.0, min_evaluate_nodes=1)
    msgs = list(s.configure_evaluate(2, ArrayRecord([np.zeros(1)]), ConfigRecord(), grid(3)))
    assert len(msgs) == 3 and all(m.metadata.message_type == MessageType.EVALUATE for m in msgs)
    assert all(set(m.content) == {"am", "cf"} and m.content["cf"]["server-round"] == 2 for m in msgs)
    assert list(celgc(fraction_evaluate=0.0).configure_evaluate(2, ArrayRecord([np.zeros(1)]), ConfigRecord(), grid(3))) == []


def test_train_config_keys_the_strategy_owns_are_refused_by_name():
    s = celgc()
    caller = ConfigRecord({"lr": 0.01, "clip": 2.0, "extra": 1})
    with pytest.raises(ValueError, match=r"'lr', 'clip'.*lr=, clip="):
        list(s.configure_train(1, ArrayRecord([np.zeros(1)]), caller, grid(2)))


# --- metrics --------------------------------------------------------------------------------
def test_clients_metrics_kept_with_the_strategy_counters():
    replies = [arrays_reply([np.array([1.0], np.float32)], node=1, train_loss=1.0, **{"num-examples": 1, "num-steps": 2}),
               arrays_reply([np.array([3.0], np.float32)], node=2, train_loss=2.0, **{"num-examples": 3, "num-steps": 2})]
    _, metrics = celgc().aggregate_train(1, replies)
    assert metrics["train_loss"] == pytest.approx(1.75)  # FedAvg's default: weighted by num-examples
    assert metrics["replies"] == 2 and metrics["num-steps"] == 4 and "bytes-received" in metrics


def test_train_metrics_aggr_fn_is_used():
    seen = []

    def aggr(records, key):
        seen.append((len(records), key))
        return MetricRecord({"mine": 42.0})

    replies = [arrays_reply([np.array([1.0], np.float32)], node=i, n=1, **{"num-steps": 2}) for i in range(2)]
    _, metrics = celgc(weighted_by_key="n", train_metrics_aggr_fn=aggr).aggregate_train(1, replies)
    assert seen == [(2, "n")] and metrics["mine"] == 42.0 and metrics["replies"] == 2


def test_evaluate_metrics_aggr_fn_is_used_and_default_is_weighted():
    replies = [Reply(RecordDict({"m": MetricRecord({"num-examples": n, "acc": a})}), node=i)
               for i, (n, a) in enumerate(((1, 0.5), (3, 0.9)))]
    assert celgc().aggregate_evaluate(1, replies)["acc"] == pytest.approx(0.8)
    out = celgc(evaluate_metrics_aggr_fn=lambda recs, key: MetricRecord({"count": len(recs)})).aggregate_evaluate(1, replies)
    assert dict(out) == {"count": 2}


def test_summary_names_the_record_keys(monkeypatch):
    lines = []
    monkeypatch.setattr("flwr.serverapp.strategy.fedavg.log", lambda level, msg, *a: lines.append(msg % a))
    monkeypatch.setattr("strategies.flower_api.strategy.log", lambda level, msg, *a: lines.append(msg % a))
    celgc(weighted_by_key="n", arrayrecord_key="am", configrecord_key="cf").summary()
    text = "\n".join(lines)
    assert "Weighted by: 'n'" in text and "'am'" in text and "'cf'" in text


def test_replies_without_clipped_sgd_metrics_warn_once(caplog):
    s = celgc()
    replies = [arrays_reply([np.array([1.0], np.float32)], node=i, **{"num-examples": 1}) for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        s.aggregate_train(1, replies)
        s.aggregate_train(2, replies)
    warnings = [r for r in caplog.records if "not running local clipped SGD" in r.getMessage()]
    assert len(warnings) == 1 and "num-steps" in warnings[0].getMessage()


# --- schedule ------------------------------------------------------------------------------
def test_schedule_counts_the_clients_actually_sampled():
    # 2 steps x batch 4 = 8 samples per client a round; train size 16: one epoch = 2 client-rounds
    s = celgc(batch_size=4, train_size=16, lr_milestones=(1.0,), num_clients=4, min_train_nodes=1, min_available_nodes=1)
    arrays = ArrayRecord([np.zeros(1)])
    first = list(s.configure_train(1, arrays, ConfigRecord(), grid(2)))  # only 2 of 4 nodes connected
    assert len(first) == 2 and first[0].content["config"]["lr"] == pytest.approx(0.1)
    second = list(s.configure_train(2, arrays, ConfigRecord(), grid(2)))
    assert second[0].content["config"]["lr"] == pytest.approx(0.01)  # 1 epoch done: decayed on time
    assert s.epoch_at(2) == pytest.approx(2.0)


# --- Strategy.start end to end ---------------------------------------------------------------
def _client(msg: Message, context: Context) -> Message:
    """A FedAvg-style ClientApp: one step towards 1, its own metric, weights by node."""
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    pid = context.node_config["partition-id"]
    new = [a + 1.0 for a in arrays]
    metrics = MetricRecord({"num-examples": float(pid + 1), "train_loss": float(pid), "num-steps": 1})
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


def test_start_runs_rounds_and_keeps_client_metrics():
    s = celgc(num_clients=3, fraction_evaluate=0.0)
    result = s.start(grid=grid(3, _client), initial_arrays=ArrayRecord([np.zeros(2, np.float32)]), num_rounds=2)
    np.testing.assert_allclose(result.arrays.to_numpy_ndarrays()[0], [2.0, 2.0])
    m = result.train_metrics_clientapp[2]
    assert m["train_loss"] == pytest.approx((0 * 1 + 1 * 2 + 2 * 3) / 6) and m["replies"] == 3


def test_start_stops_when_every_reply_is_malformed():
    def bad(msg: Message, context: Context) -> Message:
        out = _client(msg, context)
        out.content["metrics"] = MetricRecord({"num_examples": 1.0})
        return out

    with pytest.raises(InconsistentMessageReplies, match="num-examples"):
        celgc(num_clients=2, fraction_evaluate=0.0).start(grid=grid(2, bad), initial_arrays=ArrayRecord([np.zeros(1)]),
                                                          num_rounds=1)


def test_integer_buffers_stay_integer():  # FedAvg would return floats: CELGC keeps the dtype
    replies = [Reply(RecordDict({"arrays": ArrayRecord({"n": Array(np.array([3], np.int64))}),
                                 "metrics": MetricRecord({"num-examples": 1})}), node=i) for i in range(2)]
    out, _ = celgc().aggregate_train(1, replies)
    assert out.to_torch_state_dict()["n"].dtype == torch.int64
