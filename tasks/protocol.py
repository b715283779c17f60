"""What a task is: the one protocol every backend (ClientApp, ServerApp, engine) relies on.

A task couples a data set with a model. The ``task`` config key names one: a built-in
(``digits``, ``cifar10``, ``ptb``, ``wikitext2``, ``shakespeare``) or your own,
``"package.module:factory"``.

Your own task (docs/tutorials/own-task.md; ``examples/own_task/`` is a complete one)
----------------------------------------------------------------------------------
``factory`` is any callable reachable as ``module.attribute[.attribute...]``; every process
that needs the task (the ServerApp, each ClientApp, each engine rank) imports ``module``
and calls ``factory(cfg)`` with the run's validated ``tasks.config.RunConfig`` -- what the
built-in tasks receive: ``cfg.data_dir`` and ``cfg.download`` say where data lives, and
``cfg.seed``, ``cfg.num_clients``, ... are there when the task needs them. It returns a
task as below, and must return the same one for the same config in every process (a fixed
train/test split, data in a fixed order): processes build their copies independently.
``module`` must be importable where the apps run: a folder of this project (``flwr run .``
ships the project folder to the ServerApp and ClientApps and puts it on their path;
``python -m simulations.engine`` and ``torchrun`` run from the project root), installed in
the environment, or, for the engine, on ``PYTHONPATH``. The common case -- inputs and integer
class labels in memory, cross-entropy, accuracy -- is ``tasks.custom.tensor_task`` (tensors or
NumPy arrays) or ``tasks.custom.dataset_task`` (a ``torch.utils.data.Dataset`` of
(input, label) pairs); both give the ``tasks.classification.ClassificationTask`` the digits
task is, so the same tensors (values and strides) train bit for bit like the built-in task.

Required members
----------------
* ``train_size`` -- training examples of all clients together (counts global epochs);
* ``build_model()`` -- a fresh ``nn.Module`` (initialised from the global torch RNG;
  ``tasks.initial_model`` seeds it);
* ``round_batches(part, *, seed, partition_id, server_round, local_steps, batch_size,
  device)`` -- the ``local_steps`` minibatches of one client in one round, a pure function
  of its arguments (``tasks.sampling.round_batches`` draws the indices);
* ``loss(model, batch)`` -- the scalar training loss of one minibatch;
* ``evaluate(model, device)`` -- metrics of the held-out set (keys like ``test-accuracy``,
  ``test-loss``; they become columns of results.jsonl);
* ``evaluate_indices(model, device, part)`` -- metrics on one client's own data;
* and EITHER ``labels`` (an array of training labels, one per example, for the
  partitioners: a client's ``part`` is then an array of example indices) OR
  ``client_partitions(cfg)`` (the task's own split, one ``part`` per client, e.g. a token
  stream each).

Optional
--------
* ``count_examples(batch)`` -- examples in a batch (default: ``len(batch[0])``);
* a batch may carry ``lr_scale`` -- multiplies that step's lr and clip (e.g. AWD-LSTM's
  seq_len / bptt);
* ``max_lr_scale`` -- the largest ``lr_scale`` its batches carry (1.0 when they carry
  none); the server's clipping-bound reply filter needs it and is off for a task without
  it. ``counts_rows = True`` says ``count_examples`` counts a batch's rows (batch-size of
  them), so the server can verify a reply's ``num-examples``;
* ``loss_terms(model, batch) -> (loss, cross-entropy)`` when the training loss adds
  regularisers (reported apart as ``train-ce``);
* ``evaluate_train(model, device)`` -- metrics of the whole training set (``eval-train``,
  keys ``train-eval-*``);
* per-client state (``stateful = True``): a task whose clients carry something from round
  to round (the language model's hidden state and place in its text) takes ``state=`` in
  ``round_batches``: a ``dict[str, Tensor]`` that it reads when the round starts and
  updates while the batches are drawn and the losses computed (an empty dict: a fresh
  client). After the round the dict holds what to keep; ``state=None``
  (``client-state = "reset"``) gives the stateless round. Tensors may live on the device;
  ``state_to_cpu`` / ``state_to`` move them. Backends keep the dict per client (the
  ClientApp in Flower's ``Context.state``, the engine per client). Within a round, state
  may also live in the batches (one mutable object shared by a round's batches);
* a model class with ``engine_vmap = False`` makes the engine's ``auto`` path run its
  clients one after another instead of stacked with ``torch.func.vmap``.

``check_task`` names every missing required member of a task when it is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from strategies.core.local_update import default_count

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
    methods = [*REQUIRED[1:], *(["client_partitions"] if hasattr(task, "client_partitions") else [])]
    not_callable = [name for name in methods if not callable(getattr(task, name))]
    if not_callable:
        raise TypeError(f"{source} ({type(task).__name__}) is not a task: {', '.join(not_callable)} must be "
                        "callable (see tasks/protocol.py)")
    return task  # type: ignore[return-value]


def is_stateful(task: object) -> bool:
    """Whether the task's clients carry state across rounds (``stateful = True``)."""
    return bool(getattr(task, "stateful", False))


def draw_batches(task: Task, partition: Any, state: dict[str, Tensor] | None, **kw: Any) -> Iterable[Any]:
    """``task.round_batches(partition, **kw)``, with ``state=`` when the task is stateful and
    ``state`` is not None (see the module docstring)."""
    if state is not None and is_stateful(task):
        return task.round_batches(partition, state=state, **kw)  # type: ignore[call-arg]
    return task.round_batches(partition, **kw)


def training_loss(task: object) -> Callable[[nn.Module, Any], Any]:
    """``task.loss_terms`` (loss, cross-entropy) when the task has it, else ``task.loss``."""
    return getattr(task, "loss_terms", None) or task.loss  # type: ignore[attr-defined]


def state_to(state: dict[str, Tensor], device: torch.device | str) -> dict[str, Tensor]:
    """A client state with its floating-point tensors on ``device`` (counters stay on the CPU)."""
    return {k: v.to(device) if v.is_floating_point() else v.cpu() for k, v in state.items()}


def state_to_cpu(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().cpu() for k, v in state.items()}


def example_counter(task: object) -> Callable[[Any], int]:
    """The task's ``count_examples`` or ``default_count``."""
    return getattr(task, "count_examples", None) or default_count


def counts_rows(task: object) -> bool:
    """True when a batch's example count is its rows (``batch-size``): the default count, or a
    task that says so (``counts_rows = True``)."""
    return example_counter(task) is default_count or bool(getattr(task, "counts_rows", False))


def lr_scale_bound(task: object) -> float:
    """The task's ``max_lr_scale`` for the server's reply filter (inf: unknown, filter off)."""
    value = getattr(task, "max_lr_scale", None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("inf")


def batch_lr_scale(batch: object) -> float | None:
    """The batch's own step scale (``lr_scale``), or None."""
    return getattr(batch, "lr_scale", None)
