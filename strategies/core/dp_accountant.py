"""The privacy accountant of a DP run: (epsilon, delta) after every round, with amplification (pure).

Every round releases one sampled Gaussian mechanism (``strategies.methods.privacy``): the round's
clients are K of the M clients, drawn uniformly WITHOUT replacement (``participants`` and
``secure_participants``: every K-subset equally likely), each client's contribution is projected
into the ball of radius S, and the server adds N(0, z^2 S^2) to their sum once.

Neighbouring relation: REPLACE-ONE at the client level -- two federations of the same M
clients that differ in all the data of one client. M is public (the server samples from it)
and the denominator K is fixed, so nothing else moves. Under replacement a client's
contribution v can become any v' in the same ball, so the sum's l2-sensitivity is
|v - v'| <= 2 S: the accounted noise multiplier is sigma / (2 S) = z / 2. This is the
relation that sampling without replacement is analysed under (Wang, Balle, Kasiviswanathan,
AISTATS 2019, Theorem 27; dp-accounting's ``SampledWithoutReplacementDpEvent`` accepts only
``REPLACE_ONE``). Full participation (K = M) claims no amplification: a plain Gaussian of the
same multiplier under the same relation, composed once a round.

The RDP computation is Google's ``dp-accounting`` (``rdp.RdpAccountant``, its default
orders), the library Flower's own ``RdpAccountant`` wraps; (z, K, M) are fixed for a run, so
epsilon after t rounds is known before the run starts and ``rounds_within`` tells the last
round a ``dp-max-epsilon`` allows.
"""

from __future__ import annotations

import math
from functools import lru_cache

#: the neighbouring relation accounted (dp-accounting's name)
RELATION = "REPLACE_ONE"
#: sigma / (the sum's l2-sensitivity) = z / SENSITIVITY_FACTOR: replacing a client moves the sum by up to 2 S
SENSITIVITY_FACTOR = 2.0


def default_delta(population: int) -> float:
    """The default delta: 1 / M^1.1 (below 1/M, so releasing one client's data whole is not "private")."""
    return float(population) ** -1.1


def _library():
    try:
        from dp_accounting import dp_event
        from dp_accounting.rdp import rdp_privacy_accountant as rdp
    except ImportError:  # pragma: no cover -- a dependency of the project
        raise ImportError("dp-noise-multiplier > 0 needs the dp-accounting package: pip install dp-accounting") from None
    return dp_event, rdp


def round_event(noise_multiplier: float, per_round: int, population: int):
    """dp-accounting's event for one round: the Gaussian of multiplier z / 2, sampled K of M
    without replacement (K < M), or unsampled (K = M)."""
    dp_event, _ = _library()
    gaussian = dp_event.GaussianDpEvent(noise_multiplier / SENSITIVITY_FACTOR)
    if per_round >= population:
        return gaussian
    return dp_event.SampledWithoutReplacementDpEvent(population, per_round, gaussian)


@lru_cache(maxsize=64)
def _one_round(noise_multiplier: float, per_round: int, population: int):
    """(orders, RDP of one round): computed once a run -- RDP composes by addition, so t rounds
    are t times it (what dp-accounting's ``compose(event, count=t)`` computes, without
    recomputing the sampled Gaussian's RDP, ~0.5 s a call, every round)."""
    _, rdp = _library()
    accountant = rdp.RdpAccountant(neighboring_relation=rdp.NeighborRel.REPLACE_ONE)
    accountant.compose(round_event(noise_multiplier, per_round, population))
    return accountant._orders, accountant._rdp  # noqa: SLF001 -- get_epsilon reads the same two


def epsilon(noise_multiplier: float, per_round: int, population: int, rounds: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds (0 rounds: 0; z = 0: inf): dp-accounting's
    ``compute_epsilon`` of the composed RDP, as its ``RdpAccountant.get_epsilon``."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    _, rdp = _library()
    orders, one = _one_round(float(noise_multiplier), int(per_round), int(population))
    return float(rdp.compute_epsilon(orders, rounds * one, delta)[0])


class Accountant:
    """Epsilon of one run's rounds: noise multiplier z, K of M clients a round, ``delta``."""

    def __init__(self, noise_multiplier: float, per_round: int, population: int, delta: float) -> None:
        if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"dp-noise-multiplier must be a finite number > 0 to account, got {noise_multiplier!r}")
        if not 1 <= per_round <= population:
            raise ValueError(f"clients a round must be in [1, num-clients={population}], got {per_round}")
        if not 0 < delta < 1:
            raise ValueError(f"dp-delta must be in (0, 1), got {delta!r}")
        self.noise_multiplier, self.per_round, self.population, self.delta = (
            float(noise_multiplier), int(per_round), int(population), float(delta))

    @property
    def amplified(self) -> bool:
        """Whether the rounds are accounted as sampled (K < M)."""
        return self.per_round < self.population

    def epsilon(self, rounds: int) -> float:
        """Epsilon at the run's delta after ``rounds`` rounds."""
        return epsilon(self.noise_multiplier, self.per_round, self.population, int(rounds), self.delta)

    def rounds_within(self, max_epsilon: float, num_rounds: int) -> int:
        """The most rounds (<= ``num_rounds``) whose epsilon stays <= ``max_epsilon`` (epsilon grows
        with the rounds: a binary search)."""
        if self.epsilon(num_rounds) <= max_epsilon:
            return num_rounds
        low, high = 0, num_rounds  # epsilon(low) <= max < epsilon(high)
        while high - low > 1:
            mid = (low + high) // 2
            if self.epsilon(mid) <= max_epsilon:
                low = mid
            else:
                high = mid
        return low

    def describe(self) -> str:
        sampling = (f"{self.per_round} of {self.population} clients a round, sampled without replacement"
                    if self.amplified else f"all {self.population} clients every round (no amplification)")
        return (f"RDP (dp-accounting), replace-one client relation, accounted multiplier z/2 = "
                f"{self.noise_multiplier / SENSITIVITY_FACTOR:g}; {sampling}; delta = {self.delta:.3g}")
