"""Plots and result summaries from hand-made results files."""

import sys

import pytest

from simulations import plots
from simulations.summary import (
    common_target,
    find_runs,
    load_run,
    method_label,
    rounds_to_target,
    summarize,
)
from tasks.runs.results import ResultsWriter

pytest.importorskip("matplotlib")


def write_run(folder, config, rows, train_size=100):
    writer = ResultsWriter(folder, {"task": "digits", "num-clients": 4, "partitioner": "homogeneous", **config},
                           {"train-size": train_size, "model-bytes": 10})
    for row in rows:
        writer.row(row)
    return folder


def rows_for(steps, accs, losses, clip=0.5):
    out = [{"round": 0, "global-epoch": 0.0, "communication-rounds": 0, "test-accuracy": 0.1, "wall-clock": 0.0}]
    for r, (acc, loss) in enumerate(zip(accs, losses, strict=True), 1):
        out.append({"round": r, "communication-rounds": r, "global-epoch": r * 4 * steps * 25 / 100,
                    "train-loss": loss, "clip-fraction": clip, "num-steps": 4 * steps, "bytes-sent": 40,
                    "bytes-received": 40, "test-accuracy": acc, "wall-clock": 0.5 * r})
    return out


@pytest.fixture
def results(tmp_path):
    write_run(tmp_path / "r" / "naive", {"algorithm": "naive", "local-steps": 1},
              rows_for(1, [0.3, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.9], [2, 1.5, 1.2, 1, 0.8, 0.7, 0.6, 0.5], clip=1.0))
    write_run(tmp_path / "r" / "celgc", {"algorithm": "celgc", "local-steps": 4},
              rows_for(4, [0.7, 0.92], [1.0, 0.4]))
    write_run(tmp_path / "r" / "hetero", {"algorithm": "celgc", "local-steps": 4, "partitioner": "similarity",
                                          "similarity": 0.0}, rows_for(4, [0.5, 0.6], [1.0, 0.9]))
    return tmp_path / "r"


def test_labels_targets_and_summary(results):
    naive, celgc = load_run(results / "naive"), load_run(results / "celgc")
    assert naive.label == "naive parallel clipping" and celgc.label == "CELGC I=4"
    assert method_label({"algorithm": "local-sgd", "local-steps": 8, "clip": "off"}) == "local SGD I=8 (no clipping)"
    assert method_label({"algorithm": "celgc", "num-clients": 1, "local-steps": 32}) == "single machine"
    assert method_label({"algorithm": "episode", "local-steps": 8, "clip": 0.3}) == "EPISODE I=8"
    assert celgc.group == "digits-homogeneous" and load_run(results / "hetero").group == "digits-similarity0"
    hit = rounds_to_target(naive, 0.8)
    assert hit == {"round": 5, "row": 5, "global-epoch": 5.0, "wall-clock": 2.5, "bytes": 5 * 80}
    assert rounds_to_target(celgc, 0.8)["round"] == 2 and rounds_to_target(celgc, 0.95) is None
    assert common_target([naive, celgc]) == 0.9
    line = summarize(naive)
    assert line["final"] == 0.9 and line["best"] == 0.9 and line["rounds"] == 8 and line["bytes"] == 640
    assert len(find_runs([results])) == 3 and len(find_runs([results / "naive", results])) == 3
    lm = load_run(write_run(results.parent / "lm", {"task": "ptb"}, [{"round": 1, "valid-perplexity": 90.0}]))
    assert lm.metric == ("valid-perplexity", "min") and rounds_to_target(lm, 100.0)["round"] == 1


def test_binned_training_loss_is_step_weighted(results):
    xs, ys, ts = plots.binned(load_run(results / "naive"), "train-loss")
    assert len(xs) == 8 and ys[0] == 2 and ts[-1] == 4.0  # 8 epochs: one bin each


def test_figures_are_written_per_group(results, tmp_path):
    paths = plots.plot_results([results], tmp_path / "fig")
    names = sorted(p.name for p in paths)
    assert names == sorted(f"{g}-{k}.png" for g in ("digits-homogeneous", "digits-similarity0")
                           for k in ("train-loss", "test-accuracy", "test-accuracy-communication", "clipping",
                                     "rounds-to-target"))
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert plots.main([str(results / "naive"), "--out", str(tmp_path / "f2"), "--target", "0.5"]) == 0
    assert plots.main([str(tmp_path / "missing"), "--out", str(tmp_path / "f3")]) == 2


def test_missing_matplotlib_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        plots._pyplot()
