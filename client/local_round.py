"""One client's work in one round, without Flower: load state, train I steps, return state.

Shared by the ClientApp and by the tests that check the Flower path against a plain loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from strategies.local_update import episode_update
from tasks import cached_task, partitions
from tasks.config import RunConfig
from tasks.device import pick_device
from tasks.protocol import batch_lr_scale, draw_batches, example_counter, state_to, training_loss

from .update import RoundSettings, grad_norm, local_update, split_loss


def train_round(
    cfg: RunConfig,
    partition_id: int,
    settings: RoundSettings,
    state: dict[str, torch.Tensor],
    data: tuple[Any, np.ndarray] | None = None,
    client_state: dict[str, torch.Tensor] | None = None,
    episode: tuple[dict[str, torch.Tensor], float] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, float | int]]:
    """Run one round of local clipped SGD for client ``partition_id`` from ``state``.

    ``episode`` = (correction c_i, ‖G_r‖): the round runs EPISODE's local steps
    (``strategies.local_update.episode_update``) on the same minibatches instead.

    ``settings`` are the round's values sent by the strategy (``RoundSettings.from_config``
    of the round's ConfigRecord). ``data`` = (task, indices)
    replaces the simulated partition (a host's own data, ``client.local_data``); then
    ``partition_id`` only seeds the sampling. ``client_state`` (a stateful task's per-client
    state, ``tasks.protocol``; empty: a fresh client; None: a stateless round) is updated in
    place, its tensors on the training device.
    """
    if data is None and not (0 <= partition_id < cfg.num_clients):
        raise ValueError(
            f"partition-id must be in [0, {cfg.num_clients - 1}] (num-clients = {cfg.num_clients}), got {partition_id}"
        )
    device = pick_device(cfg.device)
    task, idx = data if data is not None else (cached_task(cfg), partitions(cfg)[partition_id])
    model = task.build_model().to(device)
    model.load_state_dict(state)
    if client_state is not None:
        client_state.update(state_to(client_state, device))
    batches = draw_batches(
        task, idx, client_state, seed=cfg.seed, partition_id=partition_id, server_round=settings.server_round,
        local_steps=settings.local_steps, batch_size=settings.batch_size, device=device,
    )
    if episode is not None:
        correction, global_norm = episode
        metrics = episode_update(model, batches, training_loss(task), settings, correction, global_norm,
                                 count=example_counter(task))
    else:
        metrics = local_update(model, batches, training_loss(task), settings, count=example_counter(task))
    new_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return new_state, metrics


def gradient_round(
    cfg: RunConfig,
    partition_id: int,
    settings: RoundSettings,
    state: dict[str, torch.Tensor],
    data: tuple[Any, np.ndarray] | None = None,
    client_state: dict[str, torch.Tensor] | None = None,
    sampling_seed: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float | int]]:
    """A naive parallel-clipping round: the gradient at ``state`` on ONE minibatch.

    The minibatch is the one ``train_round`` would use with one local step (the same
    sampling). Returns ``(grads, buffers, metrics)``: the loss gradient of every trainable
    parameter (zeros where unused), the module's buffers after that training-mode forward
    pass (BatchNorm statistics), and ``train-loss``, ``grad-norm``, ``num-examples``,
    ``num-steps`` (1) and, when the task scales steps, ``lr-scale``. Nothing is applied:
    the server averages the gradients and takes the clipped step. ``client_state``: as in
    ``train_round`` (the language model's hidden state runs on from round to round).
    ``sampling_seed`` replaces ``cfg.seed`` in the minibatch sampling only (EPISODE's
    resample: ``strategies.episode.resample_seed``); the partition stays ``cfg``'s.
    """
    if data is None and not (0 <= partition_id < cfg.num_clients):
        raise ValueError(f"partition-id must be in [0, {cfg.num_clients - 1}] "
                         f"(num-clients = {cfg.num_clients}), got {partition_id}")
    device = pick_device(cfg.device)
    task, idx = data if data is not None else (cached_task(cfg), partitions(cfg)[partition_id])
    model = task.build_model().to(device)
    model.load_state_dict(state)
    model.train()
    if client_state is not None:
        client_state.update(state_to(client_state, device))
    (batch,) = list(draw_batches(
        task, idx, client_state, seed=cfg.seed if sampling_seed is None else sampling_seed,
        partition_id=partition_id, server_round=settings.server_round, local_steps=1, batch_size=settings.batch_size,
        device=device,
    ))
    loss, ce = split_loss(training_loss(task)(model, batch))
    loss.backward()
    named = [(k, p) for k, p in model.named_parameters() if p.requires_grad]
    grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu() for k, p in named}
    buffers = {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in grads}
    count = example_counter(task)
    norm, value = torch.stack([grad_norm(list(grads.values())).double(), loss.detach().double().cpu()]).tolist()
    metrics: dict[str, float | int] = {"train-loss": value, "grad-norm": norm, "num-steps": 1,
                                       "num-examples": int(count(batch)), "skipped-steps": 0}
    if (scale := batch_lr_scale(batch)) is not None:
        metrics["lr-scale"] = float(scale)
    if ce is not None:
        metrics["train-ce"] = float(ce.detach().double().cpu())
    return grads, buffers, metrics
