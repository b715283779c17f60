"""The learning-rate schedule of the paper, counted in global epochs (pure, no flwr).

One global epoch = one pass over the whole training set summed over all clients, i.e.
after r rounds of N clients taking I steps of batch b: epoch = r * N * I * b / n_train.
At each milestone both lr and clip are multiplied by the decay factor, so clip / lr (the
clipping threshold on the gradient norm) stays fixed, as in the paper.
"""

from __future__ import annotations

from collections.abc import Sequence


def global_epoch(rounds_done: int, num_clients: int, local_steps: int, batch_size: int, train_size: int) -> float:
    """Global epochs completed after ``rounds_done`` rounds."""
    if train_size < 1:
        raise ValueError(f"train-size must be >= 1, got {train_size}")
    return rounds_done * num_clients * local_steps * batch_size / train_size


def scheduled(
    lr: float, clip: float, rounds_done: int, num_clients: int, local_steps: int, batch_size: int,
    train_size: int, milestones: Sequence[float], decay: float,
) -> tuple[float, float]:
    """(lr, clip) after the schedule, for a round that starts after ``rounds_done`` rounds."""
    epoch = global_epoch(rounds_done, num_clients, local_steps, batch_size, train_size)
    factor = decay_factor(epoch, milestones, decay)
    return lr * factor, clip * factor


def decay_factor(epoch: float, milestones: Sequence[float], decay: float) -> float:
    """decay ** (number of milestones reached at ``epoch``)."""
    return decay ** sum(1 for m in milestones if epoch >= m)
