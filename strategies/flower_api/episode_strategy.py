"""EPISODE as a Flower strategy: two exchanges a round, resampled gradients then local steps."""

from __future__ import annotations

from typing import Any

from ..methods.episode import EPISODE as EpisodeMethod
from .strategy import ClippedSGDStrategy


class EPISODE(ClippedSGDStrategy):
    """EPISODE: episodic gradient clipping with periodic resampled corrections.

    Crawshaw, Bao, Liu (ICLR 2023), https://arxiv.org/abs/2302.07155, Algorithm 1 (the
    method: ``strategies.methods.episode``; the math: ``strategies.core.episode_corrections``). A round
    has two exchanges with the sampled clients:

    1. ``configure_train`` sends the global arrays with ``mode = "episode-resample"`` and
       waits (``grid.send_and_receive``, ``resample_timeout``) for each client's gradient
       G_r^i at the global point on a fresh minibatch (ArrayRecords ``grads`` and
       ``buffers``, drawn from the resample stream ``strategies.core.episode_corrections.resample_seed``).
       It averages them into G_r (uniformly, or by examples with ``aggregation =
       "examples"``) and builds each client's correction c_i = G_r - G_r^i. A client whose
       resample failed or was unsound (keys or shapes other than the trainable parameters',
       non-finite values) is left out of the round, its reason kept in the round's report.
    2. The train messages carry the global arrays, ArrayRecord ``correction`` (c_i) and in
       the ConfigRecord ``mode = "episode"`` and ``global-grad-norm`` (‖G_r‖): the client
       runs I local EPISODE steps, clipping every step iff ‖G_r‖ > clip/lr, and returns its
       parameters, which are averaged as in CELGC. A reply of a clipping round moved at
       most I clip (the bound checked); a round that does not clip has no bound.

    Bytes: ``bytes-sent`` counts the global model twice per client (both exchanges) plus
    each correction; ``bytes-received`` the resample replies (gradients and buffers) plus
    the parameter replies. Round metrics add ``global-grad-norm`` (‖G_r‖) and
    ``resample-failures``. Global epochs count the I local steps' samples (as CELGC), not
    the resample minibatch.

    Parameters
    ----------
    local_steps, lr, **kwargs
        As for :class:`strategies.flower_api.celgc_strategy.CELGC`.
    resample_timeout : float, optional
        Seconds to wait for the resampled gradients (None: no limit).
    """

    algorithm_class = EpisodeMethod

    def __init__(self, local_steps: int, lr: float, resample_timeout: float | None = None, **kwargs: Any) -> None:
        if resample_timeout is not None and not (resample_timeout > 0):
            raise ValueError(f"resample_timeout must be > 0 seconds or None, got {resample_timeout!r}")
        super().__init__(lr=lr, local_steps=local_steps, exchange_timeout=resample_timeout, **kwargs)

    @property
    def resample_timeout(self) -> float | None:
        return self.exchange_timeout
