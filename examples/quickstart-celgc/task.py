"""Model and data of the example: an MLP on scikit-learn's digits (offline), standard DataLoaders."""

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    return torch.tensor(x[order] / 16.0, dtype=torch.float32), torch.tensor(y[order])


def load_data(partition_id: int, num_partitions: int, batch_size: int) -> DataLoader:
    """This client's shard of the first 80 % of the digits, shuffled each pass."""
    x, y = _digits()
    train = int(0.8 * len(y))
    part = np.array_split(np.arange(train), num_partitions)[partition_id]
    generator = torch.Generator().manual_seed(partition_id)
    return DataLoader(TensorDataset(x[part], y[part]), batch_size=batch_size, shuffle=True, generator=generator)


def test_data() -> DataLoader:
    x, y = _digits()
    train = int(0.8 * len(y))
    return DataLoader(TensorDataset(x[train:], y[train:]), batch_size=256)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def evaluate(model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """(mean loss, accuracy) of the model on a loader."""
    model.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            loss += nn.functional.cross_entropy(out, y, reduction="sum").item()
            correct += int((out.argmax(1) == y).sum())
            n += len(y)
    return loss / n, correct / n
