"""Client-level DP from the clipping bound (strategies.methods.privacy, strategies.core.dp_noise, dp_accountant): the noise,
the accounting against dp-accounting and Flower's accountant, projection, the budget stop, the
randomness modes, the buffer refusal, and the engine against the Flower path."""

from __future__ import annotations

import math

import pytest
import torch

from strategies.core.client_metrics import COLUMNS
from strategies.core.dp_accountant import Accountant, default_delta
from strategies.core.dp_noise import DPSettings, project, secure_normal, secure_participants, seeded_normal
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
])
def test_refused_combinations_name_the_key(values, words):
    with pytest.raises(ValueError, match="dp-") as err:
        RunConfig.from_mapping({**DP, **values})
    assert words in str(err.value)


def test_dp_keys_without_noise_are_refused():
    with pytest.raises(ValueError, match="dp-clip set without dp-noise-multiplier"):
        RunConfig.from_mapping({"dp-clip": 1.0})


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
    values = {**DP, "num-rounds": 2, "clients-per-round": 2, "dp-reproducible": True}
    flower = runs.flower("f", **values)
    engine = runs.engine("e", **values)
    runs.same(flower, engine, exact=True)
    again = runs.engine("e2", **values)
    assert all(torch.equal(again[0][k], engine[0][k]) for k in engine[0])
    head, rows = engine[1]
    assert head["privacy"]["private"] is False and "NOT private" in head["privacy"]["randomness"]
    assert [r["dp-private"] for r in rows[1:]] == [0, 0]


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
        assert ("dp-clip" in plan.grid) == (cfg.algorithm != "celgc"), name  # CELGC: no update clipping
        budgets.add((cfg.dp_noise_multiplier, cfg.per_round, cfg.num_clients, cfg.num_rounds, cfg.dp_delta))
        settings.add((cfg.per_round, cfg.num_clients, cfg.num_rounds))
    assert len(budgets) == 1 and len(settings) == 1
