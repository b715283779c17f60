"""A cross-device CIFAR-10 setting after pfl-research's benchmark (arXiv 2404.06430, Appendix D),
as a task for ``task = "benchmarks.cross_device:make_task"``.

1,000 clients of 50 images each (the 50,000 training images dealt evenly), a small CNN
(two 3x3 convolutions of 32 and 64 channels with 2x2 max pooling, one dense layer to the 10
classes), batch 10 and one local epoch (5 steps) a round in the benchmark's run config.
With the CIFAR-10 files in ``data-dir`` (``tasks.cifar.load_cifar10``) it trains on them;
without, on synthetic CIFAR-shaped uint8 images and labels from a fixed seed -- for speed
measurements only (``benchmarks/flower_speed.py``), never for results.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from tasks.cifar import load_cifar10, normalize
from tasks.classification import ClassificationTask

TRAIN, TEST = 50_000, 10_000


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 6 * 6, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


@lru_cache(maxsize=2)
def _data(data_dir: str) -> tuple[torch.Tensor, ...]:
    try:
        return load_cifar10(data_dir, download=False)
    except FileNotFoundError:  # synthetic, for speed only
        g = torch.Generator().manual_seed(0)
        images = lambda n: torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)  # noqa: E731
        labels = lambda n: torch.randint(0, 10, (n,), generator=g)  # noqa: E731
        return images(TRAIN), labels(TRAIN), images(TEST), labels(TEST)


def synthetic(data_dir: str | Path) -> bool:
    """Whether the task trains on synthetic images (no CIFAR-10 files in ``data_dir``)."""
    try:
        load_cifar10(str(Path(data_dir).expanduser().resolve()), download=False)
        return False
    except FileNotFoundError:
        return True


def make_task(cfg) -> ClassificationTask:
    train_x, train_y, test_x, test_y = _data(str(Path(cfg.data_dir).expanduser().resolve()))
    return ClassificationTask(name="cross-device-cifar10", train_x=train_x, train_y=train_y, test_x=test_x,
                              test_y=test_y, num_classes=10, build_model=SmallCNN, transform=normalize,
                              eval_batch_size=1000)
