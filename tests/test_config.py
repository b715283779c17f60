"""RunConfig: one validated, frozen object; errors name the key, the value and the range."""

import dataclasses
import math
from pathlib import Path

import pytest
import tomllib

from strategies.methods import own_keys
from tasks.config import RunConfig, config_keys
from tasks.overrides import flatten

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_defaults_are_the_config_defaults():
    app_config = flatten(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
    every_method = {key: f.default for key, (_, f) in own_keys().items()}  # each method's keys, <name>.<key>
    assert app_config == {**RunConfig().to_mapping(), **every_method}
    assert RunConfig.from_toml(ROOT / "pyproject.toml") == RunConfig()


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunConfig().lr = 1.0  # type: ignore[misc]


def test_parsing_of_special_values():
    cfg = RunConfig.from_mapping({"clip": "off", "lr-milestones": "80,120", "num-rounds": 3.0, "download": "true"})
    assert math.isinf(cfg.clip) and not cfg.clipping
    assert cfg.lr_milestones == (80.0, 120.0) and cfg.num_rounds == 3 and cfg.download is True
    assert RunConfig.from_mapping(cfg.to_mapping()) == cfg
    assert RunConfig.from_mapping({"clip": "inf"}).clip == math.inf


def test_every_key_is_documented():
    keys = config_keys()
    shared = list(RunConfig().to_mapping())  # the default run's: celgc has no keys of its own
    assert [k for k, _, _ in keys if k in shared] == shared
    assert sorted(k for k, _, _ in keys) == sorted([*shared, *own_keys()])
    assert all(doc for _, _, doc in keys)


@pytest.mark.parametrize("values,match", [
    ({"local-steps": 0}, r"local-steps must be an integer >= 1, got 0"),
    ({"local-steps": 2.5}, r"local-steps must be an integer, got 2.5"),
    ({"lr": 0}, r"lr must be a finite number > 0, got 0"),
    ({"lr": -0.1}, r"lr must be a finite number > 0, got -0.1"),
    ({"lr": "fast"}, r"lr must be a number, got 'fast'"),
    ({"clip": 0}, r"clip must be > 0, or \"off\" to disable clipping, got 0"),
    ({"clip": -1}, r"clip must be > 0"),
    ({"num-clients": -1}, r"num-clients must be an integer >= 0, got -1"),
    ({"num-rounds": 0}, r"num-rounds must be an integer >= 1, got 0"),
    ({"batch-size": 0}, r"batch-size must be an integer >= 1, got 0"),
    ({"weight-decay": -1e-4}, r"weight-decay must be >= 0"),
    ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1.0"),
    ({"partitioner": "pathological"}, r"partitioner must be one of homogeneous, similarity, dirichlet, got 'pathological'"),
    ({"similarity": 101}, r"similarity must be in \[0, 100\], got 101"),
    ({"similarity": -1}, r"similarity must be in \[0, 100\], got -1"),
    ({"dirichlet-alpha": 0}, r"dirichlet-alpha must be > 0, got 0"),
    ({"task": "imagenet"}, r"task must be one of digits, cifar10, ptb, wikitext2, shakespeare or an import path "
                           r"\"package.module:factory\", got 'imagenet'"),
    ({"algorithm": "fedsomething"}, r"algorithm must be one of celgc, local-sgd, naive, episode, single, scaffold, .*"
                                    r"got 'fedsomething'"),
    ({"aggregation": "mode"}, r"aggregation must be one of uniform, examples, median, trimmed-mean, got 'mode'"),
    ({"trim-fraction": 0.5}, r"trim-fraction must be in \[0, 0.5\), got 0.5"),
    ({"lr-milestones": "120,80"}, r"lr-milestones must be increasing"),
    ({"lr-milestones": "a,b"}, r"lr-milestones must be comma-separated numbers"),
    ({"lr-decay": 0}, r"lr-decay must be in \(0, 1\], got 0"),
    ({"algorithm": "naive", "local-steps": 4}, r"local-steps must be 1 for algorithm 'naive'"),
    ({"algorithm": "local-sgd", "clip": 1.0}, r"clip must be \"off\" for algorithm 'local-sgd'"),
    ({"download": "maybe"}, r"download must be true or false, got 'maybe'"),
    ({"device": "tpu"}, r"device must be one of auto, cpu, cuda, got 'tpu'"),
    ({"min-replies": 9, "num-clients": 8}, r"min-replies \(9\) must be <= num-clients \(8\)"),
    ({"seed": -1}, r"seed must be an integer >= 0, got -1"),
    ({"eval-every": 0}, r"eval-every must be an integer >= 1, got 0"),
    ({"lerning-rate": 0.1}, r"unknown config key\(s\) \['lerning-rate'\]"),
    ({"client-state": "forget"}, r"client-state must be one of keep, reset, got 'forget'"),
    ({"text-split": "random"}, r"text-split must be one of blocks, contiguous, got 'random'"),
    ({"text-split": "contiguous"}, r"text-split = \"contiguous\" splits a text corpus \(ptb, wikitext2\), not task 'digits'"),
    ({"task": "ptb", "text-split": "contiguous", "partitioner": "similarity"},
     r"text-split = \"contiguous\" is a homogeneous split: it needs partitioner \"homogeneous\", got 'similarity'"),
    ({"nonmono": 0}, r"nonmono must be an integer >= 1, got 0"),
    ({"average-iterates": "yes"}, r"average-iterates must be true or false, got 'yes'"),
    ({"resume": True, "run-name": "x", "average-iterates": True}, r"resume=true with average-iterates=true is not supported"),
])
def test_bad_values_name_key_value_and_range(values, match):
    with pytest.raises(ValueError, match=match):
        RunConfig.from_mapping(values)


def test_full_participation_is_the_default_path():
    cfg = RunConfig.from_mapping({"num-clients": 5})
    assert cfg.clients_per_round == 0 and cfg.per_round == 5 and cfg.required_replies == 5
    assert RunConfig.from_mapping({"num-clients": 5, "clients-per-round": 5}).per_round == 5


@pytest.mark.parametrize(("values", "message"), [
    ({"num-clients": 4, "clients-per-round": 5}, r"clients-per-round \(5\) must be <= num-clients \(4\)"),
    ({"clients-per-round": -1}, "clients-per-round must be an integer >= 0, got -1"),
    ({"num-clients": 6, "clients-per-round": 2, "min-replies": 3}, r"min-replies \(3\) must be <= clients-per-round \(2\)"),
])
def test_bad_clients_per_round_is_named(values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_mapping(values)
    assert RunConfig.from_mapping({"num-clients": 6, "clients-per-round": 2}).required_replies == 2


def test_follow_the_federation_checks_clients_per_round_once_resolved():
    cfg = RunConfig.from_mapping({"num-clients": 0, "clients-per-round": 5})  # 0: not known yet
    with pytest.raises(ValueError, match=r"clients-per-round \(5\) must be <= num-clients \(4\)"):
        cfg.with_clients(4)
