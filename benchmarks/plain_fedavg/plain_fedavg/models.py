"""The models and data of the plain app, written for it alone: the same sizes and array shapes as the
project's tasks, so plain Flower FedAvg moves the same bytes (``model`` in the run config).

* ``digits-cnn`` -- the digits CNN on scikit-learn's digits (``digits_cnn``);
* ``mlp85`` -- a 64-4096-4096-1024-10 MLP on the digits (21M parameters, 85 MB);
* ``resnet56`` -- ResNet-56 for 32x32 images (option-A shortcuts, 0.85M parameters) on synthetic images;
* ``awd-lstm`` -- the PTB AWD-LSTM's arrays (embedding 10,000 x 400 tied to the decoder, LSTMs
  400-1150-1150-400; 24M parameters, 97 MB) as plain ``nn.LSTM`` layers on a synthetic token stream.

A node's data comes from (partition id, number of partitions) alone; synthetic data trains nothing
meaningful (the benchmark reads seconds and bytes).
"""

import torch
import torch.nn.functional as F
from torch import nn

from .digits_cnn import model as digits_cnn
from .digits_cnn import partition as digits_partition


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.stride, self.pad = stride, (cout - cin) // 2

    def forward(self, x):
        y = self.b2(self.c2(F.relu(self.b1(self.c1(x)))))
        skip = x[..., ::self.stride, ::self.stride] if self.stride > 1 else x
        return F.relu(y + F.pad(skip, (0, 0, 0, 0, self.pad, self.pad)))


class ResNet56(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16)
        widths = [(16, 16, 1)] + [(16, 16, 1)] * 8 + [(16, 32, 2)] + [(32, 32, 1)] * 8 + [(32, 64, 2)] + [(64, 64, 1)] * 8
        self.blocks = nn.Sequential(*(Block(*w) for w in widths))
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(self.blocks(F.relu(self.bn(self.conv(x)))).mean((-2, -1)))


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab: int = 10_000, emb: int = 400, hidden: int = 1150) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocab, emb)
        self.rnns = nn.ModuleList([nn.LSTM(emb, hidden), nn.LSTM(hidden, hidden), nn.LSTM(hidden, emb)])
        self.decoder_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, tokens):
        x = self.encoder(tokens)
        for rnn in self.rnns:
            x, _ = rnn(x)
        return F.linear(x, self.encoder.weight, self.decoder_bias)


def build(name: str) -> nn.Module:
    models = {"digits-cnn": digits_cnn, "resnet56": ResNet56, "awd-lstm": LSTMLanguageModel,
              "mlp85": lambda: nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                                             nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))}
    if name not in models:
        raise ValueError(f"model must be one of {sorted(models)}, got {name!r}")
    return models[name]()


def batches(name: str, pid: int, num: int, steps: int, batch_size: int, seed: int):
    """``steps`` (inputs, targets) minibatches of this node for one round."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + pid)
    if name in ("digits-cnn", "mlp85"):
        x, y = digits_partition(pid, num)
        x = x if name == "digits-cnn" else x.flatten(1)
        for _ in range(steps):
            idx = torch.randint(len(x), (batch_size,), generator=gen)
            yield x[idx], y[idx]
    elif name == "resnet56":
        for _ in range(steps):
            yield torch.randn(batch_size, 3, 32, 32, generator=gen), torch.randint(10, (batch_size,), generator=gen)
    else:
        for _ in range(steps):
            tokens = torch.randint(10_000, (71, batch_size), generator=gen)
            yield tokens[:-1], tokens[1:]
