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

Two accountants (``dp-accountant``), both over Google's ``dp-accounting``; (z, K, M) are fixed
for a run, so epsilon after t rounds is known before the run starts and ``rounds_within`` tells
the last round a ``dp-max-epsilon`` allows:

``rdp`` (default)
    Renyi DP of the round's event (``rdp.RdpAccountant``, its default orders; the library
    Flower's own ``RdpAccountant`` wraps), composed by addition, converted to (epsilon, delta).
``pld``
    The privacy loss distribution, composed exactly (FFT) and read at delta: tighter than RDP
    for the same run (RDP's conversion and Theorem 27's bound both lose). dp-accounting has no
    PLD for sampling without replacement, so the round's PLD is built here from its tight
    trade-off function: a mechanism that is G_mu-DP under replace-one (mu = 2 / z, the Gaussian
    of multiplier z / 2), run on a uniform K-subset of M, is C_q(G_mu)-DP with q = K / M,
    C_q(f) = min{f_q, f_q^-1}** and f_q = q f + (1 - q) Id (Dong, Roth, Su, "Gaussian
    Differential Privacy", JRSS-B 2022, subsampling theorem; tight). Its privacy profile is,
    at every epsilon, the larger of the two hockey-stick divergences of the q-subsampled
    Gaussian: "remove" (q N(1, s^2) + (1 - q) N(0, s^2) against N(0, s^2), s = z / 2) and
    "add" (the reverse pair) -- the conjugate of the convex hull of a minimum is the maximum of
    the conjugates. Both come from dp-accounting (``GaussianPrivacyLoss``), and their maximum is
    turned into a PLD by dp-accounting's pessimistic connect-the-dots (Doroshenko, Ghazi,
    Kamath, Kumar, Manurangsi, PETS 2022), which bounds delta from above at every epsilon. The
    symmetrised pair matters: a round's worst case is a "remove" pair when the other sampled
    clients sit where the replaced client's new data would, an "add" pair in the mirror case,
    and rounds may mix the two. Composing each direction alone (what dp-accounting does for
    Poisson sampling under add-or-remove, where a pair of neighbours keeps one direction) is not
    shown to bound such a mix; C_q composed is (Dong, Roth, Su: f-DP composes adaptively), at a
    cost of about 10 % of epsilon in the runs here (tests/test_privacy.py). K = M: the unsampled Gaussian (dp-accounting's
    ``GaussianDpEvent(z)`` under ``REPLACE_ONE``, whose PLD puts the two neighbours 2 units apart).
    The discretisation is 1e-3 in epsilon (a bound from above; at 1e-4 the digits runs' epsilon
    moves in the sixth digit).
