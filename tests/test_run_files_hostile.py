"""A run folder that someone else can write to, or a hostile run config: no file outside the
run folder is ever written through it (symlinks are never followed), run-name is one folder
name, a crafted checkpoint or results file is refused with the reason, never used."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from simulations.engine import run_engine
from tasks.config import RunConfig
from tasks.runs.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tasks.runs.results import ResultsError, read_results
from tasks.runs.run_folder import RunFolderError
from tasks.runs.safe_files import UnsafeFile

BASE = {"num-clients": 2, "num-rounds": 1, "local-steps": 2, "batch-size": 16, "device": "cpu"}


def engine(tmp_path, name="run", **keys):
    values = {**BASE, "results-dir": str(tmp_path), "run-name": name, **keys}
    return run_engine(RunConfig.from_mapping(values), show_progress=False)


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


@pytest.mark.parametrize("name", [".lock", "results.jsonl"])
def test_a_symlinked_file_of_the_run_is_refused_and_its_target_kept(tmp_path, victim, name):
    folder = tmp_path / "results" / "run"
    folder.mkdir(parents=True)
    (folder / name).symlink_to(tmp_path / "missing-target" if name == "results.jsonl" else victim)
    with pytest.raises((UnsafeFile, RunFolderError), match=rf"refusing to write through the symlink .*{name}"):
        engine(tmp_path / "results")
    assert victim.read_text() == "precious\n" and not (tmp_path / "missing-target").exists()


def test_planted_temp_and_target_links_are_replaced_not_followed(tmp_path, victim):
    """Links named as the run's temp files (this process's pid) and as its final files are
    removed or replaced by the run's own files; their targets are untouched."""
    folder = tmp_path / "results" / "run"
    folder.mkdir(parents=True)
    for name in ("model.pt", "checkpoint.pt", "results.jsonl"):
        (folder / f".{name}.{os.getpid()}.tmp").symlink_to(victim)
    engine(tmp_path / "results")
    assert victim.read_text() == "precious\n"
    assert not any(p.is_symlink() for p in folder.iterdir())
    # a link where the final checkpoint will go: replaced by the checkpoint itself
    (folder / "checkpoint.pt").unlink()
    (folder / "checkpoint.pt").symlink_to(victim)
    save_checkpoint(folder, load_checkpoint(folder / "missing-dir-means-file.pt") or _any_checkpoint())
    assert victim.read_text() == "precious\n" and not (folder / "checkpoint.pt").is_symlink()


def _any_checkpoint():
    from tasks.runs.checkpoint import Checkpoint
    return Checkpoint(round=1, arrays={"w": torch.zeros(2)})


def test_a_symlinked_run_folder_is_refused(tmp_path, victim):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(RunFolderError, match=r"run is a symlink to .*elsewhere: a run folder must be a real folder"):
        engine(tmp_path / "results")
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("name", ["../..", "..", ".", "/abs", "a/b", "a\\b", "-rf", "x\x00y", " lead"])
def test_run_name_must_be_one_folder_name(name):
    with pytest.raises(ValueError, match=r"run-name must be one folder name inside results-dir .* got "):
        RunConfig.from_mapping({"run-name": name})


def test_ordinary_run_names_are_accepted():
    for name in ("", "celgc-I8-s0", "digits.celgc_I8", "lr=0.3,clip=0.1", "run+1"):
        assert RunConfig.from_mapping({"run-name": name}).run_name == name


def tamper_checkpoint(folder, fn):
    path = folder / "checkpoint.pt"
    payload = torch.load(path, weights_only=True)
    fn(payload)
    torch.save(payload, path)


@pytest.mark.parametrize("tamper, reason", [
    (lambda p: p["arrays"].__setitem__("head.3.bias", torch.full((10,), math.nan)), "head.3.bias holds non-finite"),
    (lambda p: p["arrays"].__setitem__("head.3.bias", torch.zeros(3)), r"head.3.bias has shape \(3,\), expected \(10,\)"),
    (lambda p: p["arrays"].pop("head.3.bias"), r"keys differ from the global model \(missing \['head.3.bias'\]"),
    (lambda p: p["arrays"].__setitem__("head.3.bias", torch.zeros(10, dtype=torch.float64)), "dtype"),
    (lambda p: p["arrays"].__setitem__("head.3.bias", 1.0),
     r"malformed checkpoint \(arrays must be a non-empty dict of name -> tensor"),
    (lambda p: p["strategy"].__setitem__("momentum.x", torch.tensor([math.inf])), "momentum.x holds non-finite"),
])
@pytest.mark.parametrize("backend", ["engine", "flower"])
def test_a_crafted_checkpoint_is_refused_on_resume(tmp_path, runs, tamper, reason, backend):
    keys = {"num-rounds": 1, "checkpoint-every": 1}
    first = runs.engine if backend == "engine" else runs.flower
    first("run", **keys)
    tamper_checkpoint(runs.tmp_path / "run", tamper)
    with pytest.raises(CheckpointError, match=rf"checkpoint.pt: (the checkpoint does not fit the model: )?.*{reason}"):
        first("run", **{**keys, "num-rounds": 2, "resume": True})


@pytest.mark.parametrize("line, reason", [
    ("[1, 2]", r"line 3 is not a JSON object but list"),
    (json.dumps({"kind": "round", "round": "abc"}), r"line 3: a round row needs \"round\", an integer >= 0, got 'abc'"),
    ("{not json", r"line 3 is not JSON"),
])
def test_a_malformed_results_line_is_a_clear_error_on_resume(tmp_path, line, reason):
    engine(tmp_path, **{"checkpoint-every": 1})
    path = tmp_path / "run" / "results.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(2, line)  # between the round-0 and round-1 rows: not a torn last line
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ResultsError, match=rf"results.jsonl {reason}"):
        engine(tmp_path, **{"num-rounds": 2, "resume": True, "checkpoint-every": 1})
    with pytest.raises(ResultsError, match=reason):
        read_results(path)


def test_a_torn_last_line_is_dropped_on_resume(tmp_path):
    engine(tmp_path, **{"checkpoint-every": 1})
    path = tmp_path / "run" / "results.jsonl"
    with path.open("a") as f:
        f.write('{"kind": "round", "rou')  # a crash mid-write
    engine(tmp_path, **{"num-rounds": 2, "resume": True, "checkpoint-every": 1})
    _, rows = read_results(path)
    assert [r["round"] for r in rows] == [0, 1, 2]
