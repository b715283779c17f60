"""CELGC strategy: averaging by hand, buffers, rejected replies, round config, schedule."""

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from simulations.loopback import LoopbackGrid
from strategies import CELGC
from strategies.core.averaging import average_states, check_state, client_weights, finalize, weighted_sum


def state(w, b, count=3):
    return {"w": torch.tensor(w, dtype=torch.float32), "running_mean": torch.tensor(b, dtype=torch.float32),
            "num_batches_tracked": torch.tensor(count, dtype=torch.int64)}


class Reply:
    """What aggregate_train reads from a reply Message."""

    def __init__(self, content, node=1, error=None):
        self.content = content
        self.error = error
        self.metadata = type("M", (), {"src_node_id": node})()

    def has_error(self):
        return self.error is not None


def reply(st, n_examples, **metrics):
    m = {"num-examples": n_examples, "num-steps": 2, "train-loss": 1.0, "clip-fraction": 0.5, "grad-norm": 2.0,
         "skipped-steps": 0, **metrics}
    return Reply(RecordDict({"arrays": ArrayRecord(st), "metrics": MetricRecord(m)}))


def strategy(**kw):
    args = {"local_steps": 2, "lr": 0.5, "clip": 1.0, "batch_size": 4, "num_clients": 2, **kw}
    return CELGC(**args)


def configured(s, global_state, nodes=2):
    grid = LoopbackGrid(lambda m, c: None, {}, nodes)
    msgs = list(s.configure_train(1, ArrayRecord(global_state), ConfigRecord(), grid))
    return msgs


