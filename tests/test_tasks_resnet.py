"""The CIFAR ResNet (He et al. 2016, section 4.2): size, shapes, shortcut, torch.func."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

from tasks.resnet import BasicBlock, CifarResNet, ShortcutA, cifar_resnet, resnet20, resnet56


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_resnet56_parameter_count() -> None:
    n = _count(resnet56())
    assert 840_000 <= n <= 860_000
    assert n == 853_018
    assert _count(resnet20()) == 269_722


def test_depths_and_output_shape() -> None:
    torch.manual_seed(0)
    model = resnet56(num_classes=10).eval()
    assert len([m for m in model.modules() if isinstance(m, BasicBlock)]) == 27
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert cifar_resnet(32, num_classes=100)(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    for bad in (10, 55, 2):
        with pytest.raises(ValueError, match="6n\\+2"):
            CifarResNet(bad)


def test_option_a_shortcut_is_parameter_free_subsample_and_zero_pad() -> None:
    model = resnet56()
    shortcuts = [m for m in model.modules() if isinstance(m, ShortcutA)]
    assert len(shortcuts) == 2  # first block of stages 2 and 3
    for s in shortcuts:
        assert not list(s.parameters()) and not list(s.buffers())
    x = torch.randn(2, 16, 32, 32)
    y = ShortcutA(16, 32, stride=2)(x)
    assert y.shape == (2, 32, 16, 16)
    torch.testing.assert_close(y[:, 8:24], x[:, :, ::2, ::2])
    assert y[:, :8].abs().sum() == 0 and y[:, 24:].abs().sum() == 0
    # every block that changes shape uses the parameter-free shortcut
    for block in model.modules():
        if isinstance(block, BasicBlock) and block.conv1.stride != (1, 1):
            assert isinstance(block.shortcut, ShortcutA)


def test_channels_last_matches_contiguous() -> None:
    torch.manual_seed(0)
    model = resnet20().eval()
    x = torch.randn(3, 3, 32, 32)
    ref = model(x)
    model_cl = copy.deepcopy(model).to(memory_format=torch.channels_last)
    out = model_cl(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _stacked(models):
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    return base, params, buffers


def test_vmap_functional_call_matches_separate_models_eval() -> None:
    torch.manual_seed(0)
    models = [resnet56().eval() for _ in range(2)]
    # distinct, non-trivial BatchNorm statistics so eval mode really uses them
    for m in models:
        for bn in m.modules():
            if isinstance(bn, torch.nn.BatchNorm2d):
                bn.running_mean.uniform_(-0.1, 0.1)
                bn.running_var.uniform_(0.5, 1.5)
    base, params, buffers = _stacked(models)
    x = torch.randn(2, 2, 3, 32, 32)

    def run(p, b, xb):
        return functional_call(base, (p, b), (xb,))

    out = vmap(run)(params, buffers, x)
    with torch.no_grad():
        ref = torch.stack([models[i](x[i]) for i in range(2)])
    assert out.shape == (2, 2, 10)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_vmap_functional_call_train_mode_updates_stacked_bn_statistics() -> None:
    torch.manual_seed(1)
    models = [resnet20().train() for _ in range(2)]
    reference = [copy.deepcopy(m) for m in models]
    base, params, buffers = _stacked(models)
    base.train()
    x = torch.randn(2, 4, 3, 32, 32)
    out = vmap(lambda p, b, xb: functional_call(base, (p, b), (xb,)), randomness="different")(params, buffers, x)
    ref = torch.stack([reference[i](x[i]) for i in range(2)])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for i in range(2):
        torch.testing.assert_close(buffers["bn1.running_mean"][i], reference[i].bn1.running_mean)
        assert int(buffers["bn1.num_batches_tracked"][i]) == 1
