"""The client API (strategies.clientapp): settings, I clipped steps over any batches, the reply."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from client.app import train as project_train
from simulations.loopback import LoopbackGrid
from strategies import CELGC
from strategies.clientapp import ConfigError, RoundSettings, local_update, round_settings, train_reply
from tasks.config import RunConfig

CONFIG = {"server-round": 1, "local-steps": 3, "batch-size": 4, "lr": 0.1, "clip": 0.5, "weight-decay": 0.0,
          "momentum": 0.0}


def data(n=12):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def model():
    torch.manual_seed(0)
    return nn.Linear(5, 3)


def ce(m, batch):
    x, y = batch
    return nn.functional.cross_entropy(m(x), y)


def train_message(config: dict) -> Message:
    LoopbackGrid(None, {}, 1)  # sets the run identity a Message needs, as a running ServerApp has
    content = RecordDict({"arrays": ArrayRecord(model().state_dict()), "config": ConfigRecord(config)})
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def test_missing_keys_are_all_named_and_the_strategy_too():
    with pytest.raises(ConfigError) as err:
        round_settings(train_message({"server-round": 1}))
    text = str(err.value)
    for key in ("local-steps", "batch-size", "lr", "clip", "weight-decay", "momentum"):
        assert repr(key) in text
    assert "CELGC" in text


def test_bad_values_are_named():
    with pytest.raises(ConfigError, match=r"local-steps=0.*batch-size='4'"):
        RoundSettings.from_config({**CONFIG, "local-steps": 0, "batch-size": "4"})


def test_settings_are_what_celgc_sends():
    s = CELGC(local_steps=3, lr=0.1, clip=0.5, batch_size=4, num_clients=1)
    (msg,) = s.configure_train(1, ArrayRecord(model().state_dict()), ConfigRecord(), LoopbackGrid(None, {}, 1))
    settings = round_settings(msg)
    assert (settings.local_steps, settings.batch_size, settings.step.lr, settings.step.clip) == (3, 4, 0.1, 0.5)


def test_project_client_app_driven_by_another_strategy_names_every_key():
    cfg = RunConfig().to_mapping()
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 8}, state=RecordDict(),
                      run_config=cfg)
    msg = train_message({"server-round": 1})  # what FedAvg sends
    msg.metadata.__dict__["_message_id"] = "m1"
    with pytest.raises(ConfigError, match="'lr', 'clip'"):
        project_train(msg, context)


def test_tuples_dicts_and_custom_batches_give_the_same_update():
    x, y = data()
    settings = RoundSettings.from_config(CONFIG)
    tuples = [(x[i:i + 4], y[i:i + 4]) for i in range(0, 12, 4)]
    dicts = [{"img": a, "label": b} for a, b in tuples]

    class Batch:
        def __init__(self, a, b):
            self.a, self.b = a, b

    customs = [Batch(a, b) for a, b in tuples]
    runs = [
        (tuples, ce, None),
        (dicts, lambda m, b: ce(m, (b["img"], b["label"])), None),
        (customs, lambda m, b: ce(m, (b.a, b.b)), lambda b: len(b.a)),
    ]
    results = []
    for batches, loss, count in runs:
        m = model()
        metrics = local_update(m, batches, loss, settings, count=count)
        results.append((m.weight.detach().clone(), metrics))
    for w, metrics in results[1:]:
        assert torch.equal(w, results[0][0]) and metrics == results[0][1]
    assert results[0][1]["num-examples"] == 12 and results[0][1]["num-steps"] == 3


def test_custom_batches_without_count_are_a_clear_error():
    class Batch:
        x = torch.zeros(2, 5)

    with pytest.raises(TypeError, match="count="):
        local_update(model(), [Batch()], lambda m, b: m(b.x).sum(), RoundSettings.from_config({**CONFIG, "local-steps": 1}))


def test_a_short_dataloader_is_restarted_and_an_iterator_is_not():
    x, y = data(8)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)  # 2 batches, local-steps 3
    settings = RoundSettings.from_config(CONFIG)
    metrics = local_update(model(), loader, ce, settings)
    assert metrics["num-steps"] == 3 and metrics["num-examples"] == 12
    with pytest.raises(ValueError, match="ran out after 2 of local-steps=3"):
        local_update(model(), iter(loader), ce, settings)


def test_a_long_dataloader_gives_exactly_local_steps_batches():
    x, y = data(40)
    metrics = local_update(model(), DataLoader(TensorDataset(x, y), batch_size=4), ce, RoundSettings.from_config(CONFIG))
    assert metrics["num-steps"] == 3 and 0.0 <= metrics["clip-fraction"] <= 1.0


def test_train_reply_is_what_celgc_reads():
    m = model()
    metrics = local_update(m, [(x, y) for x, y in [data(4)]], ce, RoundSettings.from_config({**CONFIG, "local-steps": 1}))
    reply = train_reply(train_message(CONFIG), m, metrics, extra={"train_loss": 1.5})
    assert len(reply.content.array_records) == 1 and len(reply.content.metric_records) == 1
    record = reply.content["metrics"]
    assert record["num-examples"] == 4 and record["train_loss"] == 1.5 and "clip-fraction" in record
    with pytest.raises(ValueError, match="num-examples"):
        train_reply(train_message(CONFIG), m, {"num-examples": 2.5})
