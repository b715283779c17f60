"""Models of the paper's size as tasks, for measuring the message path (speed only, never results).

``task = "benchmarks.paper_size:<name>"``:

* ``resnet56`` -- ResNet-56 (3 x 9 basic blocks, option-A shortcuts, 0.85M parameters, 3.4 MB
  in float32) on CIFAR-10: the files in ``data-dir`` when present (``tasks.cifar.load_cifar10``),
  else synthetic CIFAR-shaped images and labels from a fixed seed.
* ``awd_lstm`` -- the paper's PTB AWD-LSTM (3 layers, embedding 400, hidden 1150, tied, weight
  drop 0.5; 24M parameters, 96 MB) on the Penn Treebank files in ``data-dir`` when present,
  else on a synthetic token stream over 10,000 word types (PTB's vocabulary size) from a fixed seed.
* ``mlp85`` -- a user's own task as docs/tutorials/own-task.md builds one: scikit-learn's digits
  and a 64-4096-4096-1024-10 MLP (21M parameters, 85 MB), the model of the issue that measured the
  message path first.
* ``mlp`` -- the same MLP family at any width, for cost curves against model size: hidden width
  from the environment variable ``CELGC_MLP_WIDTH`` (default 4096; every process of a run reads it).

Synthetic data trains nothing meaningful: the benchmark reads seconds, bytes and memory, and
checks that every path ends with the engine's model.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from tasks.cifar import load_cifar10, normalize
from tasks.classification import ClassificationTask
from tasks.custom import tensor_task
from tasks.digits import _load as digits_tensors
from tasks.language import DROPOUTS, EVAL_BATCH_SIZE, MODEL_SIZES, LanguageModelTask
from tasks.resnet import resnet56 as build_resnet56
from tasks.text import Corpus, Vocab, load_corpus

#: synthetic sizes: CIFAR-10's image counts; a PTB-sized vocabulary with shorter streams
CIFAR_TRAIN, CIFAR_TEST = 50_000, 10_000
PTB_VOCAB, SYNTH_TRAIN_TOKENS, SYNTH_EVAL_TOKENS = 10_000, 200_000, 2_000


def _data_dir(cfg) -> str:
    return str(Path(cfg.data_dir).expanduser().resolve())


@lru_cache(maxsize=2)
def _cifar(data_dir: str) -> tuple[torch.Tensor, ...]:
    try:
        return load_cifar10(data_dir, download=False)
    except FileNotFoundError:  # synthetic, for speed only
        g = torch.Generator().manual_seed(0)
        images = lambda n: torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)  # noqa: E731
        labels = lambda n: torch.randint(0, 10, (n,), generator=g)  # noqa: E731
        return images(CIFAR_TRAIN), labels(CIFAR_TRAIN), images(CIFAR_TEST), labels(CIFAR_TEST)


def resnet56(cfg) -> ClassificationTask:
    train_x, train_y, test_x, test_y = _cifar(_data_dir(cfg))
    return ClassificationTask(name="resnet56-cifar10", train_x=train_x, train_y=train_y, test_x=test_x,
                              test_y=test_y, num_classes=10, build_model=build_resnet56, transform=normalize,
                              eval_batch_size=500)


@lru_cache(maxsize=2)
def _ptb(data_dir: str) -> Corpus:
    try:
        return load_corpus(data_dir, "ptb")
    except FileNotFoundError:  # synthetic, for speed only
        g = torch.Generator().manual_seed(0)
        stream = lambda n: torch.randint(0, PTB_VOCAB, (n,), generator=g)  # noqa: E731
        vocab = Vocab([f"w{i}" for i in range(PTB_VOCAB - 1)] + ["<eos>"])
        return Corpus(stream(SYNTH_TRAIN_TOKENS), stream(SYNTH_EVAL_TOKENS), stream(SYNTH_EVAL_TOKENS), vocab)


def awd_lstm(cfg) -> LanguageModelTask:
    return LanguageModelTask(name="awd-lstm-ptb", corpus=_ptb(_data_dir(cfg)),
                             model_kwargs={**MODEL_SIZES["ptb"], **DROPOUTS["ptb"]}, eval_batch_size=EVAL_BATCH_SIZE)


def mlp_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width // 4), nn.ReLU(), nn.Linear(width // 4, 10))


def _mlp_task(width: int) -> ClassificationTask:
    train_x, train_y, test_x, test_y = digits_tensors()
    return tensor_task(train_x.flatten(1), train_y, test_x.flatten(1), test_y, build_model=lambda: mlp_model(width),
                       name=f"digits-mlp{width}")


def mlp85(cfg) -> ClassificationTask:
    return _mlp_task(4096)


def mlp(cfg) -> ClassificationTask:
    return _mlp_task(int(os.environ.get("CELGC_MLP_WIDTH", "4096")))
