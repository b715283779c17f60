"""The clipping-bound reply filter never rejects an honest reply: real in-process runs of the
task sizes that run here (digits CNN as the CIFAR presets set it up, the language model with
its lr scales, a user's own MLP task, naive parallel clipping), with every row's
rejected-replies 0 and the measured displacement / bound ratio reported."""

from __future__ import annotations

import pytest

import strategies.methods.algorithm as algorithm
from client.app import app as client_app
from server.app import app as server_app
from simulations.loopback import LoopbackGrid, run_server_app
from strategies.core import bound
from tasks.config import RunConfig
from tasks.runs.results import read_results

SMALL = {"num-clients": 3, "num-rounds": 3, "node-wait": 2.0, "device": "cpu"}
CASES = {
    "digits CELGC I=8 (clipping active)": {"local-steps": 8, "batch-size": 32, "lr": 0.3, "clip": 0.3},
    "digits as the CIFAR-10 presets (wd 5e-4, lr 0.1, clip 1, b 16)": {
        "local-steps": 8, "batch-size": 16, "lr": 0.1, "clip": 1.0, "weight-decay": 5e-4},
    "digits, tiny clip (every step clipped)": {"local-steps": 4, "batch-size": 16, "lr": 1.0, "clip": 0.01},
    "digits naive parallel clipping": {"algorithm": "naive", "local-steps": 1, "batch-size": 32},
    "own task (breast-cancer MLP)": {"task": "examples.own_task.tabular:make_task", "local-steps": 4,
                                     "batch-size": 16, "lr": 0.5, "clip": 0.2},
}


@pytest.fixture
def ratios(monkeypatch):
    """Every honest reply's |x - x0| / bound, as the filter saw it."""
    seen: list[float] = []
    real = algorithm.check_displacement

    def recording(state, reference, keys, **kw):
        seen.append(bound.displacement(state, reference, keys) / kw["bound"])
        return real(state, reference, keys, **kw)

    monkeypatch.setattr(algorithm, "check_displacement", recording)
    return seen


def run(tmp_path, config):
    values = {**RunConfig().to_mapping(), **SMALL, **config, "results-dir": str(tmp_path), "run-name": "honest"}
    run_server_app(server_app, LoopbackGrid(client_app, values, values["num-clients"]))
    return read_results(tmp_path / "honest" / "results.jsonl")[1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_honest_replies_are_never_rejected(case, tmp_path, ratios):
    rows = run(tmp_path, CASES[case])
    assert all(r["rejected-replies"] == 0 and r["replies"] == 3 and "failures" not in r for r in rows[1:]), rows
    if CASES[case].get("algorithm") != "naive":
        assert ratios and max(ratios) <= 1.0
        print(f"{case}: displacement / bound over {len(ratios)} replies: max {max(ratios):.4f}, "
              f"min {min(ratios):.4f}")


@pytest.fixture
def tiny_ptb(tiny_lm):
    return tiny_lm(400)


@pytest.mark.parametrize("algorithm", ["celgc", "naive"])
def test_honest_language_model_replies_with_lr_scales_are_never_rejected(algorithm, tiny_ptb, ratios):
    config = {"task": "ptb", "data-dir": str(tiny_ptb / "data"), "num-clients": 2, "batch-size": 2, "lr": 5.0,
              "clip": 0.5, "weight-decay": 1.2e-6, "algorithm": algorithm,
              "local-steps": 1 if algorithm == "naive" else 4}
    rows = run(tiny_ptb / "res", config)
    assert all(r["rejected-replies"] == 0 and r["replies"] == 2 for r in rows[1:]), rows
    if algorithm == "celgc":
        assert ratios and max(ratios) <= 1.0
        print(f"language model: displacement / bound max {max(ratios):.4f}")
