"""EPISODE's pure parts against values written from the paper's Algorithm 1."""

from __future__ import annotations

import math

import pytest
import torch

from strategies.core.clipped_sgd import StepConfig, clipped_sgd_step
from strategies.core.episode_corrections import clipping_round, corrections, episode_step


def test_corrections_are_the_average_minus_each_clients_gradient():
    g1 = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}
    g2 = {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([-1.0])}
    mean, corr, norm = corrections([g1, g2])
    assert torch.equal(mean["w"], torch.tensor([2.0, 1.0])) and torch.equal(mean["b"], torch.tensor([1.0]))
    assert torch.equal(corr[0]["w"], torch.tensor([1.0, -1.0])) and torch.equal(corr[1]["b"], torch.tensor([2.0]))
    assert norm == pytest.approx(math.sqrt(4 + 1 + 1))
    mean_w, _, _ = corrections([g1, g2], weights=[3, 1])
    assert torch.allclose(mean_w["w"], torch.tensor([1.5, 1.5]))
    with pytest.raises(ValueError, match="different parameters"):
        corrections([g1, {"w": g2["w"]}])
    with pytest.raises(ValueError, match="at least one"):
        corrections([])


def test_the_round_clips_iff_the_resampled_norm_reaches_clip_over_lr():
    cfg = StepConfig(lr=0.1, clip=0.5)  # threshold 5
    assert not clipping_round(4.9999, cfg) and clipping_round(5.0, cfg)  # >= as the authors' episode_final
    assert not clipping_round(1e9, StepConfig(lr=0.1))  # clip off: never


def test_step_is_sgd_on_the_corrected_direction_or_normalised():
    x = [torch.tensor([1.0, -2.0])]
    g = [torch.tensor([3.0, 4.0])]
    c = [torch.tensor([1.0, -1.0])]
    cfg = StepConfig(lr=0.1, clip=0.2, weight_decay=0.5)
    d = g[0] + 0.5 * x[0] + c[0]  # (4.5, 2.0)
    plain, _, stats = episode_step(x, g, c, None, cfg, clip_round=False)
    assert torch.allclose(plain[0], x[0] - 0.1 * d) and stats["clipped"] == 0
    clipped, _, stats = episode_step(x, g, c, None, cfg, clip_round=True)
    assert torch.allclose(clipped[0], x[0] - 0.2 * d / d.norm()) and stats["clipped"] == 1
    assert (clipped[0] - x[0]).norm().item() == pytest.approx(0.2)  # a clipping step moves exactly gamma
    assert stats["grad-norm"].item() == pytest.approx(5.0)  # the raw gradient's norm is reported


def test_without_correction_and_clipping_it_is_the_sgd_step():
    gen = torch.Generator().manual_seed(0)
    x = [torch.randn(3, 4, generator=gen), torch.randn(4, generator=gen)]
    g = [torch.randn(3, 4, generator=gen), torch.randn(4, generator=gen)]
    bufs = [torch.randn(3, 4, generator=gen), torch.randn(4, generator=gen)]
    cfg = StepConfig(lr=0.05, weight_decay=1e-3, momentum=0.9)
    zero = [torch.zeros_like(t) for t in x]
    ours, our_bufs, _ = episode_step(x, g, zero, bufs, cfg, clip_round=False)
    ref, ref_bufs, _ = clipped_sgd_step(x, g, bufs, cfg)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(ours + our_bufs, ref + ref_bufs, strict=True))


def test_a_non_finite_direction_skips_the_step():
    x, c = [torch.ones(2)], [torch.zeros(2)]
    new, _, stats = episode_step(x, [torch.tensor([math.nan, 1.0])], c, None, StepConfig(lr=0.1, clip=1.0), True)
    assert torch.equal(new[0], x[0]) and stats["skipped"] == 1 and stats["clipped"] == 0


# --- partial participation (strategies.core.client_sampling) ----------------------------------
def test_participants_are_seeded_uniform_and_distinct():
    from strategies.core.client_sampling import participants

    assert participants(0, 1, 8) == list(range(8)) == participants(0, 1, 8, 8)
    picks = [participants(3, r, 10, 3) for r in range(1, 2001)]
    assert picks[:5] == [participants(3, r, 10, 3) for r in range(1, 6)]  # a pure function
    assert all(len(set(p)) == 3 and p == sorted(p) for p in picks)
    counts = torch.bincount(torch.tensor([i for p in picks for i in p]), minlength=10).double()
    assert counts.sum() == 6000 and (counts - 600).abs().max() < 4 * math.sqrt(600 * 0.7)  # uniform (binomial sd)
    assert participants(4, 1, 10, 3) != participants(3, 1, 10, 3) or participants(4, 2, 10, 3) != participants(3, 2, 10, 3)
    with pytest.raises(ValueError, match=r"clients-per-round must be in \[1, num-clients=10\]"):
        participants(0, 1, 10, 11)
