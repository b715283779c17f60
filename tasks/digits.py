"""The offline default task: scikit-learn's handwritten digits (ships inside the package).

1,797 grey 8x8 images of 10 digits; a fixed stratified split (seed 0, independent of the
run seed, so every run evaluates on the same 360 images) into 1,437 training and 360 test
images, pixels scaled to [0, 1] and standardised with the training mean/std. The model is
a small CNN with BatchNorm (so averaging of buffers is exercised), ~27k parameters;
``task = "tasks.digits:digits_groupnorm_task"`` is the same data with GroupNorm in its place
(no buffers: what a differentially private run can release whole, at any batch size).
"""

from __future__ import annotations

import gzip
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .classification import ClassificationTask

TEST_FRACTION = 0.2


class DigitsCNN(nn.Module):
    """conv(1->16) BN ReLU, conv(16->32) BN ReLU, maxpool -> 32x4x4 -> fc 64 -> fc 10."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 48), nn.ReLU(), nn.Linear(48, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class DigitsGroupNormCNN(nn.Module):
    """DigitsCNN with GroupNorm (4 channels a group) in place of BatchNorm: the same parameters and no
    buffers, so a DP run has nothing to freeze (docs/tutorials/differential-privacy.md), and a client of one
    image normalises in training exactly as at test time."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.GroupNorm(4, 16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.GroupNorm(8, 32), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 48), nn.ReLU(), nn.Linear(48, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's digits (images [1797, 8, 8] of pixel values 0..16, labels), read from the file
    inside the package -- what ``sklearn.datasets.load_digits`` reads, without importing
    scikit-learn (measured: 0.03 s against 1.6 s, a part of every process's start)."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(next(iter(spec.submodule_search_locations or []), "")) / "datasets" / "data" / "digits.csv.gz"
    if spec is None or not path.is_file():  # another layout of the package: its own loader
        from sklearn.datasets import load_digits

        data = load_digits()
        return data.images, data.target
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


@lru_cache(maxsize=1)
def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """sklearn's images (pixel values 0..16), labels and the fixed test mask."""
    images, target = _digits()
    y = target.astype(np.int64)
    rng = np.random.default_rng(0)
    test = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        test[rng.choice(idx, size=int(round(TEST_FRACTION * len(idx))), replace=False)] = True
    return images, y, test


@lru_cache(maxsize=1)
def _pixel_stats() -> tuple[np.float32, np.float32]:
    images, _, test = _split()
    x = images.astype(np.float32) / 16.0
    return x[~test].mean(), x[~test].std()


def standardize(images: np.ndarray) -> np.ndarray:
    """Pixel values in [0, 16] -> float32 model inputs, standardised like the training set."""
    mean, std = _pixel_stats()
    return (np.asarray(images).astype(np.float32) / 16.0 - mean) / std


def raw_train() -> tuple[np.ndarray, np.ndarray]:
    """The training images (pixel values 0..16, [n, 8, 8]) and labels, in the task's order."""
    images, y, test = _split()
    return images[~test], y[~test]


@lru_cache(maxsize=1)
def _load() -> tuple[torch.Tensor, ...]:
    images, y, test = _split()
    x = standardize(images)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return t(x[~test, None]), t(y[~test]), t(x[test, None]), t(y[test])


def digits_task() -> ClassificationTask:
    train_x, train_y, test_x, test_y = _load()
    return ClassificationTask(
        name="digits", train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y,
        num_classes=10, build_model=DigitsCNN,
    )


def digits_groupnorm_task(cfg: object = None) -> ClassificationTask:
    """The digits task with ``DigitsGroupNormCNN`` (``task = "tasks.digits:digits_groupnorm_task"``)."""
    train_x, train_y, test_x, test_y = _load()
    return ClassificationTask(
        name="digits-groupnorm", train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y,
        num_classes=10, build_model=DigitsGroupNormCNN,
    )
