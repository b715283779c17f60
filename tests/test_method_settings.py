"""A method owns its settings: its own keys (key, type, default, check, doc) declared once in its
module reach the run config (scoped by the method's name: ``<name>.<key>``, or the table
``[<name>]``), ``[tool.flwr.app.config]``, the Flower strategy's arguments, the round's config and
its client side; two methods may each have a key of the same name, and a value meant for one never
reaches the other; its defaults for shared keys apply where a run leaves them (SCAFFOLD: clip off);
the docs tables are generated from the registry and checked here."""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
import torch

from strategies.flower_api.strategy import flower_strategy
from strategies.methods import METHODS, ROUND_KEYS, declaration_problems, own_keys
from strategies.methods.algorithm import Algorithm, own_key
from strategies.methods.celgc import CELGC
from tasks.config import RunConfig, comparable, config_keys, shared_keys

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


@dataclass(frozen=True)
class SteepSettings:
    tilt: float = own_key("tilt", "the same key name as TiltedCELGC's, another default", default=2.0,
                          check=lambda v: 0 < v <= 4, rule="in (0, 4]")


class SteepCELGC(TiltedCELGC):
    """A second method with a key named ``tilt`` (its own default): both are registered at once."""

    name = "steep"
    Settings = SteepSettings


@pytest.fixture
def tilted(monkeypatch):
    monkeypatch.setitem(METHODS, TiltedCELGC.name, TiltedCELGC)
    monkeypatch.setitem(METHODS, SteepCELGC.name, SteepCELGC)
    return TiltedCELGC.name


def test_own_keys_are_run_config_keys_under_the_method_name(tilted):
    cfg = RunConfig.from_mapping({"algorithm": tilted, "tilted.tilt": "0.5"})
    assert cfg.method_options == {"tilt": 0.5} and cfg.to_mapping()["tilted.tilt"] == 0.5
    assert RunConfig.from_mapping(cfg.to_mapping()) == cfg
    assert "tilted.tilt" not in RunConfig().to_mapping()  # a run records its own method's keys only
    assert ("tilted.tilt", 1.0, "algorithm 'tilted': scales the client's lr and clip") in config_keys()
    assert own_keys()["tilted.tilt"][0] == tilted and own_keys()["steep.tilt"][0] == "steep"
    # the TOML table [tilted] (nested) and the dotted key are one key
    assert RunConfig.from_mapping({"algorithm": tilted, "tilted": {"tilt": 0.5}}) == cfg


def test_two_methods_with_a_key_of_one_name_each_read_their_own(tilted):
    """Every registered method's keys at their defaults (as ``flwr run`` passes the app's config):
    each method runs with its own default, never the other's."""
    everything = {k: f.default for k, (_, f) in own_keys().items()}
    assert RunConfig.from_mapping({**everything, "algorithm": "tilted"}).method_options == {"tilt": 1.0}
    assert RunConfig.from_mapping({**everything, "algorithm": "steep"}).method_options == {"tilt": 2.0}
    cfg = RunConfig.from_mapping({**everything, "algorithm": "steep", "steep.tilt": 0.5})
    assert cfg.method_options == {"tilt": 0.5}


