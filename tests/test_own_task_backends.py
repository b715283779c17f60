"""The example task (examples/own_task, named by import path) on every backend: the in-process
ServerApp + ClientApps, the engine (in process, its CLI, torchrun with 2 gloo processes), a real
`flwr run` through the runner -- the same model and the same result rows (all but wall-clock)
bit for bit, under each partitioner."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tasks
from simulations.engine import EngineOptions, run_engine
from simulations.loopback import run_in_process
from simulations.runner import load_experiment, run_experiment
from tasks.config import RunConfig
from tasks.runs.results import load_weights, read_results

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples.own_task.tabular:make_task"
EXPERIMENT = ROOT / "examples" / "own_task" / "celgc.toml"
BASE = {"task": EXAMPLE, "num-clients": 4, "num-rounds": 3, "local-steps": 4, "batch-size": 16, "lr": 0.2,
        "clip": 0.1, "device": "cpu", "node-wait": 5.0}
SPLITS = {
    "homogeneous": {},
    "similarity": {"partitioner": "similarity", "similarity": 20.0},
    "dirichlet": {"partitioner": "dirichlet", "dirichlet-alpha": 1.0},
}


@pytest.fixture(autouse=True)
def fresh_task_cache():
    tasks.cached_task.cache_clear()
    tasks.partitions.cache_clear()
    yield
    tasks.cached_task.cache_clear()
    tasks.partitions.cache_clear()


def outcome(folder):
    header, rows = read_results(folder / "results.jsonl")
    config = {k: v for k, v in header["config"].items() if k not in ("run-name", "results-dir")}
    return load_weights(folder / "model.pt"), config, [{k: v for k, v in r.items() if k != "wall-clock"} for r in rows]


def assert_same(a, b):
    (sa, ca, ra), (sb, cb, rb) = a, b
    assert ca == cb
    assert ra == rb
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


def in_process(tmp_path, name, **values):
    run_in_process({**BASE, "results-dir": str(tmp_path), "run-name": name, **values})
    return outcome(tmp_path / name)


@pytest.mark.parametrize("split", list(SPLITS))
def test_in_process_apps_and_engine_agree_under_each_partitioner(tmp_path, split):
    flower = in_process(tmp_path, "apps", **SPLITS[split])
    run_engine(RunConfig.from_mapping({**BASE, **SPLITS[split], "results-dir": str(tmp_path), "run-name": "engine"}),
               show_progress=False)
    engine = outcome(tmp_path / "engine")
    assert_same(flower, engine)
    _, config, rows = flower
    assert config["task"] == EXAMPLE and config["partitioner"] == SPLITS[split].get("partitioner", "homogeneous")
    assert rows[-1]["replies"] == 4 and rows[-1]["test-accuracy"] > 0.8 > rows[0]["test-accuracy"]
    assert 0 < rows[1]["clip-fraction"]  # clipping is exercised


def test_the_vectorised_engine_takes_the_example_model(tmp_path):
    """engine-path=vmap (the GPU default) stacks the clients: the same sums in another order, so
    the same model to float rounding."""
    flower = in_process(tmp_path, "apps")
    cfg = RunConfig.from_mapping({**BASE, "results-dir": str(tmp_path), "run-name": "vmap"})
    assert run_engine(cfg, EngineOptions(path="vmap"), show_progress=False).path == "vmap"
    state, config, rows = outcome(tmp_path / "vmap")
    assert config == flower[1] and len(rows) == len(flower[2])
    assert rows[-1]["train-loss"] == pytest.approx(flower[2][-1]["train-loss"], rel=1e-5)
    for key, value in flower[0].items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5)


def test_the_partitioners_give_different_runs(tmp_path):
    losses = {split: in_process(tmp_path, split, **values)[2][1]["train-loss"] for split, values in SPLITS.items()}
    assert len(set(losses.values())) == 3, losses


@pytest.mark.filterwarnings("ignore::DeprecationWarning:pathspec")  # flwr's FAB builder calls a deprecated pattern
def test_the_app_bundle_of_flwr_run_carries_the_example():
    """`flwr run .` ships the FAB Flower builds from this folder, and puts it on the apps' path."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    names = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))).namelist()
    assert {"examples/__init__.py", "examples/own_task/__init__.py", "examples/own_task/tabular.py"} <= set(names)


def run(cmd, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.realproc
def test_torchrun_with_two_gloo_processes_equals_the_in_process_apps(tmp_path):
    """3 clients on 2 processes (2 + 1) through the engine CLI under torchrun == the ServerApp + ClientApps.

    Bit for bit, and why: every process, this one included, runs the same number of torch threads
    (``OMP_NUM_THREADS``, default 1, there; conftest's realproc fixture here; checked at 1, 2 and 4, and
    beside running sweeps), so a client's steps are the same kernels with the same reduction splits on
    both sides; clients are trained and summed in partition-id order on both;
    gloo's all-reduce of two float64 partial sums is a + b, the same on either rank and in either
    arrival order. What differs is only the float64 grouping of the average ((c0 + c1) + c2 across
    the processes, one 3-row product here); the cast back to float32 hides it unless a float64 sum
    lies within an ulp of a float32 rounding boundary (about 2**-29 a value), which this data does
    not hit -- deterministic, not timing-dependent: the data, not the load, decides."""
    values = {**BASE, **SPLITS["dirichlet"], "num-clients": 3, "results-dir": str(tmp_path)}
    overrides = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in values.items())
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
         "simulations.engine", "--quiet", "--run-config", f"{overrides} run-name='two'"])
    header, _ = read_results(tmp_path / "two" / "results.jsonl")
    assert header["world-size"] == 2 and header["backend"] == "engine"
    assert_same(outcome(tmp_path / "two"), in_process(tmp_path, "apps", **SPLITS["dirichlet"], **{"num-clients": 3}))


@pytest.mark.realproc
def test_the_runner_gives_one_result_on_flwr_run_the_engine_and_in_process(tmp_path):
    """The example's experiment file through the runner: a real `flwr run` of this app (private
    SuperLink, Ray; the task module travels in the FAB), the engine CLI and the in-process apps."""
    outcomes = {}
    for backend in ("inprocess", "engine", "flower"):
        values = load_experiment(EXPERIMENT, {"num-rounds": 2, "device": "cpu", "run-name": backend}, tmp_path)
        outcomes[backend] = outcome(run_experiment(values, backend, timeout=300))
    assert outcomes["inprocess"][1]["task"] == EXAMPLE
    assert_same(outcomes["inprocess"], outcomes["engine"])
    assert_same(outcomes["inprocess"], outcomes["flower"])
