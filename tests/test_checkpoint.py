"""Checkpoints: atomic writes, safe loading, and resumed runs that end bit for bit like
uninterrupted ones (in-process: the real ServerApp/ClientApp on the loopback grid)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tasks.runs.recorder as recorder_module
from client.app import app as client_app
from server.app import app as server_app
from server.resumed import ResumedStrategy
from simulations.loopback import LoopbackGrid, run_server_app
from tasks.config import RunConfig
from tasks.runs.checkpoint import (
    Checkpoint,
    CheckpointError,
    check_resumable,
    load_checkpoint,
    save_checkpoint,
)
from tasks.runs.results import load_weights, read_results
from tasks.runs.run_folder import claim_run_folder

ROOT = Path(__file__).resolve().parents[1]


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "n": torch.tensor(7, dtype=torch.int64)}


# --- the file ----------------------------------------------------------------------------
def test_round_trip_keeps_every_bit(tmp_path):
    ckpt = Checkpoint(round=3, arrays=state(), strategy_state={"momentum.w": torch.ones(2), "steps": 5},
                      meta={"config": {"lr": 0.3, "clip": "off"}, "wall-clock": 1.5})
    save_checkpoint(tmp_path, ckpt)
    back = load_checkpoint(tmp_path)
    assert back.round == 3 and back.meta == ckpt.meta and back.strategy_state["steps"] == 5
    assert all(torch.equal(back.arrays[k], ckpt.arrays[k]) and back.arrays[k].dtype == ckpt.arrays[k].dtype
               for k in ckpt.arrays)
    assert list(back.arrays) == list(ckpt.arrays)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # no temp file left
    assert load_checkpoint(tmp_path / "nothing-here") is None


def test_bad_contents_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="round must be"):
        Checkpoint(round=-1, arrays=state())
    with pytest.raises(CheckpointError, match="only tensors, numbers and strings"):
        Checkpoint(round=1, arrays=state(), strategy_state={"x": object()})
    (tmp_path / "checkpoint.pt").write_bytes(b"\x80\x04not a checkpoint")
    with pytest.raises(CheckpointError, match="not a loadable checkpoint"):
        load_checkpoint(tmp_path)
    torch.save({"format": 99}, tmp_path / "checkpoint.pt")
    with pytest.raises(CheckpointError, match="not a checkpoint of format"):
        load_checkpoint(tmp_path)


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_loading_never_unpickles_arbitrary_objects(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"format": 1, "round": 1, "arrays": state(), "strategy": {}, "meta": _Evil()},
               tmp_path / "checkpoint.pt", pickle_protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(CheckpointError, match="not a loadable checkpoint"):
        load_checkpoint(tmp_path)
    assert not (tmp_path / "PWNED").exists()


WRITER = """
import sys, torch
from tasks.runs.checkpoint import Checkpoint, save_checkpoint
folder = sys.argv[1]
big = {f"p{i}": torch.full((256, 256), float(i)) for i in range(24)}  # ~6 MB: writes take a while
r = 1
while True:
    print("writing", r, flush=True)
    save_checkpoint(folder, Checkpoint(round=r, arrays={k: v + r for k, v in big.items()}))
    r += 1
