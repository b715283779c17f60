"""The local update against PyTorch references (SGD, clip_grad_norm_)."""

import math

import pytest
import torch
from torch import nn

from strategies.core.clipped_sgd import StepConfig, clipped_sgd_step
from strategies.core.local_update import local_update


def make_model(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def make_batches(steps=6, batch=4, seed=1, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(batch, 5, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(steps)]


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def reference_run(model, batches, opt, clip_norm=None):
    for batch in batches:
        opt.zero_grad()
        loss_fn(model, batch).backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip_norm)
        opt.step()


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.0, 0.01), (0.9, 5e-3)])
def test_no_clipping_equals_torch_sgd(momentum, weight_decay):
    batches = make_batches()
    ours, ref = make_model(), make_model()
    local_update(ours, batches, loss_fn, StepConfig(lr=0.1, clip=math.inf, weight_decay=weight_decay, momentum=momentum))
    reference_run(ref, batches, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay))
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("clip", [0.01, 0.05, 0.3, 100.0])
def test_clipping_equals_clip_grad_norm_then_sgd(clip):
    lr = 0.2
    batches = make_batches(scale=3.0)
    ours, ref = make_model(), make_model()
    metrics = local_update(ours, batches, loss_fn, StepConfig(lr=lr, clip=clip))
    reference_run(ref, batches, torch.optim.SGD(ref.parameters(), lr=lr), clip_norm=clip / lr)
    for a, b in zip(ours.parameters(), ref.parameters()):
        # clip_grad_norm_ divides by (norm + 1e-6): a relative difference of ~1e-6
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if clip <= 0.05:
        assert metrics["clip-fraction"] == 1.0
    if clip == 100.0:
        assert metrics["clip-fraction"] == 0.0


def test_each_step_moves_at_most_clip():
    clip, lr = 0.05, 10.0
    model = make_model()
    for batch in make_batches(steps=5, scale=5.0):
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        local_update(model, [batch], loss_fn, StepConfig(lr=lr, clip=clip))
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        assert (after - before).norm() <= clip * (1 + 1e-5)


def test_non_finite_gradient_step_is_skipped_and_counted():
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    bad = (torch.full((4, 5), float("nan")), torch.zeros(4, dtype=torch.long))
    metrics = local_update(model, [bad], loss_fn, StepConfig(lr=0.1, clip=1.0, momentum=0.9))
    for a, b in zip(model.parameters(), before):
        assert torch.equal(a, b)
    assert metrics["skipped-steps"] == 1 and metrics["num-steps"] == 1


def test_skipped_step_leaves_momentum_buffer_unchanged():
    params = [torch.ones(3)]
    bufs = [torch.full((3,), 2.0)]
    new_p, new_b, stats = clipped_sgd_step(params, [torch.tensor([1.0, float("inf"), 0.0])], bufs,
                                           StepConfig(lr=0.1, clip=1.0, momentum=0.5))
    assert torch.equal(new_p[0], params[0]) and torch.equal(new_b[0], bufs[0])
    assert stats["skipped"].item() == 1.0


def test_hand_computed_step():
    # g = (3, 4): |g| = 5; clip / |g| = 0.2 < lr = 1 -> step 0.2 * (g + 0.5 x)
    x = [torch.tensor([1.0, -1.0])]
    new, _, stats = clipped_sgd_step(x, [torch.tensor([3.0, 4.0])], None, StepConfig(lr=1.0, clip=1.0, weight_decay=0.5))
    torch.testing.assert_close(new[0], torch.tensor([1.0 - 0.2 * 3.5, -1.0 - 0.2 * 3.5]))
    assert stats["clipped"].item() == 1.0 and stats["grad-norm"].item() == pytest.approx(5.0)


def test_metrics_report_loss_norm_examples_steps():
    batches = make_batches(steps=3, batch=4)
    metrics = local_update(make_model(), batches, loss_fn, StepConfig(lr=0.01, clip=math.inf))
    assert metrics["num-steps"] == 3 and metrics["num-examples"] == 12
    assert metrics["clip-fraction"] == 0.0 and metrics["skipped-steps"] == 0
    assert metrics["grad-norm"] > 0 and metrics["train-loss"] > 0


@pytest.mark.parametrize("kwargs,match", [
    ({"lr": 0.0}, "lr must be"), ({"lr": -1.0}, "lr must be"), ({"lr": 1.0, "clip": 0.0}, "clip must be"),
    ({"lr": 1.0, "clip": -1.0}, "clip must be"), ({"lr": 1.0, "weight_decay": -1.0}, "weight-decay"),
    ({"lr": 1.0, "momentum": 1.0}, "momentum"), ({"lr": float("nan")}, "lr must be"),
])
def test_step_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepConfig(**kwargs)


@pytest.mark.parametrize("clip,wd,mu,bad", [(0.05, 0.0, 0.0, False), (math.inf, 1e-2, 0.9, False), (0.1, 1e-3, 0.5, True)])
def test_cpu_fast_path_equals_the_vmappable_path(monkeypatch, clip, wd, mu, bad):
    import strategies.core.clipped_sgd as cs

    g = torch.Generator().manual_seed(0)
    params = [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)]
    grads = [torch.randn(4, 3, generator=g), torch.randn(3, generator=g)]
    if bad:
        grads[1][0] = float("nan")
    bufs = [torch.randn_like(p) for p in params] if mu else None
    cfg = StepConfig(lr=0.5, clip=clip, weight_decay=wd, momentum=mu)
    assert cs._plain_cpu(params, grads, 1.0)
    fast = clipped_sgd_step(params, grads, bufs, cfg, lr_scale=0.7)
    monkeypatch.setattr(cs, "_plain_cpu", lambda *a: False)
    slow = clipped_sgd_step(params, grads, bufs, cfg, lr_scale=0.7)
    for a, b in zip([*fast[0], *(fast[1] or [])], [*slow[0], *(slow[1] or [])]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for key in ("clipped", "skipped"):
        assert fast[2][key].item() == slow[2][key].item()
    if not bad:
        torch.testing.assert_close(fast[2]["grad-norm"], slow[2]["grad-norm"])
