"""Dispatch by name: a round's config names its method, and a client runs exactly that method's
client side -- never another method that happens to use the same exchange kind (``Mode``).

A planted method reuses CELGC's ``Mode.LOCAL`` and server side with a client side of its own
(steps half as long). On the Flower path (the real ServerApp and ClientApp) and on the engine
it must run its own client code: the two agree bit for bit, and differ from CELGC's run.
"""

from __future__ import annotations

import pytest
import torch

from strategies.core.settings import ConfigError, Mode, RoundSettings
from strategies.methods import METHODS, client_side
from strategies.methods.celgc import CELGC

pytest.importorskip("flwr")


class HalfStepCELGC(CELGC):
    """CELGC's server side and exchange kind, its own client side: local steps half as long (lr and clip halved)."""

    name = "half-step-celgc"

    @classmethod
    def client(cls, exchange, group):
        s = exchange.settings
        exchange.settings = s.replace(lr=s.lr / 2, clip=s.clip / 2)
        return super().client(exchange, group)


@pytest.fixture
def planted(monkeypatch):
    monkeypatch.setitem(METHODS, HalfStepCELGC.name, HalfStepCELGC)
    assert HalfStepCELGC.modes == CELGC.modes == (Mode.LOCAL,)
    return HalfStepCELGC.name


def test_a_method_reusing_a_mode_runs_its_own_client_side_on_every_backend(runs, planted):
    config = {"algorithm": planted, "local-steps": 2, "num-clients": 3}
    flower = runs.flower("flower", **config)
    runs.same(flower, runs.engine("engine", "sequential", **config), exact=True)
    celgc = runs.flower("celgc", **{**config, "algorithm": "celgc"})
    assert any(not torch.equal(flower[0][k], v) for k, v in celgc[0].items()), "the planted method ran CELGC's code"
    sent = [next(iter(m.content.config_records.values())) for m in runs.grids["flower"].sent
            if m.metadata.message_type == "train"]
    assert sent and all(config["algorithm"] == planted for config in sent)


def settings(**kw) -> RoundSettings:
    return RoundSettings(server_round=1, local_steps=2, batch_size=4, lr=0.1, clip=1.0, weight_decay=0.0,
                         momentum=0.0, **kw)


def test_the_method_is_found_by_name_not_by_mode():
    assert client_side(settings(algorithm="local-sgd")) is METHODS["local-sgd"]
    assert client_side(settings(algorithm="single")) is METHODS["single"]
    assert client_side(settings(algorithm="celgc")) is CELGC
    assert client_side(settings(algorithm="episode", mode=Mode.RESAMPLE)) is METHODS["episode"]


@pytest.mark.parametrize("kw, message", [
    ({}, "names no method"),
    ({"algorithm": "fedsomething"}, "algorithm 'fedsomething', which this node does not have"),
    ({"algorithm": "naive", "mode": Mode.LOCAL}, "algorithm 'naive' has no exchange of mode 'local'"),
])
def test_a_round_naming_no_known_method_is_a_clear_error(kw, message):
    with pytest.raises(ConfigError, match=message):
        client_side(settings(**kw))


def test_the_round_config_carries_the_name():
    config = settings(algorithm="scaffold", mode=Mode.SCAFFOLD).to_config()
    assert config["algorithm"] == "scaffold"
    assert RoundSettings.from_config(config).algorithm == "scaffold"
    with pytest.raises(ConfigError, match="algorithm=3"):
        RoundSettings.from_config({**config, "algorithm": 3})


def test_the_clientapp_refuses_a_method_it_does_not_have(runs):
    """A train message naming an unknown method: the ClientApp stops with an error naming it."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    from client.app import train
    from tasks import load_task
    from tasks.config import RunConfig

    values = runs.values("unknown")
    model = load_task(RunConfig.from_mapping(values)).build_model()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "config": ConfigRecord(settings(algorithm="fedsomething").to_config())})
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 4}, state=RecordDict(),
                      run_config=values)
    with pytest.raises(ConfigError, match="'fedsomething', which this node does not have"):
        train(Message(content, 1, "train"), context)
