"""Image classification tasks: data held as tensors, a client is a tensor of indices."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tasks.sampling import round_batches

Augment = Callable[[Tensor, torch.Generator], Tensor]


@dataclass
class ClassificationTask:
    """A data set split into train/test tensors and a model builder.

    ``augment(x, generator)`` (optional) runs on a batch on the batch's device; its
    generator is seeded from (seed, round, partition id) so augmentation is as
    reproducible as the sampling. ``transform(x)`` (optional) turns stored inputs into
    model inputs on the device, for training and evaluation batches alike (CIFAR-10 keeps
    uint8 images and normalises per batch: 4x less memory than float copies).
    """

    max_lr_scale = 1.0  # batches carry no lr_scale: every step at the scheduled lr and clip

    name: str
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    num_classes: int
    build_model: Callable[[], nn.Module]
    augment: Augment | None = None
    transform: Callable[[Tensor], Tensor] | None = None
    eval_batch_size: int = 1024
    _device_cache: dict = field(default_factory=dict, repr=False)

    @property
    def train_size(self) -> int:
        return len(self.train_y)

    @property
    def labels(self) -> np.ndarray:
        """Training labels, for the partitioners."""
        return self.train_y.numpy()

    def to(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The training tensors on ``device`` (moved once, then cached)."""
        key = str(device)
        if key not in self._device_cache:
            self._device_cache[key] = (self.train_x.to(device), self.train_y.to(device))
        return self._device_cache[key]

    def round_batches(
        self, partition: np.ndarray, *, seed: int, partition_id: int, server_round: int,
        local_steps: int, batch_size: int, device: torch.device,
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """The (x, y) minibatches of one client in one round, on ``device``."""
        idx = round_batches(partition, seed=seed, partition_id=partition_id, server_round=server_round,
                            local_steps=local_steps, batch_size=batch_size)
        x_all, y_all = self.to(device)
        idx_t = torch.from_numpy(idx).to(device)
        gen = None
        if self.augment is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(np.random.SeedSequence([seed, server_round, partition_id]).generate_state(1)[0]))
        for step in range(local_steps):
            x = x_all[idx_t[step]]
            if self.transform is not None:
                x = self.transform(x)
            if gen is not None:
                x = self.augment(x, gen)
            yield x, y_all[idx_t[step]]

    @staticmethod
    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def test_subsample(self, k: int) -> ClassificationTask:
        """The same task evaluated on every ``k``-th test example (``eval-subsample``)."""
        return dataclasses.replace(self, test_x=self.test_x[::k], test_y=self.test_y[::k], _device_cache={})

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Mean loss and accuracy of ``model`` on the test set."""
        return self._evaluate(model, device, self.test_x, self.test_y, "test")

    def evaluate_train(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Mean loss and accuracy on the whole training set (``eval-train``; no augmentation)."""
        return self._evaluate(model, device, self.train_x, self.train_y, "train-eval")

    def evaluate_indices(self, model: nn.Module, device: torch.device, idx: np.ndarray) -> dict[str, float]:
        """Mean loss and accuracy on the training examples ``idx`` (a client's own data)."""
        t = torch.from_numpy(np.asarray(idx))
        return self._evaluate(model, device, self.train_x[t], self.train_y[t], "eval")

    @torch.no_grad()
    def _evaluate(
        self, model: nn.Module, device: torch.device, x_all: Tensor, y_all: Tensor, prefix: str
    ) -> dict[str, float]:
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        for start in range(0, len(y_all), self.eval_batch_size):
            x = x_all[start : start + self.eval_batch_size].to(device)
            if self.transform is not None:
                x = self.transform(x)
            y = y_all[start : start + self.eval_batch_size].to(device)
            logits = model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
            correct += (logits.argmax(1) == y).sum()
        n = len(y_all)
        loss, acc = torch.stack([loss_sum, correct.double()]).tolist()
        return {f"{prefix}-loss": loss / n, f"{prefix}-accuracy": acc / n}
