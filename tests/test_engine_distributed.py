"""Processes: balanced sharding, 1 process == 2 gloo processes (torchrun), the engine with flwr
unimportable, and the command line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from simulations.engine import Engine, EngineOptions
from simulations.engine.distributed import World, shard
from strategies.methods.executors.options import split_engine_keys
from tasks.config import RunConfig
from tasks.overrides import parse_overrides
from tasks.runs.results import read_results

ROOT = Path(__file__).resolve().parents[1]
ROW_KEYS = ["kind", "round", "global-epoch", "communication-rounds", "failed-nodes", "lr", "clip", "replies",
            "rejected-replies", "failed-replies", "bytes-sent", "bytes-received", "train-loss", "clip-fraction",
            "grad-norm", "num-examples", "num-steps", "skipped-steps", "test-loss", "test-accuracy", "wall-clock"]


def test_shards_are_balanced_contiguous_and_cover_every_client():
    assert [list(shard(8, 3, r)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    for n in range(1, 13):
        for k in range(1, n + 1):
            blocks = [shard(n, k, r) for r in range(k)]
            assert [c for b in blocks for c in b] == list(range(n))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_more_processes_than_clients_fails_naming_both():
    with pytest.raises(ValueError, match=r"3 processes but only 2 clients \(num-clients=2\)"):
        shard(2, 3, 0)
    cfg = RunConfig.from_mapping({"num-clients": 2, "device": "cpu"})
    with pytest.raises(ValueError, match="3 processes but only 2 clients"):
        Engine(cfg, EngineOptions(), World(rank=1, size=3))


def run(cmd, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def assert_close(a, b, atol):
    for key, value in b.items():
        assert a[key].dtype == value.dtype, key
        assert torch.allclose(a[key].double(), value.double(), atol=atol, rtol=0), key


@pytest.mark.realproc
def test_two_gloo_processes_give_the_one_process_result(tmp_path, one_process):
    """The CLI under torchrun: 3 clients on 2 processes (2 + 1, unbalanced on purpose) vs all 3
    in one process, the default task and path."""
    keys = {"num-clients": 3, "num-rounds": 2, "local-steps": 3, "batch-size": 16, "device": "cpu",
            "results-dir": str(tmp_path)}
    overrides = " ".join(f"{k}={v}" for k, v in keys.items())
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
         "simulations.engine", "--config", str(ROOT / "pyproject.toml"), "--quiet",
         "--run-config", f"{overrides} run-name=two"])
    rows = one_process(tmp_path, "two", keys)
    assert rows[-1]["replies"] == 3 and rows[-1]["num-steps"] == 9


@pytest.mark.realproc
def test_engine_runs_where_flwr_cannot_be_imported(tmp_path):
    """The engine's whole import chain is flwr-free: run the CLI with flwr made unimportable."""
    code = (
        "import sys; sys.modules['flwr'] = None\n"
        "from simulations.engine.run import main\n"
        f"main(['--config', {str(ROOT / 'pyproject.toml')!r}, '--run-config', "
        f"'num-rounds=2 local-steps=2 num-clients=3 batch-size=16 device=cpu results-dir={tmp_path} run-name=noflwr', "
        "'--run-config', 'engine-path=sequential'])\n"
        "assert sys.modules['flwr'] is None and not any(m.startswith('flwr.') for m in sys.modules)\n"
        "print('ENGINE-OK')\n"
    )
    proc = run([sys.executable, "-c", code])
    assert "ENGINE-OK" in proc.stdout
    assert "path: sequential" in proc.stderr  # the progress display says which path ran
    header, rows = read_results(tmp_path / "noflwr" / "results.jsonl")
    assert header["backend"] == "engine" and header["engine"]["path"] == "sequential"
    assert header["versions"]["torch"] == torch.__version__
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert list(rows[-1]) == ROW_KEYS
    assert (tmp_path / "noflwr" / "model.pt").is_file()


@pytest.mark.parametrize(("override", "message"), [
    ("local-step=4", "error: unknown config key(s) ['local-step'] (did you mean 'local-steps' for 'local-step'?)"),
    ("batch-size=1000", "error: batch-size (1000) exceeds the smallest client's 179 examples"),
])
def test_the_engine_cli_names_a_bad_run_in_one_line_before_any_work(tmp_path, monkeypatch, capsys, override, message):
    import runpy

    monkeypatch.setattr(sys, "argv", ["simulations.engine", "--config", str(ROOT / "pyproject.toml"), "--quiet",
                                      "--run-config", f"{override} results-dir={tmp_path} run-name=bad"])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("simulations.engine", run_name="__main__", alter_sys=True)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err
    assert not (tmp_path / "bad" / "results.jsonl").exists()


