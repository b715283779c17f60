"""The CIFAR ResNet of He et al. (2016), section 4.2 ("Deep Residual Learning").

A 3x3 convolution with 16 filters, then three stages of ``n`` basic blocks each (two 3x3
convolutions per block) on feature maps of 32x32, 16x16 and 8x8 with 16, 32 and 64 filters,
then global average pooling and a fully connected layer: ``6n + 2`` weighted layers. The
first block of stages 2 and 3 halves the resolution with a stride-2 convolution; its
shortcut is option A of the paper: the input subsampled by 2 in space and zero-padded in
channels, with no parameters. Depth 56 (n = 9) has 853,018 parameters for 10 classes.

Built to run under ``torch.func.functional_call`` and ``torch.func.vmap``: no in-place
operations, no ``.item()``, no Python branching on tensor values; the option-A shortcut is
slicing plus ``torch.nn.functional.pad``. Inputs may be contiguous or channels_last (move
the model with ``model.to(memory_format=torch.channels_last)`` to keep it so throughout).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BasicBlock", "CifarResNet", "ShortcutA", "cifar_resnet", "resnet20", "resnet56"]


class ShortcutA(nn.Module):
    """Option-A shortcut: take every second pixel and zero-pad channels (no parameters).

    ``in_planes -> out_planes`` channels, the new channels split evenly before and after
    the existing ones (``out_planes - in_planes`` must be even).
    """

    def __init__(self, in_planes: int, out_planes: int, stride: int) -> None:
        super().__init__()
        if out_planes < in_planes or (out_planes - in_planes) % 2:
            raise ValueError(f"option-A shortcut needs an even channel increase, got {in_planes}->{out_planes}")
        self.stride = stride
        self.pad = (out_planes - in_planes) // 2

    def forward(self, x: Tensor) -> Tensor:
        if self.stride != 1:
            x = x[..., :: self.stride, :: self.stride]
        if self.pad:
            # pad order is last dim first: (W, W, H, H, C, C)
            x = F.pad(x, (0, 0, 0, 0, self.pad, self.pad))
        return x


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, plus the shortcut, then ReLU."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        if stride != 1 or in_planes != planes:
            self.shortcut: nn.Module = ShortcutA(in_planes, planes, stride)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 images: 16/32/64 channels, option-A shortcuts, BatchNorm."""

    def __init__(self, depth: int = 56, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 with n >= 1 (20, 32, 44, 56, 110, ...), got {depth}")
        n = (depth - 2) // 6
        self.depth = depth
        self.conv1 = nn.Conv2d(in_channels, 16, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = self._stage(16, 16, n, stride=1)
        self.layer2 = self._stage(16, 32, n, stride=2)
        self.layer3 = self._stage(32, 64, n, stride=2)
        self.fc = nn.Linear(64, num_classes)
        self.reset_parameters()

    @staticmethod
    def _stage(in_planes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [BasicBlock(in_planes, planes, stride)]
        layers += [BasicBlock(planes, planes, 1) for _ in range(blocks - 1)]
        return nn.Sequential(*layers)

    def reset_parameters(self) -> None:
        """He (kaiming) normal init for convolutions and the classifier; BN to (1, 0)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = out.mean(dim=(-2, -1))  # global average pooling
        return self.fc(out)


def cifar_resnet(depth: int, num_classes: int = 10) -> CifarResNet:
    """ResNet-``depth`` (``depth = 6n + 2``) for CIFAR."""
    return CifarResNet(depth, num_classes)


def resnet20(num_classes: int = 10) -> CifarResNet:
    """ResNet-20 (0.27M parameters): a small stand-in for quick runs."""
    return CifarResNet(20, num_classes)


def resnet56(num_classes: int = 10) -> CifarResNet:
    """ResNet-56 (0.85M parameters), the CIFAR-10 model of Liu et al. (2022)."""
    return CifarResNet(56, num_classes)
