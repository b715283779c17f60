"""A node's clients in an exchange, without Flower: their group, the method's client side, their results.

``client_round`` builds the ``ClientGroup`` of a node's clients -- one, or the several a
multi-client node serves; the task's model on the run's device, each client's partition (or a
host's own data), their kept state -- on the executor the engine would choose
(``strategies.methods.executors.choose_executor``), and runs the client side of the method the
exchange's settings name (``strategies.methods.client_side``): the same code as the engine's
clients. The ClientApp calls it for every
train message; ``train_round`` and ``gradient_round`` are the two common exchanges for tests
and notebooks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from strategies.core.settings import Mode, RoundSettings
from strategies.methods import client_side
from strategies.methods.algorithm import Exchange
from strategies.methods.executors import ClientGroup, EngineOptions, choose_executor
from strategies.methods.reduce import ClientResults, per_client
from tasks import cached_task, partitions
from tasks.config import RunConfig
from tasks.device import pick_device
from tasks.protocol import draw_batches, example_counter, state_to, training_loss


def client_round(cfg: RunConfig, partition_id: int | Sequence[int], exchange: Exchange,
                 data: tuple[Any, np.ndarray] | None = None,
                 client_state: dict[str, torch.Tensor] | None | Sequence[dict[str, torch.Tensor] | None] = None,
                 memory: dict[str, torch.Tensor] | None | Sequence[dict[str, torch.Tensor] | None] = None,
                 *, owned: bool = True) -> ClientResults:
    """The results of ``exchange`` for the clients ``partition_id`` (one id, or the several a
    multi-client node serves: all run with one call of the executor the engine would choose);
    ``exchange.state`` is the global model.

    ``data`` = (task, indices) replaces the simulated partition (a host's own data,
    ``client.local_data``; one client); then ``partition_id`` only seeds the sampling.
    ``client_state`` (a stateful task's per-client state, ``tasks.protocol``; empty: a fresh
    client; None: a stateless round) and ``memory`` (the method's own per-client state, e.g.
    SCAFFOLD's control variate) -- one per client -- are updated in place. ``owned`` False: the
    results' arrays may be the executor's own tensors, valid until the node's next exchange (the
    ClientApp writes them into its reply at once; a copy of a 96 MB model a client saved)."""
    single = isinstance(partition_id, int)
    pids = [partition_id] if single else [int(p) for p in partition_id]
    states = [client_state] if single else list(client_state or [None] * len(pids))
    memories = [memory] if single else list(memory or [None] * len(pids))
    if data is not None and len(pids) != 1:
        raise ValueError(f"a node with its own data is one client, got clients {pids}")
    bad = [p for p in pids if data is None and not 0 <= p < cfg.num_clients]
    if bad:
        raise ValueError(f"partition-id must be in [0, {cfg.num_clients - 1}] (num-clients = {cfg.num_clients}), got "
                         f"{bad[0] if single else bad}")
    device = pick_device(cfg.device)
    task = data[0] if data is not None else cached_task(cfg)
    parts = {pids[0]: data[1]} if data is not None else {p: partitions(cfg)[p] for p in pids}
    for state in states:
        if state is not None:
            state.update(state_to(state, device))
    memories = [m if m is not None else {} for m in memories]
    for m in memories:
        m.update({k: v.to(device) for k, v in m.items()})
    method = client_side(exchange.settings)

    def draw(pid: int, state: dict | None, **kw: Any):
        return draw_batches(task, parts[pid], state, partition_id=pid, device=device, **kw)

    def probe():
        s = exchange.settings
        batches = [next(iter(draw(p, None, seed=cfg.seed, server_round=s.server_round, local_steps=s.local_steps,
                                  batch_size=s.batch_size))) for p in pids]
        return batches, s.step, exchange.state

    executor = _executor(task, len(pids), device, method, probe)
    group = ClientGroup(executor, pids, draw, seed=cfg.seed, task_states=states, memory=memories, base=cfg.hyper)
    group.load(exchange.state)
    results = method.client(exchange, group)
    # the executor lives on to the next exchange: kept results must not be its modules' tensors
    if owned:
        results.arrays = {name: _owned(arrays) for name, arrays in results.arrays.items()}
    return results


def _owned(arrays: Any) -> Any:
    if isinstance(arrays, Mapping):
        return {k: v.clone() for k, v in arrays.items()}
    return [{k: v.clone() for k, v in state.items()} for state in arrays]


#: a node's executors, kept from message to message (a simulated node's ClientApp lives on;
#: every exchange loads the global model into it first): (task, clients, device, method) -> executor.
#: The task itself is kept beside its executor, so a task built anew never meets another's model.
_EXECUTORS: dict[tuple, tuple[Any, Any]] = {}


def _executor(task: Any, n: int, device: torch.device, method: Any, probe: Any) -> Any:
    key = (id(task), n, str(device), method.vectorises)
    kept = _EXECUTORS.get(key)
    if kept is None or kept[0] is not task:
        if len(_EXECUTORS) >= 8:
            _EXECUTORS.pop(next(iter(_EXECUTORS)))
        executor = choose_executor(task.build_model, training_loss(task), task.loss, n, device, EngineOptions(),
                                   count=example_counter(task), method=method, probe=probe)[0]
        kept = _EXECUTORS[key] = (task, executor)
    return kept[1]


def train_round(cfg: RunConfig, partition_id: int, settings: RoundSettings, state: dict[str, torch.Tensor],
                data: tuple[Any, np.ndarray] | None = None, client_state: dict[str, torch.Tensor] | None = None,
                ) -> tuple[dict[str, torch.Tensor], dict[str, float | int]]:
    """One round of local clipped SGD (``mode = "local"``; the method ``settings`` name, default
    CELGC) from ``state``: (the client's new state on the CPU, its metrics as its reply reports them)."""
    settings = settings.replace(mode=Mode.LOCAL, algorithm=settings.algorithm or "celgc")
    results = client_round(cfg, partition_id, Exchange(settings, [partition_id], state), data, client_state)
    return _cpu(per_client(results.arrays["arrays"])[0]), _metrics(results)


def gradient_round(cfg: RunConfig, partition_id: int, settings: RoundSettings, state: dict[str, torch.Tensor],
                   data: tuple[Any, np.ndarray] | None = None, client_state: dict[str, torch.Tensor] | None = None,
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float | int]]:
    """A naive parallel-clipping exchange (``mode = "gradient"``): the gradient at ``state`` on
    ONE minibatch (the one ``train_round`` would take first): (the gradients of the trainable
    parameters, the buffers after that forward pass, the metrics), all on the CPU."""
    settings = settings.replace(mode=Mode.GRADIENT, algorithm=settings.algorithm or "naive")
    results = client_round(cfg, partition_id, Exchange(settings, [partition_id], state), data, client_state)
    return (_cpu(per_client(results.arrays["grads"])[0]), _cpu(per_client(results.arrays["buffers"])[0]),
            _metrics(results))


def _cpu(state) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in state.items()}


def _metrics(results: ClientResults) -> dict[str, float | int]:
    return results.metrics_of(0)
