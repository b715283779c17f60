"""Tasks shared by both sides: data sets and models (pure PyTorch, no flwr).

``load_task(cfg)`` returns the task named by the ``task`` config key. Every task offers:
``train_size``, ``labels`` (for partitioners) or ``client_partitions(cfg)`` (its own
split, e.g. token streams), ``build_model()``, ``round_batches(...)`` (a client's minibatches
of one round), ``loss(model, batch)``, ``evaluate(model, device)`` and
``evaluate_indices(model, device, part)``; optionally ``count_examples(batch)``. A batch
may carry ``lr_scale`` (multiplies that step's lr and clip).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from .config import RunConfig


def load_task(cfg: RunConfig) -> Any:
    """The task named by ``cfg.task``; data sets are read from ``cfg.data_dir``.

    digits: scikit-learn's digits and a small CNN (offline, ships with scikit-learn);
    cifar10: CIFAR-10 + ResNet-56 (``tasks.cifar_task``; downloads only with
    ``download = true``); ptb / wikitext2: the word-level corpora + AWD-LSTM
    (``tasks.language``; never downloaded). A missing data set is a FileNotFoundError
    that says where to put the files.
    """
    if cfg.task == "digits":
        from .digits import digits_task

        return digits_task()
    if cfg.task == "cifar10":
        from .cifar_task import cifar10_task

        return cifar10_task(cfg.data_dir, cfg.download)
    if cfg.task in ("ptb", "wikitext2"):
        from .language import language_task

        return language_task(cfg.task, cfg.data_dir)
    raise ValueError(f"unknown task {cfg.task!r}")


def initial_model(task: Any, seed: int) -> Any:
    """The task's model initialised from ``seed`` without touching the global RNG state.

    Every backend (ServerApp, fast engine) starts from this model, so a seed means the same
    initial weights everywhere.
    """
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return task.build_model()



@lru_cache(maxsize=4)
def cached_task(cfg: RunConfig) -> Any:
    """``load_task(cfg)``, loaded once per process for each config."""
    return load_task(cfg)


@lru_cache(maxsize=4)
def partitions(cfg: RunConfig) -> tuple[np.ndarray, ...]:
    """All clients' index sets, from (seed, num-clients, partitioner) alone."""
    from .partition import partition

    task = cached_task(cfg)
    if hasattr(task, "client_partitions"):  # e.g. language models: one token stream per client
        return tuple(task.client_partitions(cfg))
    return tuple(partition(task.labels, cfg.num_clients, cfg.partitioner, cfg.seed,
                           similarity=cfg.similarity, alpha=cfg.dirichlet_alpha))
