"""Client-level DP from the clipping bound (strategies.methods.privacy, strategies.core.dp_noise, dp_accountant): the noise,
the accounting (RDP and PLD) against dp-accounting and Flower's accountant, projection, the update norms in the rows,
the budget stop, the randomness modes, the buffer refusal, and the engine against the Flower path."""

from __future__ import annotations

import math

import pytest
import torch

from strategies.core.client_metrics import COLUMNS
from strategies.core.dp_accountant import PLD_DISCRETIZATION, Accountant, default_delta, round_pld
from strategies.core.dp_noise import DPSettings, norm_statistics, project, secure_normal, secure_participants, seeded_normal
from strategies.core.settings import Hyper
from strategies.methods import CELGC, LocalSGD
from strategies.methods.privacy import Privacy
from strategies.methods.reduce import ClientResults
from tasks.config import RunConfig

DP = {"dp-noise-multiplier": 1.0}


# --- the accountant -----------------------------------------------------------------------
def _dp_accounting_epsilon(z: float, k: int, m: int, rounds: int, delta: float) -> float:
    """dp-accounting's own computation: the round's event composed ``rounds`` times."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    acc = rdp.RdpAccountant(neighboring_relation=rdp.NeighborRel.REPLACE_ONE)
    gaussian = dp_event.GaussianDpEvent(z / 2)  # replace-one: the sum's sensitivity is 2 S
    event = gaussian if k == m else dp_event.SampledWithoutReplacementDpEvent(m, k, gaussian)
    acc.compose(event, rounds)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("z, k, m, rounds", [(1.0, 10, 200, 50), (2.0, 8, 8, 20), (1.3, 1, 500, 7)])
def test_epsilon_equals_dp_accountings_own_computation(z, k, m, rounds):
    delta = default_delta(m)
    ours = Accountant(z, k, m, delta)
    assert ours.amplified == (k < m)
    assert ours.epsilon(rounds) == pytest.approx(_dp_accounting_epsilon(z, k, m, rounds, delta), abs=1e-6)


def test_epsilon_equals_flowers_rdp_accountant_without_replacement():
    from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod

    z, k, m, rounds = 1.1, 12, 300, 30
    delta = 1e-5
    flower = RdpAccountant(PrivacyConfig(delta, m, NeighboringRelation.REPLACE_ONE, SamplingMethod.WITHOUT_REPLACEMENT))
    flower.compose(GaussianPrivacyEvent(z / 2, k, m), count=rounds)
    assert Accountant(z, k, m, delta).epsilon(rounds) == pytest.approx(flower.get_epsilon(delta), abs=1e-6)


def test_amplification_and_rounds_within_the_budget():
    full, sampled = Accountant(1.0, 100, 100, 1e-5), Accountant(1.0, 10, 100, 1e-5)
    assert sampled.epsilon(10) < full.epsilon(10)
    assert all(sampled.epsilon(t) < sampled.epsilon(t + 1) for t in range(1, 6))
    budget = sampled.epsilon(7) + 1e-9
    assert sampled.rounds_within(budget, 50) == 7
    assert sampled.rounds_within(1e9, 50) == 50
    assert sampled.rounds_within(sampled.epsilon(1) / 2, 50) == 0


def _dp_accounting_pld(event, rel: str, rounds: int, delta: float) -> float:
    """dp-accounting's own PLD accountant on ``event`` composed ``rounds`` times (our discretisation)."""
    from dp_accounting.pld import pld_privacy_accountant as pld

    acc = pld.PLDAccountant(getattr(pld.NeighborRel, rel), value_discretization_interval=PLD_DISCRETIZATION)
    acc.compose(event, rounds)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("z, m, rounds", [(1.0, 8, 20), (2.0, 4, 3), (0.7, 100, 40)])
