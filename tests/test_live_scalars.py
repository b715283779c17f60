"""TensorBoard scalars of the results rows (``tensorboard = true``, tasks/runs/live_scalars.py): written by
the one results writer, so the engine and the ServerApp give event files whose scalars are the rows;
a clear error naming the extra without the package; a resumed run's redone rounds replace the old ones."""

import sys

import numpy as np
import pytest

from simulations import runner
from tasks.config import RunConfig
from tasks.runs.live_scalars import Scalars, numeric_fields, require


def _scalars(folder) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _expected(rows) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in numeric_fields(row).items():
            out.setdefault(key, {})[row["round"]] = float(np.float32(value))  # TensorBoard keeps float32
    return out


def test_numeric_fields_are_every_number_but_the_round():
    row = {"kind": "round", "round": 3, "test-accuracy": 0.5, "bytes-sent": 12, "dp-private": True,
           "failed-nodes": [], "resumed-by": {"x": 1}, "valid-loss": float("nan"), "lr": 0.3}
    assert numeric_fields(row) == {"test-accuracy": 0.5, "bytes-sent": 12.0, "lr": 0.3}


def test_the_key_is_a_boolean():
    assert RunConfig().tensorboard is False
    with pytest.raises(ValueError, match="tensorboard"):
        RunConfig.from_mapping({"tensorboard": "yes please"})


@pytest.mark.parametrize("backend", ["engine", "flower"])
def test_a_run_writes_its_rows_as_scalars(runs, backend):
    pytest.importorskip("tensorboard")
    _, (header, rows) = getattr(runs, backend)("tb", **{"tensorboard": True, "num-rounds": 3})
    assert header["config"]["tensorboard"] is True
    got = _scalars(runs.tmp_path / "tb")
    want = _expected(rows)
    assert {"test-accuracy", "train-loss", "clip-fraction", "bytes-sent", "bytes-received", "wall-clock"} <= set(want)
    assert got == want
    assert sorted(got["test-accuracy"]) == [0, 1, 2, 3]


def test_without_the_package_the_run_is_refused_naming_the_extra(runs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ValueError, match=r"tensorboard = true needs the tensorboard package.*\.\[tensorboard\]"):
        require()
    with pytest.raises(ValueError, match=r"pip install -e '\.\[tensorboard\]'"):
        runs.engine("refused", tensorboard=True)
    assert not (runs.tmp_path / "refused").exists()  # refused before any row: nothing left behind
    # the runner refuses before any run
    exp = runs.tmp_path / "e.toml"
    exp.write_text('task = "digits"\nnum-rounds = 1\n')
    assert runner.main([str(exp), "--backend", "engine", "--results-dir", str(runs.tmp_path / "r"),
                        "--set", "tensorboard=true"]) == 2
    assert "pip install -e '.[tensorboard]'" in capsys.readouterr().err and not (runs.tmp_path / "r").exists()


def test_a_resumed_run_replaces_the_rounds_it_redoes(tmp_path):
    pytest.importorskip("tensorboard")
    first = Scalars(tmp_path)
    for r in range(4):
        first.add({"round": r, "train-loss": 1.0 + r})
    first.close()
    again = Scalars(tmp_path, resume_from=1)  # the checkpoint of round 1: rounds 2, 3 are redone
    for r in (2, 3):
        again.add({"round": r, "train-loss": 10.0 + r})
    again.close()
    assert _scalars(tmp_path) == {"train-loss": {0: 1.0, 1: 2.0, 2: 12.0, 3: 13.0}}
