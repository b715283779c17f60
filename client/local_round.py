"""One client's part of an exchange, without Flower: its group, the method's client side, its results.

``client_round`` builds the ``ClientGroup`` of one client -- the task's model on the run's
device, the client's partition (or a host's own data), its kept state -- and runs the client
side of the method that answers the exchange's mode (``strategies.algorithms.answering``):
the same executor and the same code as the engine's clients. The ClientApp calls it for every
train message; ``train_round`` and ``gradient_round`` are the two common exchanges for tests
and notebooks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from strategies.algorithm import Exchange
from strategies.algorithms import answering
from strategies.executors import ClientGroup, SequentialClients
from strategies.reduce import ClientResults, per_client
from strategies.settings import Mode, RoundSettings
from tasks import cached_task, partitions
from tasks.config import RunConfig
from tasks.device import pick_device
from tasks.protocol import draw_batches, example_counter, state_to, training_loss


def client_round(cfg: RunConfig, partition_id: int, exchange: Exchange, data: tuple[Any, np.ndarray] | None = None,
                 client_state: dict[str, torch.Tensor] | None = None,
                 memory: dict[str, torch.Tensor] | None = None) -> ClientResults:
    """Client ``partition_id``'s results of ``exchange`` (its one client; ``exchange.state`` is
    the global model).

    ``data`` = (task, indices) replaces the simulated partition (a host's own data,
    ``client.local_data``); then ``partition_id`` only seeds the sampling. ``client_state``
    (a stateful task's per-client state, ``tasks.protocol``; empty: a fresh client; None: a
    stateless round) and ``memory`` (the method's own per-client state, e.g. SCAFFOLD's
    control variate) are updated in place."""
    if data is None and not (0 <= partition_id < cfg.num_clients):
        raise ValueError(
            f"partition-id must be in [0, {cfg.num_clients - 1}] (num-clients = {cfg.num_clients}), got {partition_id}"
        )
    device = pick_device(cfg.device)
    task, idx = data if data is not None else (cached_task(cfg), partitions(cfg)[partition_id])
    if client_state is not None:
        client_state.update(state_to(client_state, device))
    if memory is not None:
        memory.update({k: v.to(device) for k, v in memory.items()})
    executor = SequentialClients(task.build_model, training_loss(task), 1, device, count=example_counter(task),
                                 streams=False)

    def draw(pid: int, state: dict | None, **kw: Any):
        return draw_batches(task, idx, state, partition_id=pid, device=device, **kw)

    group = ClientGroup(executor, [partition_id], draw, seed=cfg.seed, task_states=[client_state],
                        memory=[memory if memory is not None else {}])
    group.load(exchange.state)
    return answering(exchange.mode).client(exchange, group)


def train_round(cfg: RunConfig, partition_id: int, settings: RoundSettings, state: dict[str, torch.Tensor],
                data: tuple[Any, np.ndarray] | None = None, client_state: dict[str, torch.Tensor] | None = None,
                ) -> tuple[dict[str, torch.Tensor], dict[str, float | int]]:
    """One round of local clipped SGD (``mode = "local"``) from ``state``: (the client's new
    state on the CPU, its metrics as its reply reports them)."""
    results = client_round(cfg, partition_id, Exchange(settings.replace(mode=Mode.LOCAL), [partition_id], state),
                           data, client_state)
    return _cpu(per_client(results.arrays["arrays"])[0]), _metrics(results)


def gradient_round(cfg: RunConfig, partition_id: int, settings: RoundSettings, state: dict[str, torch.Tensor],
                   data: tuple[Any, np.ndarray] | None = None, client_state: dict[str, torch.Tensor] | None = None,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float | int]]:
    """A naive parallel-clipping exchange (``mode = "gradient"``): the gradient at ``state`` on
    ONE minibatch (the one ``train_round`` would take first): (the gradients of the trainable
    parameters, the buffers after that forward pass, the metrics), all on the CPU."""
    results = client_round(cfg, partition_id, Exchange(settings.replace(mode=Mode.GRADIENT), [partition_id], state),
                           data, client_state)
    return (_cpu(per_client(results.arrays["grads"])[0]), _cpu(per_client(results.arrays["buffers"])[0]),
            _metrics(results))


def _cpu(state) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in state.items()}


def _metrics(results: ClientResults) -> dict[str, float | int]:
    return results.metrics_of(0)
