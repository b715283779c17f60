"""GPU paths of the engine, each against the fp32 eager path: CUDA graphs, bf16, channels-last,
one CUDA stream per client, NCCL with two processes. Skipped without CUDA."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from simulations.engine import EngineOptions, run_engine
from tasks.config import RunConfig
from tasks.digits import DigitsCNN, digits_task
from tasks.partition import partition

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (GPU paths of the engine)")

ROOT = Path(__file__).resolve().parents[1]
# 4 clients x 2 steps x 16 = 128 examples a round of 1,438: the lr/clip decay at epoch 0.15 lands in round 3,
# so a CUDA graph captured in round 1 must follow the schedule through its lr-scale tensor.
KEYS = {"num-clients": 4, "num-rounds": 3, "local-steps": 2, "batch-size": 16, "device": "cuda",
        "lr-milestones": "0.15", "lr-decay": 0.5}


def smooth_model():
    """The default model with average pooling: no max-pool argmax to flip on 1-ulp differences
    between kernels (see test_engine_parity), so paths agree to float rounding."""
    model = DigitsCNN()
    model.features[6] = nn.AvgPool2d(2)
    return model


def engine(options, **overrides):
    cfg = RunConfig.from_mapping({**KEYS, **overrides})
    task = dataclasses.replace(digits_task(), build_model=smooth_model)
    parts = partition(task.labels, cfg.num_clients, "homogeneous", cfg.seed)
    return run_engine(cfg, options, task=task, parts=parts, write_results=False, show_progress=False)


def assert_close(a, b, atol):
    for key, value in b.items():
        assert a[key].dtype == value.dtype, key
        assert torch.allclose(a[key].double(), value.double(), atol=atol, rtol=0), key


def test_cuda_graphs_equal_eager_fp32():
    eager = engine(EngineOptions(path="vmap"))
    graphs = engine(EngineOptions(path="vmap", cuda_graphs=True))
    assert "cuda-graphs" in graphs.notes[0]
    assert_close(graphs.state, eager.state, 1e-5)
    for a, b in zip(graphs.rows[1:], eager.rows[1:], strict=True):
        assert a["lr"] == b["lr"] and a["train-loss"] == pytest.approx(b["train-loss"], rel=1e-5)
        assert a["clip-fraction"] == b["clip-fraction"]


def test_bf16_and_channels_last_close_to_fp32():
    eager = engine(EngineOptions(path="vmap"))
    cl = engine(EngineOptions(path="vmap", channels_last=True, cuda_graphs=True))
    assert_close(cl.state, eager.state, 1e-4)
    bf16 = engine(EngineOptions(path="vmap", bf16=True, cuda_graphs=True))
    assert bf16.rows[-1]["train-loss"] == pytest.approx(eager.rows[-1]["train-loss"], rel=0.05)
    assert bf16.rows[-1]["test-accuracy"] == pytest.approx(eager.rows[-1]["test-accuracy"], abs=0.1)


def test_auto_on_cuda_vectorises_and_matches_per_client_path():
    auto = engine(EngineOptions())
    assert auto.path == "vmap"
    assert_close(auto.state, engine(EngineOptions(path="sequential")).state, 1e-5)


def test_one_stream_per_client_equals_one_stream():
    streams = engine(EngineOptions(path="sequential", streams=True))
    single = engine(EngineOptions(path="sequential", streams=False))
    assert "one CUDA stream per client" in streams.notes[0]
    assert all(torch.equal(streams.state[k], single.state[k]) for k in single.state)


def test_lstm_model_runs_per_client_on_cuda_streams(tiny_text):
    TinyTextTask = tiny_text

    g = torch.Generator().manual_seed(0)
    streams = [torch.randint(0, 12, (100,), generator=g) for _ in range(3)]
    cfg = RunConfig.from_mapping({"num-clients": 3, "num-rounds": 2, "local-steps": 2, "batch-size": 4,
                                  "device": "cuda", "lr": 0.5, "clip": 0.2})
    on_gpu = run_engine(cfg, task=TinyTextTask(streams), parts=streams, write_results=False, show_progress=False)
    on_cpu = run_engine(cfg.replace(device="cpu"), task=TinyTextTask(streams), parts=streams, write_results=False,
                        show_progress=False)
    assert on_gpu.path == "sequential" and "one CUDA stream per client" in on_gpu.notes[0]
    assert "vmap cannot take TinyLSTM" in on_gpu.notes[0]  # auto probed vmap on CUDA and said why not
    assert_close({k: v.cpu() for k, v in on_gpu.state.items()}, on_cpu.state, 1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL world of 2)")
def test_two_nccl_processes_give_the_one_process_result(tmp_path, vmap_world):
    """vmap over 3 + 2 clients on 2 GPUs (NCCL) == vmap over all 5 on one GPU."""
    script = tmp_path / "vmap_world.py"
    script.write_text(vmap_world)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for cmd in ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                 str(tmp_path / "two.pt"), "cuda"], [sys.executable, str(script), str(tmp_path / "one.pt"), "cuda"]):
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    two, one = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    assert_close(two["state"], one["state"], 1e-5)
