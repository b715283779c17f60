"""The CIFAR-10 task of the paper: ResNet-56 on CIFAR-10 with the standard augmentation.

Images stay ``uint8`` [N, 32, 32, 3] in memory (150 MB for the training set, moved to the
device once); every batch is normalised with the CIFAR-10 channel mean/std on the device
(``transform``), and training batches get a random 32x32 crop of the image zero-padded by
4 pixels and a horizontal flip with probability 1/2 (``augment``, drawn from a generator
seeded by (seed, round, partition id)). Reading, download and the error for missing files:
``tasks.cifar.load_cifar10`` (never random data).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from .cifar import CIFAR10_BLACK, load_cifar10, normalize, random_crop_flip
from .classification import ClassificationTask
from .resnet import cifar_resnet

#: ResNet depth of the paper (56); 20 is a quicker stand-in.
DEPTH = 56


def augment(x: Tensor, generator: torch.Generator) -> Tensor:
    """Random crop (pad 4, black like torchvision's RandomCrop on the raw image) + flip."""
    return random_crop_flip(x, generator, padding=4, flip=True, fill=CIFAR10_BLACK)


def build_model() -> torch.nn.Module:
    return cifar_resnet(DEPTH, 10)


@lru_cache(maxsize=1)
def _load(data_dir: str, download: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return load_cifar10(data_dir, download)


def cifar10_task(data_dir: str | Path, download: bool = False) -> ClassificationTask:
    """CIFAR-10 (50,000 / 10,000 images) from ``data_dir`` with ResNet-``DEPTH``."""
    train_x, train_y, test_x, test_y = _load(str(Path(data_dir).expanduser().resolve()), bool(download))
    return ClassificationTask(
        name="cifar10", train_x=train_x, train_y=train_y, test_x=test_x, test_y=test_y, num_classes=10,
        build_model=build_model, augment=augment, transform=normalize, eval_batch_size=500,
    )