"""


@pytest.mark.realproc
def test_a_crash_mid_write_leaves_a_valid_checkpoint(tmp_path):
    """SIGKILL a process that rewrites its checkpoint in a loop, as soon as it announces the
    write of round k (no sleeps): what is left always loads, and claiming the folder removes
    the temp file the killed writer left."""
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(WRITER))
    folder = tmp_path / "ck"
    for kill_at in (2, 5):
        proc = subprocess.Popen([sys.executable, str(script), str(folder)], cwd=ROOT, stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            for expected in range(1, kill_at + 1):  # bounded: one line per write
                assert proc.stdout.readline().split() == [b"writing", str(expected).encode()]
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            proc.stdout.close()
        ckpt = load_checkpoint(folder)
        assert ckpt is not None and ckpt.round >= kill_at - 1
        assert all(torch.equal(v, torch.full((256, 256), float(i) + ckpt.round))
                   for i, v in enumerate(ckpt.arrays.values()))
        with claim_run_folder(folder, resume=True):
            assert not list(folder.glob(".checkpoint.pt.*.tmp"))


def test_resume_config_check_names_the_changed_keys():
    old = RunConfig(run_name="x").to_mapping()
    check_resumable(old, {**old, "num-rounds": 40, "resume": True, "round-timeout": 5.0})
    with pytest.raises(CheckpointError, match=r"lr: 0.3 -> 0.1.*seed: 0 -> 1"):
        check_resumable(old, {**old, "lr": 0.1, "seed": 1})


def test_resumed_strategy_shifts_rounds():
    seen = []

    class Probe:
        def configure_train(self, r, *a):
            seen.append(("train", r))
            return []

        def aggregate_train(self, r, replies):
            seen.append(("agg", r))
            return None, None

    wrapper = ResumedStrategy(Probe(), 5)
    wrapper.configure_train(1, None, None, None)
    wrapper.aggregate_train(2, [])
    shifted = wrapper.shift_evaluate(lambda r, a: seen.append(("eval", r)))
    shifted(0, None)  # the resumed round itself: already evaluated
    shifted(1, None)
    assert seen == [("train", 6), ("agg", 7), ("eval", 6)]


# --- resumed runs in process --------------------------------------------------------
CONFIG = {"num-rounds": 3, "local-steps": 2, "num-clients": 3, "node-wait": 2.0, "batch-size": 16}


class CrashingGrid(LoopbackGrid):
    """Dies (like a killed server) when the train messages of round ``crash_round`` go out."""

    def __init__(self, *args, crash_round: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.crash_round = crash_round

    def push_messages(self, messages):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == "train" and int(m.content["config"]["server-round"]) == self.crash_round:
                raise KeyboardInterrupt("server killed")
        return super().push_messages(messages)


def run(tmp_path, name, grid_cls=LoopbackGrid, **kw):
    values = {**RunConfig().to_mapping(), **CONFIG, "results-dir": str(tmp_path), "run-name": name,
              **kw.pop("config", {})}
    grid = grid_cls(client_app, values, values["num-clients"], **kw)
    run_server_app(server_app, grid)
    return tmp_path / name


def weights_equal(a: Path, b: Path) -> bool:
    wa, wb = load_weights(a / "model.pt"), load_weights(b / "model.pt")
    return list(wa) == list(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ref"), "whole")


def test_killed_and_resumed_run_ends_bit_for_bit_equal(tmp_path, reference):
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "r", CrashingGrid, crash_round=3)
    assert load_checkpoint(tmp_path / "r").round == 2
    run(tmp_path, "r", config={"resume": True})
    assert weights_equal(tmp_path / "r", reference)
    header, rows = read_results(tmp_path / "r" / "results.jsonl")
    _, ref_rows = read_results(reference / "results.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert rows[3]["resumed-from-round"] == 2 and "resumed-from-round" not in rows[2]
    assert [r["test-loss"] for r in rows] == [r["test-loss"] for r in ref_rows]
    assert rows[3]["wall-clock"] >= rows[2]["wall-clock"]  # the clock continues


def test_rows_written_after_the_checkpoint_are_redone_once(tmp_path, reference, monkeypatch):
    """A crash between a round's results row and its checkpoint: the row is not duplicated."""
    real = recorder_module.save_checkpoint

    def save_until_round_2(folder, ckpt):
        if ckpt.round == 2:
            raise KeyboardInterrupt("killed while checkpointing")
        return real(folder, ckpt)

    monkeypatch.setattr(recorder_module, "save_checkpoint", save_until_round_2)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "r")
    monkeypatch.setattr(recorder_module, "save_checkpoint", real)
    with (tmp_path / "r" / "results.jsonl").open("a") as f:
        f.write('{"kind": "round", "round": 3, "torn')  # and a line torn by the crash
    run(tmp_path, "r", config={"resume": True})
    _, rows = read_results(tmp_path / "r" / "results.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert rows[2]["resumed-from-round"] == 1
    assert weights_equal(tmp_path / "r", reference)


def test_resume_extends_a_finished_run_and_refuses_other_settings(tmp_path, reference):
    run(tmp_path, "r", config={"num-rounds": 1})
    run(tmp_path, "r", config={"num-rounds": 3, "resume": True})
    assert weights_equal(tmp_path / "r", reference)
    with pytest.raises(CheckpointError, match="lr: 0.3 -> 0.2"):
        run(tmp_path, "r", config={"resume": True, "lr": 0.2})


def test_resume_without_checkpoint_starts_at_round_zero(tmp_path, reference):
    run(tmp_path, "fresh", config={"resume": True})
    assert weights_equal(tmp_path / "fresh", reference)
    with pytest.raises(ValueError, match="resume=true needs a fixed run-name"):
        RunConfig.from_mapping({"resume": True})


def test_strategy_state_is_checkpointed_naive_momentum(tmp_path):
    naive = {"algorithm": "naive", "local-steps": 1, "momentum": 0.9}
    whole = run(tmp_path, "whole", config=naive)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "r", CrashingGrid, crash_round=3, config=naive)
    ckpt = load_checkpoint(tmp_path / "r")
    assert ckpt.round == 2 and any(k.startswith("momentum.") for k in ckpt.strategy_state)
    run(tmp_path, "r", config={**naive, "resume": True})
    assert weights_equal(tmp_path / "r", whole)
