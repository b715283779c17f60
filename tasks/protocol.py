"""What a task is: the one protocol every backend (ClientApp, ServerApp, engine) relies on.

A task couples a data set with a model. Required members:

* ``train_size`` -- training examples of all clients together (counts global epochs);
* ``build_model()`` -- a fresh ``nn.Module`` (initialised from the global torch RNG;
  ``tasks.initial_model`` seeds it);
* ``round_batches(part, *, seed, partition_id, server_round, local_steps, batch_size,
  device)`` -- the ``local_steps`` minibatches of one client in one round, a pure function
  of its arguments (``tasks.sampling.round_batches`` draws the indices);
* ``loss(model, batch)`` -- the scalar training loss of one minibatch;
* ``evaluate(model, device)`` -- metrics of the held-out set (keys like ``test-accuracy``);
* ``evaluate_indices(model, device, part)`` -- metrics on one client's own data;
* and EITHER ``labels`` (an array of training labels for the partitioners) OR
  ``client_partitions(cfg)`` (the task's own split, one part per client).

Optional: ``count_examples(batch)`` (default: ``len(batch[0])``), and a batch may carry
``lr_scale`` (multiplies that step's lr and clip, e.g. AWD-LSTM's seq_len / bptt).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    import numpy as np

REQUIRED = ("train_size", "build_model", "round_batches", "loss", "evaluate", "evaluate_indices")
SPLITS = ("labels", "client_partitions")


@runtime_checkable
class Task(Protocol):
    """The members every task has (see the module docstring for the optional ones)."""

    @property
    def train_size(self) -> int: ...

    def build_model(self) -> nn.Module: ...

    def round_batches(self, partition: Any, *, seed: int, partition_id: int, server_round: int, local_steps: int,
                      batch_size: int, device: torch.device) -> Iterable[Any]: ...

    def loss(self, model: nn.Module, batch: Any) -> Tensor: ...

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]: ...

    def evaluate_indices(self, model: nn.Module, device: torch.device, partition: np.ndarray) -> dict[str, float]: ...


def check_task(task: object, source: str = "the task") -> Task:
    """``task`` if it has every required member, else a TypeError naming each missing one."""
    missing = [name for name in REQUIRED if not hasattr(task, name)]
    if not any(hasattr(task, name) for name in SPLITS):
        missing.append("labels or client_partitions")
    if missing:
        raise TypeError(f"{source} ({type(task).__name__}) is not a task: it lacks {', '.join(missing)} "
                        "(see tasks/protocol.py)")
    return task  # type: ignore[return-value]


def default_count(batch: Any) -> int:
    """Examples in an (inputs, labels) batch."""
    return len(batch[0])


def example_counter(task: object) -> Callable[[Any], int]:
    """The task's ``count_examples`` or ``default_count``."""
    return getattr(task, "count_examples", None) or default_count


def batch_lr_scale(batch: object) -> float | None:
    """The batch's own step scale (``lr_scale``), or None."""
    return getattr(batch, "lr_scale", None)
