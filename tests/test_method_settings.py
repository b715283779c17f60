"""A method owns its settings: its own keys (TOML key, type, default, check, doc) declared once in
its module reach the run config, ``[tool.flwr.app.config]``, the Flower strategy's arguments, the
round's config and its client side; its defaults for shared keys apply where a run leaves them
(SCAFFOLD: clip off); the docs tables are generated from the registry and checked here."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import torch

from strategies.flower_api.strategy import flower_strategy
from strategies.methods import METHODS, own_keys
from strategies.methods.algorithm import own_key
from strategies.methods.celgc import CELGC
from tasks.config import RunConfig, config_keys

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TiltSettings:
    tilt: float = own_key("tilt", "scales the client's lr and clip", default=1.0, check=lambda v: 0 < v <= 4,
                          rule="in (0, 4]")


class TiltedCELGC(CELGC):
    """CELGC whose clients scale lr and clip by its own key ``tilt``, read from the round's config."""

    name = "tilted"
    Settings = TiltSettings

    @classmethod
    def client(cls, exchange, group):
        tilt = cls.options_of(exchange.settings).tilt
        s = exchange.settings
        exchange.settings = s.replace(lr=s.lr * tilt, clip=s.clip * tilt)
        return super().client(exchange, group)


@pytest.fixture
def tilted(monkeypatch):
    monkeypatch.setitem(METHODS, TiltedCELGC.name, TiltedCELGC)
    return TiltedCELGC.name


def test_own_keys_are_run_config_keys(tilted):
    cfg = RunConfig.from_mapping({"algorithm": tilted, "tilt": "0.5"})
    assert cfg.method_options == {"tilt": 0.5} and cfg.to_mapping()["tilt"] == 0.5
    assert RunConfig.from_mapping(cfg.to_mapping()) == cfg
    assert RunConfig().to_mapping()["tilt"] == 1.0  # every method's keys, at their defaults
    assert ("tilt", 1.0, "algorithm 'tilted': scales the client's lr and clip") in config_keys()
    assert own_keys()["tilt"][0] == tilted


@pytest.mark.parametrize("values, message", [
    ({"algorithm": "tilted", "tlit": 0.5}, r"unknown config key\(s\) \['tlit'\] \(did you mean 'tilt' for 'tlit'\?\)"),
    ({"algorithm": "tilted", "tilt": 0}, r"tilt must be in \(0, 4\], got 0.0"),
    ({"algorithm": "tilted", "tilt": "steep"}, r"tilt must be a number, got 'steep'"),
    ({"algorithm": "celgc", "tilt": 0.5}, r"tilt is a setting of algorithm 'tilted', not of 'celgc'"),
])
def test_bad_own_keys_are_named(tilted, values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_mapping(values)


def test_the_strategy_takes_own_keys_as_arguments_and_sends_them(tilted):
    strategy = flower_strategy(TiltedCELGC)(lr=0.1, tilt=0.25)
    assert strategy.algorithm.options.tilt == 0.25
    settings = strategy.algorithm.round_settings(1, CELGC.modes[0], 0.1, 1.0)
    assert settings.to_config()["tilt"] == 0.25 and settings.algorithm == tilted
    with pytest.raises(ValueError, match=r"tilt must be in \(0, 4\], got 9.0"):
        flower_strategy(TiltedCELGC)(lr=0.1, tilt=9)
    with pytest.raises(ValueError, match=r"has no setting\(s\) \['tlit'\] \(did you mean 'tilt'"):
        TiltedCELGC.parse_options({"tlit": 1.0})


def test_own_key_reaches_the_client_side_on_every_backend(runs, tilted):
    config = {"algorithm": tilted, "tilt": 0.5, "num-clients": 3}
    flower = runs.flower("flower", **config)
    runs.same(flower, runs.engine("engine", "sequential", **config), exact=True)
    plain = runs.flower("plain", **{**config, "tilt": 1.0})
    assert any(not torch.equal(flower[0][k], v) for k, v in plain[0].items())


def test_a_method_sets_its_defaults_for_shared_keys():
    """SCAFFOLD and local SGD take unclipped steps: clip is off unless the run sets it."""
    assert math.isinf(RunConfig.from_mapping({"algorithm": "scaffold"}).clip)
    assert math.isinf(RunConfig(algorithm="local-sgd").clip)
    assert RunConfig().clip == 0.3  # CELGC keeps the shared default
    with pytest.raises(ValueError, match="clip must be \"off\" for algorithm 'scaffold'"):
        RunConfig.from_mapping({"algorithm": "scaffold", "clip": 1.0})
    assert math.isinf(METHODS["scaffold"].with_shared_defaults(RunConfig().hyper).clip)


def test_a_shared_value_the_method_replaces_is_said(tmp_path, caplog):
    """algorithm = "scaffold" with clip = 0.3 (the shared default) runs unclipped: the engine names an
    explicit clip = 0.3 (a warning), the ServerApp, which cannot tell set from default, names the
    replacement in its log; nothing is said where nothing is replaced."""
    import logging

    from simulations.engine.run import parse
    from simulations.loopback import run_in_process
    from tasks.config import shared_default_notes

    values = {**RunConfig().to_mapping(), "algorithm": "scaffold"}
    line = ("algorithm 'scaffold' runs with clip = off, its own default: the run's clip = 0.3 ({}) equals the shared "
            "default, which a method's own default replaces")
    assert shared_default_notes(values) == [line.format("set in the run config, or left at the shared default")]
    assert shared_default_notes(values, explicit={"clip", "algorithm"}) == [line.format("set explicitly")]
    assert shared_default_notes(values, explicit={"algorithm"}) == []  # left at the default: nothing to say
    assert shared_default_notes({**values, "algorithm": "celgc"}) == []
    assert shared_default_notes({**values, "algorithm": "local-sgd"})[0].startswith("algorithm 'local-sgd' runs with clip = off")
    with caplog.at_level(logging.WARNING, logger="simulations.engine"):
        cfg, _, _ = parse(["--config", str(ROOT / "pyproject.toml"), "--run-config", "algorithm='scaffold' clip=0.3"])
    assert math.isinf(cfg.clip) and line.format("set explicitly") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="simulations.engine"):
        parse(["--config", str(ROOT / "pyproject.toml"), "--run-config", "algorithm='scaffold'"])
    assert "runs with clip" not in caplog.text
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # flwr's logger does not propagate
    logging.getLogger("flwr").addHandler(handler)
    try:
        run_in_process({"algorithm": "scaffold", "num-clients": 2, "num-rounds": 1, "local-steps": 1,
                        "results-dir": str(tmp_path), "run-name": "s"})
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert line.format("set in the run config, or left at the shared default") in seen


def test_pyproject_lists_every_own_key_at_its_default():
    app_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    for key, (_, f) in own_keys().items():
        assert app_config[key] == f.default, key


def test_the_docs_tables_are_generated_from_the_registry():
    from simulations.docs_tables import stale

    assert stale() == [], "run: python -m simulations.docs_tables"
