"""Naive parallel clipping as a Flower strategy: one clipped step per communication."""

from __future__ import annotations

from typing import Any

from ..core.settings import Mode
from ..methods.naive import NaiveParallelClip as NaiveMethod
from .strategy import ClippedSGDStrategy

#: ``mode`` value of the round config asking a client for its gradient, not a local update.
GRADIENT_MODE = Mode.GRADIENT.value


class NaiveParallelClip(ClippedSGDStrategy):
    """Naive parallel gradient clipping (the baseline of Liu et al., NeurIPS 2022).

    Paper: https://arxiv.org/abs/2205.05040; the method is ``strategies.methods.naive``.
    Each round is ONE step: the round config carries ``mode = "gradient"`` and
    ``local-steps = 1``; every client answers with ``grads`` (an ArrayRecord of the loss
    gradient w.r.t. each trainable parameter at the received point, on one minibatch of
    ``batch-size``), ``buffers`` (its floating and integer buffers after that forward pass,
    e.g. BatchNorm statistics) and ``metrics``. The server averages gradients and buffers
    (uniformly, or weighted by examples) and applies the clipped step to the global
    parameters. With ``momentum > 0`` the server keeps the heavy-ball buffer across rounds
    (the paper uses 0).

    Language-model clients may report ``lr-scale`` (the AWD-LSTM ``seq_len / bptt``); the
    step uses the mean over the replies (all clients draw the same length each round).

    Bytes: ``bytes-sent`` = the model once per sampled client (parameters and buffers
    down), ``bytes-received`` = what the replies carried (gradients and buffers up).
    Round metrics: ``train-loss`` (clients' mean loss at the shared point), ``grad-norm``
    (|g_bar|, the norm the clip acts on), ``clip-fraction`` (1.0 if this step was
    clipped), ``skipped-steps`` (1 if |g_bar| was not finite), ``client-grad-norm``.

    Parameters
    ----------
    lr, clip, batch_size, weight_decay, momentum, lr_decay, lr_milestones, train_size,
    aggregation, trim_fraction, num_clients, **fedavg_kwargs
        As for :class:`strategies.flower_api.strategy.ClippedSGDStrategy`; there are no local steps (I = 1).
    """

    algorithm_class = NaiveMethod

    def __init__(self, lr: float, **kwargs: Any) -> None:
        if "local_steps" in kwargs:
            raise TypeError("NaiveParallelClip takes no local_steps: every round is one step (I = 1)")
        super().__init__(lr=lr, local_steps=1, **kwargs)
