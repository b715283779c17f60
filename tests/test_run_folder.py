"""A run folder is owned: refused when it holds a run (unless resumed), locked while a run
lives, cleaned of stale checkpoint temp files; the engine resumes exactly like the ServerApp."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from client.app import app as client_app
from server.app import app as server_app
from simulations.engine import run as engine_run
from simulations.engine.run import run_engine
from simulations.loopback import LoopbackGrid, run_server_app
from tasks.config import RunConfig
from tasks.runs.checkpoint import CheckpointError, load_checkpoint
from tasks.runs.results import load_weights, producer, read_results
from tasks.runs.run_folder import LOCK, RunFolderError, claim_run_folder, stopped_at

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"num-rounds": 3, "local-steps": 2, "num-clients": 3, "node-wait": 2.0, "batch-size": 16}


def cfg(tmp_path: Path, name: str, **kw) -> RunConfig:
    return RunConfig.from_mapping({**CONFIG, "results-dir": str(tmp_path), "run-name": name, **kw})


def engine(tmp_path: Path, name: str, **kw):
    return run_engine(cfg(tmp_path, name, **kw), show_progress=False)


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_weights(a / "model.pt"), load_weights(b / "model.pt")
    return list(wa) == list(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


def lines(folder: Path) -> list[str]:
    return (folder / "results.jsonl").read_text().splitlines()


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """An uninterrupted engine run: the reference of the resume tests."""
    base = tmp_path_factory.mktemp("whole")
    engine(base, "w")
    return base / "w"


class Crash(KeyboardInterrupt):
    pass


def crash_at(monkeypatch, server_round: int) -> None:
    real = engine_run.Engine.train_round

    def train_round(self, r):
        if r == server_round:
            raise Crash(f"killed in round {r}")
        return real(self, r)

    monkeypatch.setattr(engine_run.Engine, "train_round", train_round)


def test_a_second_engine_run_on_one_run_name_is_refused_and_the_first_kept(tmp_path, whole):
    first = lines(whole)
    model = (whole / "model.pt").read_bytes()
    with pytest.raises(RunFolderError, match=r"already holds a run \(results.jsonl, checkpoint.pt, model.pt\).*"
                                             r"resume=true.*another run-name"):
        run_engine(RunConfig.from_mapping({**CONFIG, "results-dir": str(whole.parent), "run-name": "w"}),
                   show_progress=False)
    assert lines(whole) == first and (whole / "model.pt").read_bytes() == model


def test_the_server_app_refuses_a_folder_that_holds_a_run(tmp_path):
    values = {**RunConfig().to_mapping(), **CONFIG, "results-dir": str(tmp_path), "run-name": "s"}
    run_server_app(server_app, LoopbackGrid(client_app, values, 3))
    before = lines(tmp_path / "s")
    with pytest.raises(RunFolderError, match="already holds a run"):
        run_server_app(server_app, LoopbackGrid(client_app, values, 3))
    assert lines(tmp_path / "s") == before


def test_a_run_that_did_not_finish_is_named_so_with_how_to_resume_or_start_fresh(tmp_path, monkeypatch):
    crash_at(monkeypatch, 3)
    with pytest.raises(Crash):
        engine(tmp_path, "f")
    monkeypatch.undo()
    with pytest.raises(RunFolderError, match=r"that run did not finish \(it failed or was stopped: no model.pt; its "
                                             r"results reach round 2\): resume it from its round-2 checkpoint with "
                                             r"resume=true, or start it fresh with another run-name"):
        engine(tmp_path, "f")
    (tmp_path / "f" / "checkpoint.pt").unlink()
    with pytest.raises(RunFolderError, match=r"has no checkpoint \(checkpoint-every=0\?\), so it cannot be resumed"):
        engine(tmp_path, "f")


def test_engine_killed_and_resumed_equals_uninterrupted_earlier_lines_kept(tmp_path, whole, monkeypatch):
    crash_at(monkeypatch, 3)
    with pytest.raises(Crash):
        engine(tmp_path, "r")
    assert load_checkpoint(tmp_path / "r").round == 2
    before = lines(tmp_path / "r")
    monkeypatch.undo()
    engine(tmp_path, "r", resume=True)
    after = lines(tmp_path / "r")
    assert after[:len(before)] == before  # byte for byte
    assert same_weights(tmp_path / "r", whole)
    _, rows = read_results(tmp_path / "r" / "results.jsonl")
    _, ref = read_results(whole / "results.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2, 3] and rows[3]["resumed-from-round"] == 2
    assert rows[3]["resumed-by"] == producer()  # who continued it
    drop = {"wall-clock", "resumed-from-round", "resumed-by"}
    assert [{k: v for k, v in r.items() if k not in drop} for r in rows] == \
           [{k: v for k, v in r.items() if k not in drop} for r in ref]


def test_engine_resume_extends_a_finished_run(tmp_path, whole):
    engine(tmp_path, "x", **{"num-rounds": 1})
    engine(tmp_path, "x", resume=True)
    assert same_weights(tmp_path / "x", whole)


def test_engine_resume_keeps_naive_server_momentum(tmp_path, monkeypatch):
    naive = {"algorithm": "naive", "local-steps": 1, "momentum": 0.9}
    engine(tmp_path, "whole", **naive)
    crash_at(monkeypatch, 3)
    with pytest.raises(Crash):
        engine(tmp_path, "r", **naive)
    assert any(k.startswith("momentum.") for k in load_checkpoint(tmp_path / "r").strategy_state)
    monkeypatch.undo()
    engine(tmp_path, "r", resume=True, **naive)
    assert same_weights(tmp_path / "r", tmp_path / "whole")


def test_engine_checkpoint_every_zero_writes_none_and_cannot_be_resumed(tmp_path):
    engine(tmp_path, "n", **{"checkpoint-every": 0})
    assert not (tmp_path / "n" / "checkpoint.pt").exists()
    before = lines(tmp_path / "n")
    with pytest.raises(CheckpointError, match=r"holds results up to round 3 but no checkpoint"):
        engine(tmp_path, "n", resume=True, **{"checkpoint-every": 0})
    assert lines(tmp_path / "n") == before


def test_engine_resume_refuses_other_settings(tmp_path, whole):
    with pytest.raises(CheckpointError, match="lr: 0.3 -> 0.2"):
        run_engine(RunConfig.from_mapping({**CONFIG, "results-dir": str(whole.parent), "run-name": "w",
                                           "resume": True, "lr": 0.2}), show_progress=False)


@pytest.mark.parametrize("bad, message", [
    ({"task": "examples.own_task.no_such_module:make_task"}, "no_such_module"),
    ({"num-clients": 5000}, "5000"),
])
def test_a_run_refused_before_round_0_leaves_no_folder(tmp_path, bad, message):
    """Refused on the engine and on the ServerApp: the folders the claim made are gone again; a
    results-dir that was there before stays."""
    with pytest.raises((ValueError, ImportError), match=message):
        engine(tmp_path / "new" / "res", "r", **bad)
    assert not (tmp_path / "new").exists()
    values = {**RunConfig().to_mapping(), **CONFIG, "results-dir": str(tmp_path), "run-name": "s", **bad}
    with pytest.raises((ValueError, ImportError), match=message):
        run_server_app(server_app, LoopbackGrid(client_app, values, 3))
    assert tmp_path.is_dir() and not (tmp_path / "s").exists()


def test_stopped_at_says_where_a_run_stopped_and_how_to_go_on(tmp_path, monkeypatch):
    assert stopped_at(tmp_path / "none", "CMD").startswith("stopped before round 0: nothing was written")
    crash_at(monkeypatch, 3)
    with pytest.raises(Crash):
        engine(tmp_path, "f")
    assert stopped_at(tmp_path / "f", "CMD") == (f"stopped after round 2; {tmp_path / 'f'} keeps its rows and the "
                                                 "round-2 checkpoint; resume it (bit-identical to an uninterrupted "
                                                 "run) with: CMD")
    (tmp_path / "f" / "checkpoint.pt").unlink()
    assert "has no checkpoint (checkpoint-every=0?), so it cannot be resumed" in stopped_at(tmp_path / "f", "CMD")
    crash_at(monkeypatch, 1)
    with pytest.raises(Crash):
        engine(tmp_path, "g")
    assert stopped_at(tmp_path / "g", "CMD").endswith("has no trained round yet; start it again in that folder "
                                                      "with: CMD")


def test_a_live_run_locks_its_folder(tmp_path):
    with claim_run_folder(tmp_path / "l", resume=False):
        with pytest.raises(RunFolderError, match=rf"in use by another live run \(pid {os.getpid()}\)"):
            engine(tmp_path, "l")
    engine(tmp_path, "l")  # released at the end of the with block
    assert len(read_results(tmp_path / "l" / "results.jsonl")[1]) == 4


def test_stale_checkpoint_temp_files_are_removed(tmp_path):
    folder = tmp_path / "t"
    folder.mkdir()
    stale = [folder / ".checkpoint.pt.4242.tmp", folder / ".checkpoint.pt.77.tmp"]
    for p in stale:
        p.write_bytes(b"x" * 1000)
    keep = folder / "notes.txt"
    keep.write_text("mine")
    with claim_run_folder(folder, resume=False):
        assert not any(p.exists() for p in stale) and keep.read_text() == "mine"


HOLDER = """
import sys
from tasks.runs.run_folder import claim_run_folder
with claim_run_folder(sys.argv[1], resume=False):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.mark.realproc
def test_a_killed_run_leaves_no_stale_lock(tmp_path):
    folder = tmp_path / "k"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline().strip() == b"held"
        with pytest.raises(RunFolderError, match=rf"pid {proc.pid}"):
            with claim_run_folder(folder, resume=False):
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stdin.close()
    assert (folder / LOCK).exists()
    with claim_run_folder(folder, resume=False):  # the kernel dropped the dead holder's lock
        pass
