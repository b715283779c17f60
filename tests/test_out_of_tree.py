"""A method outside the project: ``algorithm = "package.module:Class"`` (like ``task``) runs on the
Flower path and the engine with its own keys, nothing of the project edited; a node runs it only
when its own run config names it."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from strategies.core.settings import ConfigError, RoundSettings
from strategies.methods import LOADED, client_side
from tasks.config import RunConfig

MODULE = "oot_shrunk_method"
PATH = f"{MODULE}:Shrunk"
SOURCE = '''
from dataclasses import dataclass

from strategies.methods.algorithm import own_key
from strategies.methods.celgc import CELGC


@dataclass(frozen=True)
class ShrunkSettings:
    shrink: float = own_key("shrink", "factor on the clients' lr and clip", default=0.5,
                            check=lambda v: 0 < v <= 1, rule="in (0, 1]")


class Shrunk(CELGC):
    """CELGC's server and exchange kind; clients step with lr and clip times its own key."""

    name = "shrunk"
    Settings = ShrunkSettings

    @classmethod
    def client(cls, exchange, group):
        f = cls.options_of(exchange.settings).shrink
        s = exchange.settings
        exchange.settings = s.replace(lr=s.lr * f, clip=s.clip * f)
        return super().client(exchange, group)


NotAMethod = 3
'''


@pytest.fixture
def outside(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    monkeypatch.setattr("strategies.methods.LOADED", {})
    return PATH


def test_a_method_by_import_path_runs_on_every_backend(runs, outside):
    config = {"algorithm": outside, "shrink": 0.25, "num-clients": 3}
    flower = runs.flower("flower", **config)
    runs.same(flower, runs.engine("engine", "sequential", **config), exact=True)
    celgc = runs.flower("celgc", **{"num-clients": 3})  # its key is unknown to another method's run
    assert any(not torch.equal(flower[0][k], v) for k, v in celgc[0].items())


@pytest.mark.parametrize("values, message", [
    ({"algorithm": PATH, "shrnk": 0.3}, r"did you mean 'shrink' for 'shrnk'\?"),
    ({"algorithm": PATH, "shrink": 2}, r"shrink must be in \(0, 1\], got 2.0"),
    ({"algorithm": f"{MODULE}:NotAMethod"}, r"is not a method: NotAMethod must be a concrete subclass"),
    ({"algorithm": "no_such_module_here:Method"}, r"module 'no_such_module_here' does not import"),
    ({"algorithm": "fed avg"}, r"algorithm must be one of celgc, .* or an import path"),
])
def test_bad_paths_and_keys_are_named(outside, values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_mapping(values)


def test_a_node_runs_only_the_method_its_run_config_names(outside):
    settings = RoundSettings(server_round=1, local_steps=1, batch_size=4, lr=0.1, clip=1.0, weight_decay=0.0,
                             momentum=0.0, algorithm="shrunk", extra={"shrink": 0.5})
    with pytest.raises(ConfigError, match="'shrunk', which this node does not have"):
        client_side(settings)  # a round naming a method this node's run config did not load
    RunConfig.from_mapping({"algorithm": outside})  # the node's run config names it: loaded
    from strategies import methods

    assert client_side(settings) is methods.LOADED["shrunk"]
    assert LOADED is not methods.LOADED  # the fixture's registry, not the process's