def test_uniform_average_by_hand():
    s = strategy()
    configured(s, state([0.0, 0.0], [0.0]))
    arrays, metrics = s.aggregate_train(1, [reply(state([1.0, 2.0], [4.0], 2), 10), reply(state([3.0, 6.0], [0.0], 5), 30)])
    out = arrays.to_torch_state_dict()
    torch.testing.assert_close(out["w"], torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(out["running_mean"], torch.tensor([2.0]))
    assert out["num_batches_tracked"].dtype == torch.int64 and out["num_batches_tracked"].item() == 4  # round(3.5)
    assert metrics["replies"] == 2 and metrics["rejected-replies"] == 0 and metrics["num-examples"] == 40


def test_weighted_by_examples_by_hand():
    s = strategy(aggregation="examples")
    configured(s, state([0.0, 0.0], [0.0]))
    arrays, _ = s.aggregate_train(1, [reply(state([1.0, 2.0], [4.0]), 10), reply(state([3.0, 6.0], [0.0]), 30)])
    out = arrays.to_torch_state_dict()
    torch.testing.assert_close(out["w"], torch.tensor([0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * 6]))
    torch.testing.assert_close(out["running_mean"], torch.tensor([1.0]))


@pytest.mark.parametrize("bad,reason", [
    (state([float("nan"), 0.0], [0.0]), "non-finite"),
    (state([float("inf"), 0.0], [0.0]), "non-finite"),
    ({"w": torch.zeros(3), "running_mean": torch.zeros(1), "num_batches_tracked": torch.tensor(1)}, "shape"),
    ({"w": torch.zeros(2)}, "keys differ"),
    ({"w": torch.zeros(2, dtype=torch.float64), "running_mean": torch.zeros(1), "num_batches_tracked": torch.tensor(1)},
     "dtype"),
])
def test_bad_replies_are_rejected_and_never_averaged(bad, reason):
    s = strategy()
    configured(s, state([0.0, 0.0], [0.0]))
    arrays, metrics = s.aggregate_train(1, [reply(state([1.0, 2.0], [4.0]), 10), reply(bad, 10)])
    torch.testing.assert_close(arrays.to_torch_state_dict()["w"], torch.tensor([1.0, 2.0]))
    assert metrics["rejected-replies"] == 1 and metrics["replies"] == 1
    assert reason in s.last_failures[0]


def test_only_bad_replies_leave_no_aggregate():
    s = strategy()
    configured(s, state([0.0, 0.0], [0.0]))
    arrays, metrics = s.aggregate_train(1, [reply(state([float("nan"), 0.0], [0.0]), 10)])
    assert arrays is None and metrics["rejected-replies"] == 1


def test_error_and_missing_replies_count_as_failed():
    s = strategy()
    configured(s, state([0.0, 0.0], [0.0]), nodes=2)
    err = Reply(RecordDict(), node=7, error=type("E", (), {"reason": "boom", "code": 0})())
    _, metrics = s.aggregate_train(1, [err])
    # one error reply + one that never came back
    assert metrics["failed-replies"] == 2
    assert any("boom" in f for f in s.last_failures)


def test_round_config_sent_without_mutating_callers_record():
    s = strategy(weight_decay=1e-4, momentum=0.5)
    caller = ConfigRecord({"extra": 1})
    grid = LoopbackGrid(lambda m, c: None, {}, 2)
    msgs = list(s.configure_train(3, ArrayRecord(state([0.0, 0.0], [0.0])), caller, grid))
    assert dict(caller) == {"extra": 1}
    assert len(msgs) == 2
    sent = dict(msgs[0].content["config"])
    assert sent == {"extra": 1, "local-steps": 2, "lr": 0.5, "clip": 1.0, "weight-decay": 1e-4, "momentum": 0.5,
                    "batch-size": 4, "server-round": 3, "algorithm": "celgc"}


def test_schedule_decays_lr_and_clip_at_global_epoch_milestones():
    # 2 clients x 2 steps x batch 4 = 16 samples a round; train size 32 -> 0.5 epoch a round
    s = strategy(lr_milestones=(1.0, 2.0), lr_decay=0.1, train_size=32)
    expected = {1: 1.0, 2: 1.0, 3: 0.1, 4: 0.1, 5: 0.01, 9: 0.01}  # epochs done before round r: (r-1)/2
    for r, f in expected.items():
        lr, clip = s.round_hparams(r, 2)
        assert lr == pytest.approx(0.5 * f) and clip == pytest.approx(1.0 * f)
        assert clip / lr == pytest.approx(2.0)


def test_clip_off_is_local_sgd():
    s = strategy(clip=math.inf)
    assert math.isinf(s.round_config(1, 2)["clip"])


def test_summary_lists_every_setting(monkeypatch):
    lines = []
    monkeypatch.setattr("strategies.flower_api.strategy.log", lambda level, msg, *args: lines.append(msg % args))
    strategy(lr_milestones=(80, 120), train_size=1000, weight_decay=1e-4).summary()
    text = "\n".join(lines)
    for needle in ("local steps I: 2", "batch size: 4", "lr: 0.5", "clip: 1", "weight decay: 0.0001", "momentum: 0",
                   "[80.0, 120.0]", "aggregation: uniform", "clients per round: 2"):
        assert needle in text, needle


@pytest.mark.parametrize("kw,match", [
    ({"local_steps": 0}, "local_steps"), ({"lr": 0.0}, "lr must"), ({"clip": 0.0}, "clip must"),
    ({"batch_size": 0}, "batch_size"), ({"momentum": 1.0}, "momentum"), ({"aggregation": "mode"}, "aggregation"),
    ({"trim_fraction": 0.5}, "trim_fraction"),
    ({"lr_milestones": (80,)}, "train_size"), ({"num_clients": 0}, "num_clients"), ({"lr_decay": 0.0}, "lr_decay"),
])
def test_strategy_rejects_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        strategy(**kw)


def test_pure_averaging_helpers():
    assert client_weights([1, 3], "uniform") == [0.5, 0.5]
    assert client_weights([1, 3], "examples") == [0.25, 0.75]
    with pytest.raises(ValueError, match="aggregation"):
        client_weights([1], "mean")
    a, b = state([1.0, 1.0], [1.0], 1), state([2.0, 4.0], [3.0], 2)
    summed = weighted_sum([a, b], [1.0, 1.0])  # sum-then-finalise, as a distributed backend does
    out = finalize({k: v / 2 for k, v in summed.items()}, a)
    assert torch.equal(out["w"], average_states([a, b], [0.5, 0.5])["w"])
    assert check_state(a, b) is None
    np.testing.assert_array_equal(out["w"].numpy(), [1.5, 2.5])