@pytest.mark.parametrize("values, message", [
    ({"algorithm": "tilted", "tilted.tlit": 0.5}, r"did you mean 'tilted.tilt' for 'tilted.tlit'\?"),
    ({"algorithm": "tilted", "tilted.tilt": 0}, r"tilted.tilt must be in \(0, 4\], got 0.0"),
    ({"algorithm": "tilted", "tilted.tilt": "steep"}, r"tilted.tilt must be a number, got 'steep'"),
    ({"algorithm": "celgc", "tilted.tilt": 0.5},
     r"tilted.tilt = 0.5 is a setting of algorithm 'tilted', not of the running algorithm 'celgc' \(set algorithm = "
     r"\"tilted\", or leave tilted.tilt at its default 1.0\)"),
    ({"algorithm": "steep", "tilted.tilt": 0.5},
     r"tilted.tilt = 0.5 is a setting of algorithm 'tilted', not of the running algorithm 'steep' .*the running "
     r"method's own is steep.tilt"),
    ({"algorithm": "steep", "tilt": 0.5},
     r"'tilt' is a method's own key, written under the method's name: tilted.tilt, steep.tilt \(the running "
     r"algorithm 'steep' reads steep.tilt\)"),
    ({"algorithm": "tilted", "tilte.tilt": 0.5}, r"no method named 'tilte' here \(did you mean 'tilted'\?\)"),
    ({"algorithm": "tilted", "tilted.lr": 0.5}, r"tilted.lr: lr is a key every method reads, written without a "
                                                r"method's name \(lr = ...\)"),
])
def test_bad_own_keys_are_named(tilted, values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_mapping(values)


def test_a_table_of_a_method_unknown_here_is_left_unread_only_where_the_app_config_lists_it(tilted):
    """``[tool.flwr.app.config]`` may list the keys of a method of yours (``flwr run`` takes only keys
    listed there); another method's run leaves them unread. Elsewhere (an override file, the engine's
    --run-config) such a key is refused: it could only be a typo there."""
    app = {**RunConfig().to_mapping(), "mine.rate": 0.1}
    assert RunConfig.from_app(app) == RunConfig()
    assert RunConfig.from_mapping({**app, "algorithm": tilted}, declared=app).method_options == {"tilt": 1.0}
    with pytest.raises(ValueError, match=r"'mine.rate': no method named 'mine' here"):
        RunConfig.from_mapping(app)


def test_the_engine_reads_a_pyproject_with_method_tables(tmp_path, tilted):
    (tmp_path / "pyproject.toml").write_text(
        "[tool.flwr.app.config]\nalgorithm = \"tilted\"\nsteep.tilt = 2.0\n\n"
        "[tool.flwr.app.config.tilted]\ntilt = 0.5\n\n[tool.flwr.app.config.mine]\nrate = 0.1\n")
    assert RunConfig.from_toml(tmp_path / "pyproject.toml").method_options == {"tilt": 0.5}
    assert RunConfig.from_toml(tmp_path / "pyproject.toml", {"tilted.tilt": 0.25}).method_options == {"tilt": 0.25}
    with pytest.raises(ValueError, match="no method named 'mne'"):
        RunConfig.from_toml(tmp_path / "pyproject.toml", {"mne.rate": 0.2})


def test_an_experiment_file_and_a_sweep_take_a_method_table(tmp_path, tilted):
    from simulations.runner import load_plan

    file = tmp_path / "tilted.toml"
    file.write_text("algorithm = \"tilted\"\nnum-clients = 2\n\n[tilted]\ntilt = 0.5\n")
    assert RunConfig.from_mapping(load_plan(file, results_dir=tmp_path)).method_options == {"tilt": 0.5}
    file.write_text("algorithm = \"tilted\"\nnum-clients = 2\nvalid-fraction = 0.1\n\n"
                    "[sweep]\ntilted.tilt = [0.5, 2.0]\nseeds = 1\ntune = { num-rounds = 1 }\n")
    sweep = load_plan(file, results_dir=tmp_path)
    assert sweep.grid == {"tilted.tilt": [0.5, 2.0]} and sweep.tune == {"num-rounds": 1}
    points = [RunConfig.from_mapping(sweep.values_for(p)).method_options["tilt"] for p in sweep.points]
    assert points == [0.5, 2.0]


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
    config = {"algorithm": tilted, "tilted.tilt": 0.5, "num-clients": 3}
    flower = runs.flower("flower", **config)
    runs.same(flower, runs.engine("engine", "sequential", **config), exact=True)
    plain = runs.flower("plain", **{**config, "tilted.tilt": 1.0})
    assert any(not torch.equal(flower[0][k], v) for k, v in plain[0].items())


def test_names_and_keys_that_would_clash_are_refused():
    @dataclass(frozen=True)
    class Clashing:
        lr: float = own_key("lr", "a key the round's config carries already", default=0.1)
        dotted: float = own_key("a.b", "a dot", default=0.1)

    class Bad(CELGC):
        name = "bad.name"
        Settings = Clashing

    problems = declaration_problems(Bad)
    assert any("must set its own name" in p and "'bad.name'" in p for p in problems)
    assert any("own key 'lr' is a key every round's config carries" in p for p in problems)
    assert any("own key 'a.b' must be letters, digits" in p for p in problems)
    assert all(not declaration_problems(cls) for cls in METHODS.values())
    assert not set(METHODS) & set(shared_keys())  # a name scopes keys: never a run-config key of its own
    assert "clients" in ROUND_KEYS


def test_a_run_recorded_with_bare_keys_compares_equal():
    """Results headers and checkpoints written before the keys were scoped hold them bare
    (``server-momentum``) and every registered method's at its default: the same run compares
    equal to today's config (a sweep skips it as finished, a resume is allowed)."""
    from tasks.runs.checkpoint import check_resumable

    now = RunConfig.from_mapping({"algorithm": "fedavgm", "fedavgm.server-momentum": 0.7}).to_mapping()
    old = {k: v for k, v in now.items() if not k.startswith("fedavgm.")}
    old.update({"server-momentum": 0.7, "server-lr": 1.0, "proximal-mu": 0.0})
    assert comparable(old) == comparable(now)
    check_resumable(old, now)
    celgc = RunConfig().to_mapping()
    assert comparable({**celgc, "server-momentum": 0.9, "server-lr": 1.0, "proximal-mu": 0.0}) == comparable(celgc)
    assert comparable({**old, "server-momentum": 0.5}) != comparable(now)


def test_a_record_from_before_a_key_existed_compares_at_its_default():
    now = RunConfig().to_mapping()
    before = {k: v for k, v in now.items() if k not in ("transport", "node-aggregation")}
    assert comparable(before) == comparable(now)  # a sweep or checkpoint of then still counts
    assert comparable(before) != comparable({**now, "transport": "bfloat16"})  # ... unless the key is set


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

    def notes(values, **kw):
        return shared_default_notes(RunConfig.from_mapping(values), values, **kw)

    values = {**RunConfig().to_mapping(), "algorithm": "scaffold"}
    line = ("algorithm 'scaffold' runs with clip = off, its own default: the run's clip = 0.3 ({}) equals the shared "
            "default, which a method's own default replaces")
    assert notes(values) == [line.format("set in the run config, or left at the shared default")]
    assert notes(values, explicit={"clip", "algorithm"}) == [line.format("set explicitly")]
    assert notes(values, explicit={"algorithm"}) == []  # left at the default: nothing to say
    assert notes({**values, "algorithm": "celgc"}) == []
    assert notes({**values, "algorithm": "local-sgd"})[0].startswith("algorithm 'local-sgd' runs with clip = off")
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
    from tasks.overrides import flatten

    app_config = flatten(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    for key, (_, f) in own_keys().items():
        assert app_config[key] == f.default, key
    own = {"naive": {"local-steps": 1}, "single": {"num-clients": 1}}  # constraints of their own
    for name in METHODS:  # the whole app config (what flwr run passes) runs every method
        assert RunConfig.from_app({**app_config, "algorithm": name, **own.get(name, {})}).algorithm == name


def test_the_docs_tables_are_generated_from_the_registry():
    from simulations.docs_tables import stale

    assert stale() == [], "run: python -m simulations.docs_tables"


def test_the_method_guide_lists_every_class_attribute_a_method_may_set():
    """docs/ALGORITHMS.md's table of class attributes names each of ``Algorithm``'s (``needs_global``
    included) and the server-optimiser base's."""
    from strategies.methods.fedopt import AdaptiveFedOpt, FedOpt

    text = (ROOT / "docs" / "ALGORITHMS.md").read_text()
    section = text[text.index("## Class attributes a method may set"):]
    section = section[:section.index("\n## ", 1)]
    listed = set(re.findall(r"^\| `(\w+)`", section, flags=re.M))
    for cls in (Algorithm, FedOpt, AdaptiveFedOpt):
        hints = typing.get_type_hints(cls)
        attrs = {k for k, v in hints.items() if typing.get_origin(v) is typing.ClassVar}
        assert attrs <= listed, sorted(attrs - listed)
    assert {"needs_global", "Settings", "shared_defaults", "slots"} <= listed
