"""Central evaluation: averaged iterates after the authors' non-monotone trigger, the whole
training set with eval-train, in results.jsonl of an offline run (digits)."""

from pathlib import Path

import pytest
import torch

from simulations.engine import EngineOptions, run_engine
from simulations.loopback import run_in_process
from strategies.core.iterate_average import IterateAverage
from tasks.config import RunConfig
from tasks.runs.results import read_results


def test_trigger_is_the_authors_non_monotone_rule():
    avg = IterateAverage(nonmono=2)
    # starts once a loss is worse than the best before the last 2 recorded (and > 2 recorded)
    assert [avg.observe(x) for x in (5.0, 4.0, 3.0, 3.5, 2.9)] == [False] * 5
    assert avg.observe(4.5) is True  # 4.5 > min(5, 4, 3) = 3
    assert avg.observe(100.0) is False and avg.history == [5.0, 4.0, 3.0, 3.5, 2.9, 4.5]
    with pytest.raises(ValueError, match="nonmono must be an integer >= 1, got 0"):
        IterateAverage(0)


def test_running_mean_of_the_evaluated_models():
    avg = IterateAverage(nonmono=1)
    s = [{"w": torch.tensor([float(k), 2.0 * k]), "n": torch.tensor(k)} for k in range(1, 4)]
    assert avg.at_evaluation(s[0]) is s[0] and avg.count == 0  # not started: the model itself
    avg.started = True
    avg.at_evaluation(s[1])
    mean = avg.at_evaluation(s[2])
    assert avg.count == 2 and torch.equal(mean["w"], torch.tensor([2.5, 5.0])) and mean["n"] == 3


def _rows(folder: Path):
    return read_results(folder / "results.jsonl")[1]


def test_offline_run_reports_train_eval_and_averaged_iterates(tmp_path):
    values = {"num-clients": 2, "num-rounds": 8, "local-steps": 2, "batch-size": 16, "device": "cpu",
              "node-wait": 2.0, "results-dir": str(tmp_path), "eval-train": True, "average-iterates": True,
              "nonmono": 1, "lr": 1.0, "clip": 2.0}
    run_in_process({**values, "run-name": "flower"})
    rows = _rows(tmp_path / "flower")
    assert all(0 <= r["train-eval-accuracy"] <= 1 and r["train-eval-loss"] > 0 for r in rows)
    counts = [r["averaged-iterates"] for r in rows]
    assert counts[0] == 0 and counts[-1] > 0  # the trigger fired (a large step: a non-monotone test loss)
    assert counts[counts.index(1):] == list(range(1, len(rows) - counts.index(1) + 1))  # one more per evaluation
    assert "train-ce" not in rows[-1]  # a classification loss has no regularisers to separate
    # the engine evaluates the same way
    run_engine(RunConfig.from_mapping({**values, "run-name": "engine"}), EngineOptions(), show_progress=False)
    for f, e in zip(rows, _rows(tmp_path / "engine"), strict=True):
        assert e["averaged-iterates"] == f["averaged-iterates"]
        assert e["train-eval-loss"] == pytest.approx(f["train-eval-loss"], rel=1e-9)
        assert e["test-loss"] == pytest.approx(f["test-loss"], rel=1e-9)


def test_defaults_add_no_keys(tmp_path):
    run_in_process({"num-clients": 2, "num-rounds": 1, "local-steps": 1, "device": "cpu", "node-wait": 2.0,
                    "results-dir": str(tmp_path), "run-name": "plain"})
    row = _rows(tmp_path / "plain")[-1]
    assert not {"averaged-iterates", "train-eval-loss", "train-ce"} & set(row)