def test_pld_without_sampling_is_dp_accountings_replace_one_gaussian(z, m, rounds):
    """K = M: the round is dp-accounting's GaussianDpEvent(z) under REPLACE_ONE (its PLD puts the neighbours
    2 S apart, our sensitivity), and RDP's event is the Gaussian of multiplier z / 2: the same mechanism."""
    from dp_accounting import dp_event

    delta = default_delta(m)
    ours = Accountant(z, m, m, delta, "pld").epsilon(rounds)
    assert ours == pytest.approx(_dp_accounting_pld(dp_event.GaussianDpEvent(z), "REPLACE_ONE", rounds, delta), abs=1e-9)
    assert ours == pytest.approx(_dp_accounting_pld(dp_event.GaussianDpEvent(z / 2), "ADD_OR_REMOVE_ONE", rounds, delta),
                                 abs=1e-9)
    assert ours < Accountant(z, m, m, delta, "rdp").epsilon(rounds)


@pytest.mark.parametrize("z, k, m", [(1.0, 20, 200), (2.0, 20, 200), (1.0, 64, 718), (1.3, 1, 500)])
def test_pld_of_one_sampled_round_is_the_worse_direction_of_dp_accountings_subsampled_gaussian(z, k, m):
    """One round: the symmetrised profile's epsilon is the larger of dp-accounting's two directions of the
    q-subsampled Gaussian (its PoissonSampledDpEvent under ADD_OR_REMOVE_ONE reports that maximum)."""
    from dp_accounting import dp_event

    delta = default_delta(m)
    ours = Accountant(z, k, m, delta, "pld").epsilon(1)
    event = dp_event.PoissonSampledDpEvent(k / m, dp_event.GaussianDpEvent(z / 2))
    assert ours == pytest.approx(_dp_accounting_pld(event, "ADD_OR_REMOVE_ONE", 1, delta), abs=2 * PLD_DISCRETIZATION)


def test_one_sampled_rounds_pld_bounds_both_directions_computed_by_hand():
    """delta(eps) of the round's PLD >= the hockey-stick divergence of both directions of the subsampled Gaussian,
    integrated numerically here (remove: q N(1, s^2) + (1-q) N(0, s^2) against N(0, s^2); add: the reverse), and
    within the discretisation of the larger."""
    import numpy as np
    from scipy.stats import norm as gauss

    z, k, m = 1.0, 20, 200
    s, q = z / 2, k / m
    x = np.linspace(-12, 13, 400_001)
    upper = q * gauss.pdf(x, 1, s) + (1 - q) * gauss.pdf(x, 0, s)
    lower = gauss.pdf(x, 0, s)
    one = round_pld(z, k, m)
    for eps in (-1.0, 0.0, 0.5, 1.0, 2.0):
        remove = np.trapezoid(np.maximum(upper - np.exp(eps) * lower, 0), x)
        add = np.trapezoid(np.maximum(lower - np.exp(eps) * upper, 0), x)
        ours = float(one.get_delta_for_epsilon(eps))
        assert ours >= max(remove, add) - 1e-9, eps
        assert ours == pytest.approx(max(remove, add), rel=2e-3, abs=1e-6), eps


