"""The digits CNN and a node's share of scikit-learn's digits (the same model and data as the
project's default task, written for this app alone)."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 48), nn.ReLU(), nn.Linear(48, 10))


def partition(pid: int, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    x = (data.images.astype(np.float32) / 16.0 - 0.3) / 0.4
    idx = np.random.default_rng(0).permutation(len(x))[pid::num]
    return torch.from_numpy(x[idx, None]), torch.from_numpy(data.target[idx].astype(np.int64))
