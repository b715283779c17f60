"""The pure math of client-level DP (no flwr): the DP keys, noise, the secure client sample, projection.

``DPSettings`` -- a run's DP keys, validated (``tasks.config``: dp-noise-multiplier, dp-clip,
dp-delta, dp-max-epsilon, dp-accountant, dp-buffers, dp-reproducible). ``secure_normal`` draws standard normal
float64 noise from the operating system's CSPRNG (``os.urandom``; Box-Muller on 53-bit
uniforms), ``seeded_normal`` from (seed, round) -- reproducible and NOT private;
``secure_participants`` draws K of M clients uniformly without replacement with
``secrets.SystemRandom``; ``project`` scales rows into an l2 ball; ``norm_statistics`` summarises
the contributions' norms before projection (the rows' ``dp-update-norm-*``). The mechanism that uses them
is ``strategies.methods.privacy``; the accountant ``strategies.core.dp_accountant``.

What floating-point Gaussian sampling does not protect against: a float sample is not exactly
Gaussian, and its low-order bits can reveal the unnoised value (Mironov, CCS 2012); no
snapping or discrete Gaussian is used here.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

BUFFER_CHOICES = ("refuse", "frozen")
#: the accountants of ``strategies.core.dp_accountant``: Renyi DP (the default) or the privacy loss distribution
ACCOUNTANTS = ("rdp", "pld")
#: separates the reproducible noise stream from the run's other seeded streams
NOISE_TAG = 0xD9A0
_TWO_POW_53 = float(2 ** 53)


@dataclass(frozen=True)
class DPSettings:
    """A run's DP keys (``tasks.config``: dp-noise-multiplier, dp-clip, dp-delta, dp-max-epsilon,
    dp-accountant, dp-buffers, dp-reproducible); z = 0: no DP."""

    noise_multiplier: float = 0.0
    clip: float = 0.0
    delta: float = 0.0
    max_epsilon: float = 0.0
    accountant: str = "rdp"
    buffers: str = "refuse"
    reproducible: bool = False

    @property
    def enabled(self) -> bool:
        return self.noise_multiplier > 0

    def problems(self) -> list[str]:
        """Every invalid value, as a message naming its key."""
        out = []
        for key, value in (("dp-noise-multiplier", self.noise_multiplier), ("dp-clip", self.clip),
                           ("dp-max-epsilon", self.max_epsilon)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                out.append(f"{key} must be a finite number >= 0 (0: off), got {value!r}")
        if not (isinstance(self.delta, (int, float)) and 0 <= self.delta < 1):
            out.append(f"dp-delta must be in [0, 1) (0: 1/num-clients^1.1), got {self.delta!r}")
        if self.accountant not in ACCOUNTANTS:
            out.append(f"dp-accountant must be one of {', '.join(ACCOUNTANTS)}, got {self.accountant!r}")
        if self.buffers not in BUFFER_CHOICES:
            out.append(f"dp-buffers must be one of {', '.join(BUFFER_CHOICES)}, got {self.buffers!r}")
        if not self.enabled:
            used = [k for k, v in (("dp-clip", self.clip), ("dp-delta", self.delta), ("dp-max-epsilon", self.max_epsilon),
                                   ("dp-accountant", self.accountant != ACCOUNTANTS[0])) if v]
            if used:
                out.append(f"{', '.join(used)} set without dp-noise-multiplier: set dp-noise-multiplier > 0 for a DP "
                           "run (0: no DP, the default)")
        return out


# --- noise ------------------------------------------------------------------------------
def secure_normal(n: int) -> Tensor:
    """``n`` standard normal float64 samples from the OS CSPRNG (``os.urandom``; Box-Muller on
    53-bit uniforms in (0, 1])."""
    if n <= 0:
        return torch.zeros(0, dtype=torch.float64)
    m = (n + 1) // 2
    raw = np.frombuffer(os.urandom(16 * m), dtype=np.uint64)
    u = ((raw >> np.uint64(11)).astype(np.float64) + 1.0) / _TWO_POW_53  # (0, 1]
    r = np.sqrt(-2.0 * np.log(u[:m]))
    theta = 2.0 * math.pi * u[m:]
    return torch.from_numpy(np.concatenate([r * np.cos(theta), r * np.sin(theta)])[:n].copy())


def seeded_normal(n: int, seed: int, server_round: int) -> Tensor:
    """``n`` standard normal float64 samples from (seed, round): reproducible, NOT private."""
    key = np.random.SeedSequence([seed, server_round, NOISE_TAG]).generate_state(2, dtype=np.uint32)
    generator = torch.Generator().manual_seed(int(key[0]) << 32 | int(key[1]))
    return torch.randn(n, dtype=torch.float64, generator=generator)


def secure_participants(num_clients: int, per_round: int) -> list[int]:
    """``per_round`` distinct clients drawn uniformly (every subset equally likely) by the OS CSPRNG."""
    if not 1 <= per_round <= num_clients:
        raise ValueError(f"clients-per-round must be in [1, num-clients={num_clients}], got {per_round}")
    return sorted(secrets.SystemRandom().sample(range(num_clients), per_round))


# --- projection ---------------------------------------------------------------------------
def project(matrix: Tensor, radius: float) -> tuple[Tensor, Tensor]:
    """Each row scaled into the l2 ball of ``radius`` (rows inside unchanged); and [n] True
    where a row was scaled."""
    norms = matrix.norm(dim=1)
    outside = norms > radius
    scale = torch.where(outside, radius / norms.clamp_min(torch.finfo(matrix.dtype).tiny), torch.ones_like(norms))
    return matrix * scale[:, None], outside


#: the quantile of the contributions' norms reported beside their mean and maximum (``dp-update-norm-q90``)
NORM_QUANTILE = 0.9


def norm_statistics(norms: Tensor, radius: float) -> dict[str, float]:
    """The round's contribution norms before projection (the sound clients of every process):
    ``dp-update-norm-mean``, ``-q90`` (linear interpolation between order statistics, as
    ``torch.quantile``), ``-max`` and ``dp-projected-share`` (the share above ``radius``, i.e.
    projected); NaN without a contribution."""
    norms = norms.detach().to(torch.float64).flatten()
    if norms.numel() == 0:
        return {"dp-update-norm-mean": math.nan, "dp-update-norm-q90": math.nan, "dp-update-norm-max": math.nan,
                "dp-projected-share": math.nan}
    return {"dp-update-norm-mean": float(norms.mean()), "dp-update-norm-q90": float(torch.quantile(norms, NORM_QUANTILE)),
            "dp-update-norm-max": float(norms.max()), "dp-projected-share": float((norms > radius).double().mean())}