@pytest.mark.parametrize("z, k, m, rounds", [(1.0, 20, 200, 40), (2.0, 20, 200, 40), (1.0, 64, 718, 100)])
def test_pld_is_below_rdp_and_covers_rounds_of_either_direction(z, k, m, rounds):
    """The same run: PLD < RDP (dp-accounting's answer for the event, as accounted today); and PLD >= every
    composition of the rounds' two directions (dp-accounting's remove and add PLDs of the subsampled Gaussian,
    mixed in any proportion, the all-remove one included)."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    delta = default_delta(m)
    ours = Accountant(z, k, m, delta, "pld").epsilon(rounds)
    assert ours < Accountant(z, k, m, delta, "rdp").epsilon(rounds) == pytest.approx(
        _dp_accounting_epsilon(z, k, m, rounds, delta), abs=1e-6)
    both = pld.from_gaussian_mechanism(z / 2, sampling_prob=k / m, value_discretization_interval=PLD_DISCRETIZATION)
    remove, add = (pld.PrivacyLossDistribution(p) for p in (both._pmf_remove, both._pmf_add))  # noqa: SLF001
    for removes in (0, rounds // 3, rounds):
        parts = [d.self_compose(n) for d, n in ((remove, removes), (add, rounds - removes)) if n]
        mixed = parts[0] if len(parts) == 1 else parts[0].compose(parts[1])
        assert ours >= mixed.get_epsilon_for_delta(delta) - 1e-9, removes


@pytest.mark.parametrize("z, k, m, rounds", [(2.0, 72, 718, 50), (2.0, 20, 200, 40)])
def test_prv_accountant_agrees_with_dp_accountings_composition_and_ours_is_above(z, k, m, rounds):
    """An independent composition (Microsoft's prv-accountant, as pfl-research uses; Gopi, Lee, Wutschitz 2021) of the
    q-subsampled Gaussian's "remove" direction brackets dp-accounting's; ours (both directions, symmetrised) is above."""
    prv = pytest.importorskip("prv_accountant")
    from dp_accounting.pld import privacy_loss_distribution as pld
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    delta = default_delta(m)
    acc = prv.PRVAccountant(prvs=[PoissonSubsampledGaussianMechanism(k / m, z / 2)], max_self_compositions=[rounds],
                            eps_error=0.1, delta_error=delta / 100)
    low, _, high = acc.compute_epsilon(delta=delta, num_self_compositions=[rounds])
    both = pld.from_gaussian_mechanism(z / 2, sampling_prob=k / m, value_discretization_interval=PLD_DISCRETIZATION)
    remove = pld.PrivacyLossDistribution(both._pmf_remove).self_compose(rounds)  # noqa: SLF001
    assert low <= remove.get_epsilon_for_delta(delta) <= high
    assert Accountant(z, k, m, delta, "pld").epsilon(rounds) > high


def test_pld_accountant_budget_and_description():
    acc = Accountant(1.0, 20, 200, default_delta(200), "pld")
    assert all(acc.epsilon(t) < acc.epsilon(t + 1) for t in (1, 5, 20))
    assert acc.rounds_within(acc.epsilon(13) + 1e-9, 40) == 13
    assert acc.describe().startswith("PLD") and "20 of 200" in acc.describe()
    with pytest.raises(ValueError, match="dp-accountant must be one of rdp, pld, got 'prv'"):
        Accountant(1.0, 20, 200, 1e-3, "prv")


# --- randomness ------------------------------------------------------------------------------
def test_secure_and_seeded_noise_are_standard_normal():
    for sample in (secure_normal(200_001), seeded_normal(200_001, 3, 1)):
        assert sample.dtype == torch.float64 and sample.shape == (200_001,)
        assert abs(float(sample.mean())) < 0.015 and float(sample.std()) == pytest.approx(1.0, abs=0.01)
    assert torch.equal(seeded_normal(50, 3, 1), seeded_normal(50, 3, 1))
    assert not torch.equal(seeded_normal(50, 3, 1), seeded_normal(50, 3, 2))
    assert not torch.equal(secure_normal(50), secure_normal(50))


def test_secure_sample_is_uniform_without_replacement():
    counts = torch.zeros(10)
    draws = 3000
    for _ in range(draws):
        chosen = secure_participants(10, 3)
        assert chosen == sorted(set(chosen)) and len(chosen) == 3
        counts[chosen] += 1
    expected = draws * 3 / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30  # 9 degrees of freedom: p < 1e-3 above ~27.9


def test_project_scales_only_rows_outside_the_ball():
    rows = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], dtype=torch.float64)
    out, outside = project(rows, 1.0)
    assert outside.tolist() == [True, False, False]
    assert torch.allclose(out[0], torch.tensor([0.6, 0.8], dtype=torch.float64))
    assert torch.equal(out[1:], rows[1:])


# --- the mechanism inside a round ----------------------------------------------------------------
def _round(method, z, clients, *, dp_clip=0.0, reproducible=True, per_round=None, size=20_000, seed=0):
    """A method's round over ``clients`` replies (states) from a global model of one vector."""
    hyper = Hyper(local_steps=4, lr=0.1, clip=0.25 if method is CELGC else math.inf)
    algorithm = method(hyper, population=8)
    state = {"w": torch.linspace(-1, 1, size)}
    algorithm.privacy = Privacy(DPSettings(noise_multiplier=z, clip=dp_clip, reproducible=reproducible),
                                population=8, per_round=per_round or len(clients), seed=seed, state=state,
                                trainable=["w"])
    rnd = algorithm.begin(1, state, list(range(len(clients))), trainable=["w"])
    gen = algorithm.server(rnd)
    next(gen)
    results = ClientResults(list(range(len(clients))), {"arrays": [{"w": state["w"] + d} for d in clients]},
                            torch.full((len(clients), len(COLUMNS)), math.nan, dtype=torch.float64),
                            torch.ones(len(clients), dtype=torch.float64))
    try:
        gen.send(results)
    except StopIteration as stop:
        return state, stop.value
    raise AssertionError("the round did not end")


@pytest.mark.parametrize("reproducible", [True, False])
def test_noise_std_is_z_s_over_the_fixed_denominator(reproducible):
    """Clients that do not move: the released model's deviation is the noise alone, std z S / K."""
    z, k = 1.5, 4
    state, report = _round(CELGC, z, [torch.zeros(20_000)] * (k - 1), reproducible=reproducible, per_round=k)
    s = 4 * 0.25  # I gamma
    assert report.metrics["dp-sensitivity"] == pytest.approx(s) and report.metrics["dp-noise-std"] == pytest.approx(z * s)
    assert report.metrics["replies"] == k - 1  # one client failed: the denominator stays K
    deviation = (report.state["w"].double() - state["w"].double())
    assert float(deviation.std()) == pytest.approx(z * s / k, rel=0.05)
    assert abs(float(deviation.mean())) < 5 * z * s / k / math.sqrt(20_000)
    assert report.metrics["dp-private"] == int(not reproducible)


@pytest.mark.parametrize("method, dp_clip", [(CELGC, 0.0), (LocalSGD, 0.5)])
def test_a_client_sending_100_s_moves_the_model_no_more_than_an_honest_one(method, dp_clip):
    s = dp_clip or 4 * 0.25
    direction = torch.randn(20_000, generator=torch.Generator().manual_seed(1))
    direction /= direction.norm()
    honest = [torch.zeros(20_000), s * direction]
    attack = [torch.zeros(20_000), 100 * s * direction]
    _, fair = _round(method, 1.0, honest, dp_clip=dp_clip, seed=5)
    _, lied = _round(method, 1.0, attack, dp_clip=dp_clip, seed=5)
    assert lied.metrics["dp-projected"] == 1  # (the honest one lands on S up to float rounding: projected or not)
    assert torch.allclose(lied.state["w"], fair.state["w"], atol=1e-6)


def test_norm_statistics_by_hand():
    stats = norm_statistics(torch.tensor([0.5, 1.0, 2.0, 4.0]), 1.0)
    assert stats == {"dp-update-norm-mean": 1.875, "dp-update-norm-q90": pytest.approx(3.4),  # 2 + 0.7 (4 - 2)
                     "dp-update-norm-max": 4.0, "dp-projected-share": 0.5}
    assert all(math.isnan(v) for v in norm_statistics(torch.zeros(0), 1.0).values())


@pytest.mark.parametrize("method, dp_clip", [(CELGC, 0.0), (CELGC, 0.4), (LocalSGD, 0.5)])
def test_rows_carry_the_update_norms_before_projection(method, dp_clip):
    """Clients that moved 0.1, 0.3 and 3 S (and one non-finite reply, left out): the rows give their norms
    before projection, the share projected, and the sensitivity is dp-clip where set (CELGC too)."""
    s = dp_clip or 4 * 0.25
    direction = torch.randn(20_000, generator=torch.Generator().manual_seed(2))
    direction /= direction.norm()
    broken = torch.full((20_000,), math.nan)
    _, report = _round(method, 1.0, [0.1 * s * direction, 0.3 * s * direction, 3 * s * direction, broken],
                       dp_clip=dp_clip, per_round=4)
    r = report.metrics
    assert r["dp-sensitivity"] == pytest.approx(s) and r["dp-projected"] == 1 and r["replies"] == 3
    assert r["dp-update-norm-max"] == pytest.approx(3 * s) and r["dp-update-norm-mean"] == pytest.approx(3.4 * s / 3)
    assert r["dp-update-norm-q90"] == pytest.approx(0.3 * s + 0.8 * 2.7 * s)
    assert r["dp-projected-share"] == pytest.approx(1 / 3)


# --- configuration and refusals ------------------------------------------------------------------
@pytest.mark.parametrize("values, words", [
    ({"algorithm": "local-sgd", "clip": "off"}, "needs dp-clip > 0"),
    ({"algorithm": "local-sgd"}, "needs dp-clip > 0"),  # its own default: clip off
    ({"algorithm": "naive", "local-steps": 1}, "needs dp-clip > 0"),
    ({"momentum": 0.9}, "needs dp-clip > 0"),
    ({"algorithm": "episode"}, "not supported for algorithm 'episode'"),
    ({"algorithm": "scaffold"}, "not supported for algorithm 'scaffold'"),
    ({"algorithm": "single", "num-clients": 1}, "needs clients"),
    ({"aggregation": "examples"}, "aggregation=\"uniform\""),
    ({"dp-buffers": "keep"}, "dp-buffers must be one of refuse, frozen"),
    ({"dp-delta": 1.5}, "dp-delta must be in [0, 1)"),
    ({"dp-accountant": "prv"}, "dp-accountant must be one of rdp, pld, got 'prv'"),
])
def test_refused_combinations_name_the_key(values, words):
    with pytest.raises(ValueError, match="dp-") as err:
        RunConfig.from_mapping({**DP, **values})
    assert words in str(err.value)


def test_dp_keys_without_noise_are_refused():
    with pytest.raises(ValueError, match="dp-clip set without dp-noise-multiplier"):
        RunConfig.from_mapping({"dp-clip": 1.0})
    with pytest.raises(ValueError, match="dp-accountant set without dp-noise-multiplier"):
        RunConfig.from_mapping({"dp-accountant": "pld"})


def test_a_batchnorm_model_is_refused_naming_the_fix(runs):
    with pytest.raises(ValueError, match="dp-buffers=\"frozen\"") as err:
        runs.engine("bn", **DP, **{"num-rounds": 1})
    assert "running_mean" in str(err.value) and "GroupNorm" in str(err.value)


def test_frozen_buffers_stay_at_their_initial_values(runs):
    from tasks import cached_task, initial_model

    state, (head, rows) = runs.engine("frozen", **DP, **{"num-rounds": 2, "dp-buffers": "frozen"})
    cfg = RunConfig.from_mapping(runs.values("frozen"))
    initial = initial_model(cached_task(cfg), cfg.seed).state_dict()
    buffers = [k for k in initial if "running" in k or "num_batches" in k]
    assert buffers and all(torch.equal(state[k], initial[k]) for k in buffers)
    assert not torch.equal(state["head.1.weight"], initial["head.1.weight"])
    assert head["privacy"]["buffers"] == "frozen"


def test_the_groupnorm_digits_task_runs_private_without_frozen_buffers(runs):
    """tasks.digits:digits_groupnorm_task: the digits CNN with GroupNorm, no buffers, so a DP run needs no
    dp-buffers = "frozen" and every released tensor is noised; clients of one image (batch 1) train."""
    from tasks.digits import DigitsCNN, DigitsGroupNormCNN

    model = DigitsGroupNormCNN()
    assert not list(model.buffers())
    assert [p.shape for p in model.parameters()] == [p.shape for p in DigitsCNN().parameters()]
    _, (head, rows) = runs.engine("gn", **DP, **{"task": "tasks.digits:digits_groupnorm_task", "num-clients": 16,
                                                 "clients-per-round": 4, "batch-size": 1, "valid-fraction": 0.1,
                                                 "num-rounds": 2, "dp-accountant": "pld"})
    assert head["privacy"]["buffers"] == "refuse" and rows[-1]["dp-epsilon"] > 0 and "test-accuracy" in rows[-1]


# --- whole runs: both backends ------------------------------------------------------------------
TINY = {"lr": 1e-6, "clip": 0.3, "local-steps": 2, "num-rounds": 1, "eval-every": 1}


def _deviation(runs, state, name):
    from tasks import cached_task, initial_model

    cfg = RunConfig.from_mapping(runs.values(name))
    initial = initial_model(cached_task(cfg), cfg.seed).state_dict()
    return torch.cat([(state[k].double() - initial[k].double()).flatten() for k in initial])


def test_engine_and_flower_give_the_same_epsilon_and_noise_std(runs, mlp_digits):
    """Default (secure) noise, lr so small the clients barely move: the released model's deviation
    has std z S / K on both backends, and both report the same epsilon."""
    values = {**DP, **TINY, "dp-noise-multiplier": 2.0}
    stds, rows_of = {}, {}
    for backend in ("engine", "flower"):
        state, (head, rows) = getattr(runs, backend)(backend, **values)
        stds[backend] = float(_deviation(runs, state, backend).std())
        rows_of[backend] = rows[-1]
        assert head["privacy"]["private"] is True and rows[-1]["dp-private"] == 1
    s, k = 2 * 0.3, 4
    for backend, std in stds.items():
        assert std == pytest.approx(2.0 * s / k, rel=0.1), backend
    e, f = rows_of["engine"], rows_of["flower"]
    assert e["dp-epsilon"] == f["dp-epsilon"] == pytest.approx(Accountant(2.0, 4, 4, default_delta(4)).epsilon(1))
    assert e["dp-noise-std"] == f["dp-noise-std"] == pytest.approx(2.0 * s)


def test_reproducible_mode_is_the_same_on_both_backends_and_not_private(runs, mlp_digits):
    """Rows, update norms and the PLD epsilon included: the same on the Flower path and the engine."""
    values = {**DP, "num-rounds": 2, "clients-per-round": 2, "dp-reproducible": True, "dp-accountant": "pld"}
    flower = runs.flower("f", **values)
    engine = runs.engine("e", **values)
    runs.same(flower, engine, exact=True)
    again = runs.engine("e2", **values)
    assert all(torch.equal(again[0][k], engine[0][k]) for k in engine[0])
    head, rows = engine[1]
    assert head["privacy"]["private"] is False and "NOT private" in head["privacy"]["randomness"]
    assert [r["dp-private"] for r in rows[1:]] == [0, 0]
    assert head["privacy"]["accountant"] == "pld" and head["privacy"]["accounting"].startswith("PLD")
    pld = Accountant(1.0, 2, 4, default_delta(4), "pld")
    assert [r["dp-epsilon"] for r in rows[1:]] == [pld.epsilon(1), pld.epsilon(2)]
    for row in rows[1:]:
        assert 0 < row["dp-update-norm-mean"] <= row["dp-update-norm-q90"] <= row["dp-update-norm-max"]
        assert row["dp-update-norm-max"] <= row["dp-sensitivity"] * (1 + 1e-6)  # CELGC's bound holds
        assert row["dp-projected-share"] == row["dp-projected"] / row["replies"]


def test_pld_gives_a_smaller_epsilon_than_rdp_for_the_same_run(runs, mlp_digits):
    values = {**DP, "num-rounds": 3, "clients-per-round": 2, "num-clients": 8}
    eps = {}
    for kind in ("rdp", "pld"):
        _, (head, rows) = runs.engine(kind, **values, **{"dp-accountant": kind})
        eps[kind] = [r["dp-epsilon"] for r in rows[1:]]
        assert eps[kind] == [Accountant(1.0, 2, 8, default_delta(8), kind).epsilon(t) for t in (1, 2, 3)]
    assert all(p < r for p, r in zip(eps["pld"], eps["rdp"], strict=True))


def test_default_mode_two_runs_differ(runs, mlp_digits):
    one = runs.engine("one", **DP, **{"num-rounds": 1})
    two = runs.engine("two", **DP, **{"num-rounds": 1})
    assert any(not torch.equal(one[0][k], two[0][k]) for k in one[0])


@pytest.mark.parametrize("backend", ["engine", "flower"])
def test_the_run_stops_before_exceeding_max_epsilon(runs, mlp_digits, backend):
    budget = Accountant(1.0, 4, 4, default_delta(4)).epsilon(2) + 1e-6
    state, (head, rows) = getattr(runs, backend)(backend, **DP, **{"num-rounds": 5, "dp-max-epsilon": budget,
                                                                   "checkpoint-every": 4})
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[-1]["dp-epsilon"] <= budget
    assert "stopped after round 2 of 5" in rows[-1]["stopped"] and "dp-max-epsilon" in rows[-1]["stopped"]
    assert "test-accuracy" in rows[-1]
    assert (runs.tmp_path / backend / "checkpoint.pt").exists() and (runs.tmp_path / backend / "model.pt").exists()


def test_naive_with_dp_clip_runs_on_the_engine(runs, mlp_digits):
    _, (head, rows) = runs.engine("naive", **DP, **{"algorithm": "naive", "local-steps": 1, "dp-clip": 0.5,
                                                    "num-rounds": 2})
    assert rows[-1]["dp-sensitivity"] == 0.5 and rows[-1]["dp-noise-std"] == 0.5
    assert head["privacy"]["dp-clip"] == 0.5


@pytest.mark.parametrize("folder, private, plain", [
    ("dp-shakespeare", {"celgc-I8", "local-sgd-I8", "naive"}, set()),
    ("dp-digits", {"celgc-I4", "local-sgd-I4", "naive"}, {"nodp-celgc-I4", "nodp-local-sgd-I4", "nodp-naive"}),
    ("dp-digits-eps8", {"celgc-I4", "local-sgd-I4"}, {"nodp-celgc-I4", "nodp-local-sgd-I4"}),
])
def test_the_dp_comparison_gives_every_method_the_same_epsilon(folder, private, plain):
    """docs/EXPERIMENTS.md's DP utility comparisons: equal (z, K, M, rounds, delta) -> equal epsilon; the no-DP
    references of a folder run the same clients and rounds without noise."""
    from pathlib import Path

    from simulations.runner import load_plan

    path = Path(__file__).resolve().parents[1] / "simulations" / "experiments" / folder
    plans = {p.stem: load_plan(p, results_dir="unused") for p in sorted(path.glob("*.toml"))}
    assert set(plans) == private | plain
    budgets, settings = set(), set()
    for name in plain:
        cfg = RunConfig.from_mapping(plans[name].base)
        assert not cfg.dp.enabled and len(plans[name].seeds) >= 3 and cfg.valid_fraction > 0, name
        settings.add((cfg.per_round, cfg.num_clients, cfg.num_rounds))
    for name in private:
        plan = plans[name]
        cfg = RunConfig.from_mapping(plan.base)
        assert cfg.dp.enabled and not cfg.dp.reproducible and len(plan.seeds) >= 3 and cfg.valid_fraction > 0, name
        # every other DP method tunes its update clip; CELGC runs without one (S = I gamma, its own bound), or tunes
        # it with that point in the grid (dp-digits, issue 40)
        clips = plan.grid.get("dp-clip")
        assert (clips is None or 0.0 in clips) if cfg.algorithm == "celgc" else (clips and 0.0 not in clips), name
        budgets.add((cfg.dp_noise_multiplier, cfg.per_round, cfg.num_clients, cfg.num_rounds, cfg.dp_delta))
        settings.add((cfg.per_round, cfg.num_clients, cfg.num_rounds))
    assert len(budgets) == 1 and len(settings) == 1
    if folder == "dp-digits-eps8":  # issue 40, item 4: epsilon <= 8 by both accountants at delta <= 1/M
        z, k, m, rounds, delta = budgets.pop()
        delta = delta or default_delta(m)
        assert delta <= 1 / m and all(Accountant(z, k, m, delta, kind).epsilon(rounds) <= 8 for kind in ("rdp", "pld"))
