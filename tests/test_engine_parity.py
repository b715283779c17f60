"""The engine against the Flower path: the real ServerApp + ClientApp (loopback grid), the same
config and seed, R rounds -> the same global parameters and the same result rows.

* The engine as it runs by default on the CPU (one client after another) reproduces the
  Flower path bit for bit on the default task, for CELGC at two values of I and for naive
  parallel clipping.
* The vectorised path (vmap) computes the same sums in another order, so it agrees to float
  rounding (1e-5) -- on a model without max pooling. Max pooling picks the argmax of each
  window, and the digits images have constant regions, i.e. exact ties in the input: a
  1-ulp difference in a convolution flips which element wins and routes that window's whole
  gradient elsewhere (both are valid subgradients). The vmap parity therefore uses the
  default model with average pooling; the default model itself is covered bit for bit above.
"""

import math

import pytest
import torch
from torch import nn

pytest.importorskip("flwr")

import tasks as local_round  # noqa: E402
import tasks.digits  # noqa: E402
from client.app import app as client_app  # noqa: E402
from simulations.loopback import LoopbackGrid, run_server_app  # noqa: E402
from server.app import app as server_app  # noqa: E402
from tasks.runs.results import load_weights, read_results  # noqa: E402
from simulations.engine import EngineOptions, run_engine  # noqa: E402
from tasks import (
    load_task,  # noqa: E402
)
from tasks.config import RunConfig  # noqa: E402
from tasks.digits import DigitsCNN  # noqa: E402

BASE = {"num-clients": 4, "num-rounds": 2, "batch-size": 16, "device": "cpu", "node-wait": 2.0}
FLOWER_ONLY = {"failures", "resumed-from-round"}  # keys the Flower path writes only when nodes fail / resume


def flower(tmp_path, name, **overrides):
    values = {**RunConfig().to_mapping(), **BASE, "results-dir": str(tmp_path), "run-name": name, **overrides}
    run_server_app(server_app, LoopbackGrid(client_app, values, values["num-clients"]))
    return load_weights(tmp_path / name / "model.pt"), read_results(tmp_path / name / "results.jsonl")


def engine(tmp_path, name, path, **overrides):
    cfg = RunConfig.from_mapping({**BASE, "results-dir": str(tmp_path), "run-name": name, **overrides})
    result = run_engine(cfg, EngineOptions(path=path), show_progress=False)
    assert result.path == ("sequential" if path == "auto" else path)
    return load_weights(tmp_path / name / "model.pt"), read_results(tmp_path / name / "results.jsonl")


def assert_same_run(flower_run, engine_run, exact):
    (f_state, (f_head, f_rows)), (e_state, (e_head, e_rows)) = flower_run, engine_run
    assert set(f_state) == set(e_state)
    for key, value in f_state.items():
        assert e_state[key].dtype == value.dtype, key
        if exact:
            assert torch.equal(e_state[key], value), key
        else:
            assert torch.allclose(e_state[key].double(), value.double(), atol=1e-5, rtol=0), key
    same = lambda c: {k: v for k, v in c.items() if k != "run-name"}  # noqa: E731
    assert same(e_head["config"]) == same(f_head["config"])
    assert e_head["backend"] == "engine" and e_head["world-size"] == 1
    assert e_head["model-bytes"] == f_head["model-bytes"] and e_head["train-size"] == f_head["train-size"]
    assert len(e_rows) == len(f_rows)
    for f, e in zip(f_rows, e_rows, strict=True):
        assert list(e) == [k for k in f if k not in FLOWER_ONLY]  # same keys, same order
        for key, value in f.items():
            if key in ("wall-clock", *FLOWER_ONLY):
                continue
            if isinstance(value, float) and math.isfinite(value):
                assert e[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
            else:
                assert e[key] == value, key


CASES = {
    "celgc-I2": {"local-steps": 2},
    "celgc-I5": {"local-steps": 5, "weight-decay": 1e-3, "momentum": 0.5},
    "naive": {"algorithm": "naive", "local-steps": 1, "num-rounds": 3, "momentum": 0.5, "weight-decay": 1e-3},
}


class SmoothDigitsCNN(DigitsCNN):
    """The default model with 2x2 average pooling in place of max pooling (no argmax)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(num_classes)
        self.features[6] = nn.AvgPool2d(2)


@pytest.fixture
def smooth_digits(monkeypatch):
    monkeypatch.setattr(tasks.digits, "DigitsCNN", SmoothDigitsCNN)
    local_round.cached_task.cache_clear()
    local_round.partitions.cache_clear()
    yield
    local_round.cached_task.cache_clear()
    local_round.partitions.cache_clear()


@pytest.mark.parametrize("case", list(CASES))
def test_engine_equals_flower_bit_for_bit(tmp_path, case):
    """The default engine on the CPU (auto: one client after another), the default task."""
    assert_same_run(flower(tmp_path, "flower", **CASES[case]), engine(tmp_path, "engine", "auto", **CASES[case]),
                    exact=True)


@pytest.mark.parametrize("case", list(CASES))
def test_vectorised_engine_equals_flower(tmp_path, smooth_digits, case):
    """vmap over the clients: the same global parameters to 1e-5 after R rounds."""
    ref = flower(tmp_path, "flower", **CASES[case])
    assert isinstance(load_task(RunConfig()).build_model(), SmoothDigitsCNN)
    assert_same_run(ref, engine(tmp_path, "vmap", "vmap", **CASES[case]), exact=False)