"""

from __future__ import annotations

import math
from functools import lru_cache

from .dp_noise import ACCOUNTANTS

#: the neighbouring relation accounted (dp-accounting's name)
RELATION = "REPLACE_ONE"
#: sigma / (the sum's l2-sensitivity) = z / SENSITIVITY_FACTOR: replacing a client moves the sum by up to 2 S
SENSITIVITY_FACTOR = 2.0
#: the PLD's discretisation of the privacy loss (a pessimistic rounding: epsilon is bounded from above)
PLD_DISCRETIZATION = 1e-3


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


# --- RDP --------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def _one_round(noise_multiplier: float, per_round: int, population: int):
    """(orders, RDP of one round): computed once a run -- RDP composes by addition, so t rounds
    are t times it (what dp-accounting's ``compose(event, count=t)`` computes, without
    recomputing the sampled Gaussian's RDP, ~0.5 s a call, every round)."""
    _, rdp = _library()
    accountant = rdp.RdpAccountant(neighboring_relation=rdp.NeighborRel.REPLACE_ONE)
    accountant.compose(round_event(noise_multiplier, per_round, population))
    return accountant._orders, accountant._rdp  # noqa: SLF001 -- get_epsilon reads the same two


def rdp_epsilon(noise_multiplier: float, per_round: int, population: int, rounds: int, delta: float) -> float:
    """RDP epsilon at ``delta`` after ``rounds`` rounds: dp-accounting's ``compute_epsilon`` of the
    composed RDP, as its ``RdpAccountant.get_epsilon``."""
    _, rdp = _library()
    orders, one = _one_round(float(noise_multiplier), int(per_round), int(population))
    return float(rdp.compute_epsilon(orders, rounds * one, delta)[0])


# --- PLD --------------------------------------------------------------------------------------
def sampled_gaussian_profiles(noise_multiplier: float, per_round: int, population: int):
    """dp-accounting's "remove" and "add" privacy losses of the q-subsampled Gaussian of
    multiplier z / 2 (q = K / M < 1): the two directions whose larger hockey-stick divergence
    is the round's privacy profile (module docstring)."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    sigma, q = noise_multiplier / SENSITIVITY_FACTOR, per_round / population
    return tuple(plm.GaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=kind)
                 for kind in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD))


@lru_cache(maxsize=16)
def round_pld(noise_multiplier: float, per_round: int, population: int):
    """dp-accounting's ``PrivacyLossDistribution`` of one round (module docstring): the unsampled
    Gaussian when K = M, else the pessimistic connect-the-dots PLD of max(delta_remove, delta_add)."""
    import numpy as np
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as pld

    d = PLD_DISCRETIZATION
    if per_round >= population:
        return pld.from_gaussian_mechanism(noise_multiplier / SENSITIVITY_FACTOR, value_discretization_interval=d)
    losses = sampled_gaussian_profiles(noise_multiplier, per_round, population)
    bounds = [loss.connect_dots_bounds() for loss in losses]
    low = math.floor(min(b.epsilon_lower for b in bounds) / d)
    high = math.ceil(max(b.epsilon_upper for b in bounds) / d)
    epsilons = np.arange(low, high + 1) * d
    deltas = np.maximum(*[np.asarray(loss.get_delta_for_epsilon(epsilons)) for loss in losses])
    return pld.PrivacyLossDistribution(pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(d, low, high, deltas))


@lru_cache(maxsize=256)
def pld_epsilon(noise_multiplier: float, per_round: int, population: int, rounds: int, delta: float) -> float:
    """PLD epsilon at ``delta`` after ``rounds`` rounds: the round's PLD composed ``rounds`` times (K = M:
    t Gaussians compose exactly into one of multiplier z / (2 sqrt(t)), as dp-accounting composes them)."""
    if per_round >= population:
        from dp_accounting.pld import privacy_loss_distribution as pld

        one = pld.from_gaussian_mechanism(noise_multiplier / SENSITIVITY_FACTOR / math.sqrt(rounds),
                                          value_discretization_interval=PLD_DISCRETIZATION)
        return float(one.get_epsilon_for_delta(delta))
    one = round_pld(float(noise_multiplier), int(per_round), int(population))
    return float(one.self_compose(int(rounds)).get_epsilon_for_delta(delta))


def epsilon(noise_multiplier: float, per_round: int, population: int, rounds: int, delta: float,
            accountant: str = "rdp") -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds (0 rounds: 0; z = 0: inf) by ``accountant``."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"dp-accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    compute = rdp_epsilon if accountant == "rdp" else pld_epsilon
    return compute(float(noise_multiplier), int(per_round), int(population), int(rounds), float(delta))


class Accountant:
    """Epsilon of one run's rounds: noise multiplier z, K of M clients a round, ``delta``, and the
    ``kind`` of accountant (``rdp`` or ``pld``)."""

    def __init__(self, noise_multiplier: float, per_round: int, population: int, delta: float,
                 kind: str = "rdp") -> None:
        if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"dp-noise-multiplier must be a finite number > 0 to account, got {noise_multiplier!r}")
        if not 1 <= per_round <= population:
            raise ValueError(f"clients a round must be in [1, num-clients={population}], got {per_round}")
        if not 0 < delta < 1:
            raise ValueError(f"dp-delta must be in (0, 1), got {delta!r}")
        if kind not in ACCOUNTANTS:
            raise ValueError(f"dp-accountant must be one of {', '.join(ACCOUNTANTS)}, got {kind!r}")
        self.noise_multiplier, self.per_round, self.population, self.delta = (
            float(noise_multiplier), int(per_round), int(population), float(delta))
        self.kind = kind

    @property
    def amplified(self) -> bool:
        """Whether the rounds are accounted as sampled (K < M)."""
        return self.per_round < self.population

    def epsilon(self, rounds: int) -> float:
        """Epsilon at the run's delta after ``rounds`` rounds."""
        return epsilon(self.noise_multiplier, self.per_round, self.population, int(rounds), self.delta, self.kind)

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
        how = ("RDP (dp-accounting)" if self.kind == "rdp" else
               "PLD (dp-accounting's PLD of the tight subsampled trade-off C_q(G_mu), connect-the-dots)"
               if self.amplified else "PLD (dp-accounting)")
        return (f"{how}, replace-one client relation, accounted multiplier z/2 = "
                f"{self.noise_multiplier / SENSITIVITY_FACTOR:g}; {sampling}; delta = {self.delta:.3g}")
