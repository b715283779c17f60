"""The CIFAR-10 task glue: uint8 storage, per-batch normalisation and augmentation, the
registry, the missing-data error, and one round through the ServerApp/ClientApp (fake files)."""

import dataclasses
import pickle

import numpy as np
import pytest
import torch

import tasks as local_round
import tasks.cifar_task as cifar_task
from simulations.loopback import run_in_process
from tasks import load_task
from tasks.cifar import BATCHES_DIR, CIFAR10_MEAN, CIFAR10_STD, TEST_BATCH, TRAIN_BATCHES
from tasks.config import RunConfig
from tasks.runs.results import read_results


def fake_cifar(root, n=8):
    folder = root / BATCHES_DIR
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for k, name in enumerate(TRAIN_BATCHES + (TEST_BATCH,)):
        batch = {"labels": [(i + k) % 10 for i in range(n)], "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8)}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    fake_cifar(tmp_path / "data")
    monkeypatch.setattr(cifar_task, "DEPTH", 8)  # ResNet-8: the same code, quicker
    cifar_task._load.cache_clear()
    local_round.cached_task.cache_clear()
    local_round.partitions.cache_clear()
    yield tmp_path
    cifar_task._load.cache_clear()
    local_round.cached_task.cache_clear()
    local_round.partitions.cache_clear()


def test_missing_cifar_is_an_error_not_random_data(tmp_path):
    cifar_task._load.cache_clear()
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        load_task(RunConfig.from_mapping({"task": "cifar10", "data-dir": str(tmp_path)}))


def test_batches_are_normalised_and_augmented_reproducibly(fake):
    task = load_task(RunConfig.from_mapping({"task": "cifar10", "data-dir": str(fake / "data")}))
    assert task.train_x.dtype == torch.uint8 and task.train_size == 40 and task.build_model().depth == 8
    kw = {"seed": 0, "partition_id": 1, "server_round": 2, "local_steps": 2, "batch_size": 4, "device": torch.device("cpu")}
    part = np.arange(20, 40)
    a = list(task.round_batches(part, **kw))
    b = list(task.round_batches(part, **kw))
    assert a[0][0].shape == (4, 3, 32, 32) and a[0][0].dtype == torch.float32
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    # without augmentation a batch is exactly the normalised images
    plain = [x for x, _ in dataclasses.replace(task, augment=None, _device_cache={}).round_batches(part, **kw)]
    mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(3, 1, 1)
    idx = [int(i) for i in part]
    first = plain[0][0]
    assert any(torch.allclose(first, (task.train_x[i].permute(2, 0, 1) / 255.0 - mean) / std, atol=1e-6) for i in idx)
    assert not all(torch.equal(x, y) for (x, _), y in zip(a, plain))  # crops and flips change images
    metrics = task.evaluate(task.build_model(), torch.device("cpu"))
    assert 0.0 <= metrics["test-accuracy"] <= 1.0 and metrics["test-loss"] > 0


def test_one_round_through_the_apps(fake):
    cfg = RunConfig.from_mapping({"task": "cifar10", "data-dir": str(fake / "data"), "num-clients": 2,
                                  "batch-size": 4, "local-steps": 2, "num-rounds": 1, "device": "cpu",
                                  "results-dir": str(fake / "res"), "run-name": "c", "node-wait": 2.0})
    run_in_process(cfg.to_mapping())
    header, rows = read_results(fake / "res" / "c" / "results.jsonl")
    assert header["train-size"] == 40 and rows[-1]["replies"] == 2 and "test-accuracy" in rows[-1]