def test_run_config_overrides_parse_like_flwr_run():
    values = parse_overrides(["lr=0.1 num-rounds=3 clip=off run-name='a b' lr-milestones=\"80,120\"",
                              "engine-bf16=true download=false"])
    assert values == {"lr": 0.1, "num-rounds": 3, "clip": "off", "run-name": "a b", "lr-milestones": "80,120",
                      "engine-bf16": True, "download": False}
    run_keys, engine_keys = split_engine_keys(values)
    cfg = RunConfig.from_mapping(run_keys)
    assert cfg.lr_milestones == (80.0, 120.0) and not cfg.clipping and cfg.run_name == "a b"
    assert EngineOptions.from_mapping(engine_keys).bf16 is True
    with pytest.raises(ValueError, match="unknown engine key"):
        EngineOptions.from_mapping({"engine-fast": True})
    with pytest.raises(ValueError, match="engine-path must be one of auto, vmap, sequential"):
        EngineOptions(path="gpu")
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["lr"])


@pytest.mark.realproc
def test_vectorised_world_of_two_equals_one(tmp_path, vmap_world):
    """vmap over 3 + 2 clients in 2 gloo processes == vmap over all 5 in one process."""
    script = tmp_path / "vmap_world.py"
    script.write_text(vmap_world)
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
         str(tmp_path / "two.pt")])
    run([sys.executable, str(script), str(tmp_path / "one.pt")])
    two, one = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert two["clients"] == [0, 1, 2] and one["clients"] == [0, 1, 2, 3, 4]
    assert_close(two["state"], one["state"], 1e-6)
    assert two["rows"][-1]["train-loss"] == pytest.approx(one["rows"][-1]["train-loss"], rel=1e-6)


DP_WORLD = """
import sys, torch
from simulations.engine import EngineOptions
from simulations.engine.distributed import close_world, init_world
from simulations.engine.run import Engine
from tasks.config import RunConfig

cfg = RunConfig.from_mapping({"num-clients": 4, "clients-per-round": 2, "num-rounds": 2, "local-steps": 2,
                              "batch-size": 16, "device": "cpu", "dp-noise-multiplier": 1.0, "dp-buffers": "frozen",
                              "dp-reproducible": sys.argv[2] == "seeded"})
world = init_world("cpu")
engine = Engine(cfg, EngineOptions(path="sequential"), world)
samples, norms = [], []
for server_round in (1, 2):
    report = engine.train_round(server_round)
    samples.append(engine.privacy.participants(server_round))
    norms.append({k: v for k, v in report.metrics.items() if k.startswith("dp-update-norm") or k.startswith("dp-proj")})
torch.save({"state": {k: v.cpu() for k, v in engine.state.items()}, "samples": samples, "norms": norms},
           f"{sys.argv[1]}.{world.rank}")
close_world(world)
"""


@pytest.mark.realproc
def test_dp_rounds_on_two_gloo_processes(tmp_path):
    """A DP run on 2 processes: process 0 adds the noise once and draws the secure sample, which both then
    hold (the same clients, the same model, the same update norms gathered from both); in reproducible mode
    2 processes == 1."""
    script = tmp_path / "dp_world.py"
    script.write_text(DP_WORLD)
    for mode in ("secure", "seeded"):
        run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
             str(tmp_path / f"{mode}-two"), mode])
        zero, one = torch.load(tmp_path / f"{mode}-two.0"), torch.load(tmp_path / f"{mode}-two.1")
        assert zero["samples"] == one["samples"] and all(len(s) == 2 for s in zero["samples"])
        assert all(torch.equal(zero["state"][k], one["state"][k]) for k in zero["state"])
        assert zero["norms"] == one["norms"] and all(len(n) == 5 for n in zero["norms"])
    run([sys.executable, str(script), str(tmp_path / "seeded-one"), "seeded"])
    single, two = torch.load(tmp_path / "seeded-one.0"), torch.load(tmp_path / "seeded-two.0")
    assert single["samples"] == two["samples"]
    assert_close(two["state"], single["state"], 1e-6)
    for one_process, two_processes in zip(single["norms"], two["norms"], strict=True):
        assert one_process == pytest.approx(two_processes, rel=1e-9), (one_process, two_processes)
