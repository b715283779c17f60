"""Word-level language modelling (Penn Treebank, WikiText-2) with AWD-LSTM, for federated runs.

The task object the ClientApp, the ServerApp and the engine use (``load_task`` for
``task = "ptb"`` / ``"wikitext2"``). Reading, batching and the model live in
``tasks.text`` and ``tasks.awd_lstm``; this module decides what a client does in a round.

Partitions (one token stream per client, from (seed, num-clients, partitioner) alone):
``homogeneous`` deals blocks of ``BLOCK_LEN`` tokens round-robin (``text_shards``);
``similarity`` with s = 0 gives each client one contiguous region of the corpus
(``text_regions``, the heterogeneous split), s = 100 is homogeneous, and in between a
seeded s% of the blocks is dealt round-robin and the rest cut into N regions.

A client's round (clients keep no state between rounds, so everything is a pure function
of (seed, partition id, round) and the round's shape):

* the client's stream is laid out as ``batch-size`` contiguous rows (``batchify``), T
  positions each; round r starts at position ``(r - 1) * I * bptt mod (T - 1)``, so rounds
  walk through the rows at the nominal pace of ``bptt`` tokens a step and one pass over a
  client's rows takes ``T / (I bptt)`` rounds;
* inside the round, I windows follow back to back with the AWD-LSTM length jitter (bptt
  w.p. 0.95 else bptt/2, then N(base, 5), at least 5); the draws depend on (seed, round,
  step) only, so all clients use the same lengths in a step, like data-parallel workers
  sharing one seed (and naive parallel clipping over N clients equals one machine at
  batch N b). Each step's lr and clip are scaled by ``seq_len / bptt`` (``lr_scale``);
* the hidden state starts at zero at the start of every round (clients are stateless)
  and whenever the walk wraps around the end of the rows, and is carried from window to
  window within the round, detached (truncated BPTT);
* dropout masks come from a generator seeded by (seed, partition id, round, step);
* the loss is the mean cross-entropy plus AR (alpha = 2) and TAR (beta = 1); the reported
  ``train-loss`` therefore includes the two regularisers.

One training "example" is one sequence of ``bptt`` tokens: ``train_size = tokens // bptt``,
so the global epoch r N I b / train_size counts passes over the training tokens as in the
paper; ``num-examples`` of a step is its number of rows b. Evaluation: perplexity =
exp(mean cross-entropy per token) on the validation and test streams, in windows of
``bptt`` with batch ``EVAL_BATCH_SIZE`` and the hidden state carried through.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .awd_lstm import AWDLSTM, ar_tar_loss, detach_hidden
from .text import Corpus, batchify, load_corpus, sample_seq_len, text_regions, text_shards

if TYPE_CHECKING:
    from tasks.config import RunConfig

#: Model sizes by task (the paper: 3 layers, embedding 400, hidden 1150, tied weights).
#: Tests monkeypatch these to tiny values.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "ptb": {"emb_size": 400, "hidden_size": 1150, "num_layers": 3},
    "wikitext2": {"emb_size": 400, "hidden_size": 1150, "num_layers": 3},
}
#: Dropouts of the paper's AWD-LSTM runs: input 0.4, hidden 0.25 (PTB) / 0.2 (WT2),
#: output 0.4, embedding 0.1, weight drop (DropConnect) 0.5.
DROPOUTS: dict[str, dict[str, float]] = {
    "ptb": {"dropout_i": 0.4, "dropout_h": 0.25, "dropout": 0.4, "dropout_e": 0.1, "weight_drop": 0.5},
    "wikitext2": {"dropout_i": 0.4, "dropout_h": 0.2, "dropout": 0.4, "dropout_e": 0.1, "weight_drop": 0.5},
}
BPTT = 70
AR_ALPHA = 2.0
TAR_BETA = 1.0
EVAL_BATCH_SIZE = 10
BLOCK_LEN = 2048  # tokens per block of the homogeneous split


class LMBatch(NamedTuple):
    """One truncated-BPTT window: inputs/targets [L, B] and how to step on them."""

    x: Tensor
    y: Tensor
    lr_scale: float  # seq_len / bptt: multiplies this step's lr and clip
    reset: bool  # start from a zero hidden state
    dropout_seed: int
    carry: dict  # shared by the round's windows: the detached hidden state


def split_stream(stream: Tensor, num_clients: int, partitioner: str, similarity: float = 0.0, seed: int = 0,
                 block_len: int = BLOCK_LEN) -> list[Tensor]:
    """The clients' token streams (equal lengths); see the module docstring."""
    if partitioner == "homogeneous" or (partitioner == "similarity" and similarity >= 100):
        return text_shards(stream, num_clients, block_len)
    if partitioner != "similarity":
        raise ValueError(f"partitioner {partitioner!r} is not defined for text: use homogeneous, or similarity "
                         "(similarity = 0: each client one contiguous region of the corpus)")
    if similarity <= 0:
        return text_regions(stream, num_clients)
    num_blocks = stream.numel() // block_len
    pooled = round(num_blocks * similarity / 100)
    if pooled < num_clients or num_blocks - pooled < num_clients:
        raise ValueError(f"similarity={similarity:g} on {num_blocks} blocks of {block_len} tokens leaves fewer than "
                         f"num-clients={num_clients} blocks on one side: use 0, 100 or a value in between")
    blocks = stream[: num_blocks * block_len].view(num_blocks, block_len)
    pool = np.sort(np.random.default_rng([seed, num_clients]).choice(num_blocks, pooled, replace=False))
    rest = np.setdiff1d(np.arange(num_blocks), pool)
    shared = text_shards(blocks[torch.from_numpy(pool)].reshape(-1), num_clients, block_len)
    own = text_regions(blocks[torch.from_numpy(rest)].reshape(-1), num_clients)
    return [torch.cat([a, b]) for a, b in zip(shared, own, strict=True)]


def _seed(*entropy: int) -> int:
    return int(np.random.SeedSequence(list(entropy)).generate_state(1, dtype=np.uint64)[0] >> 1)


def round_windows(total_len: int, *, seed: int, server_round: int, local_steps: int,
                  bptt: int = BPTT) -> list[tuple[int, int, float, bool]]:
    """``(start, seq_len, lr_scale, reset)`` of a round's windows over rows of ``total_len``."""
    if total_len < 2:
        raise ValueError(f"a client's rows need at least 2 positions, got {total_len}")
    if server_round < 1 or local_steps < 1:
        raise ValueError(f"server-round and local-steps must be >= 1, got {server_round}, {local_steps}")
    positions = total_len - 1  # inputs that have a next-token target
    gen = torch.Generator().manual_seed(_seed(seed, server_round, 0x62707474))  # "bptt"
    i = ((server_round - 1) * local_steps * bptt) % positions
    out, reset = [], True
    for _ in range(local_steps):
        seq_len, scale = sample_seq_len(gen, bptt)
        if i >= positions:
            i, reset = 0, True
        n = min(seq_len, positions - i)
        out.append((i, n, scale, reset))
        i, reset = i + n, False
    return out


@dataclass
class LanguageModelTask:
    """A corpus, the AWD-LSTM builder and a client's rounds (see the module docstring)."""

    name: str
    corpus: Corpus
    model_kwargs: dict[str, Any]
    bptt: int = BPTT
    alpha: float = AR_ALPHA
    beta: float = TAR_BETA
    eval_batch_size: int = EVAL_BATCH_SIZE
    _device_cache: dict = field(default_factory=dict, repr=False)

    @property
    def train_size(self) -> int:
        """Training sequences of ``bptt`` tokens: global epochs count training tokens."""
        return max(1, self.corpus.train.numel() // self.bptt)

    @property
    def vocab_size(self) -> int:
        return len(self.corpus.vocab)

    def build_model(self) -> AWDLSTM:
        return AWDLSTM(self.vocab_size, **self.model_kwargs)

    def client_partitions(self, cfg: RunConfig) -> list[Tensor]:
        return split_stream(self.corpus.train, cfg.num_clients, cfg.partitioner, cfg.similarity, cfg.seed)

    # --- training -------------------------------------------------------------------
    def round_batches(
        self, partition: Tensor, *, seed: int, partition_id: int, server_round: int,
        local_steps: int, batch_size: int, device: torch.device,
    ) -> Iterator[LMBatch]:
        """The round's windows of client ``partition_id`` (its token stream), on ``device``."""
        key = ("train", partition.data_ptr(), partition.numel(), batch_size, str(device))
        if key not in self._device_cache:  # the client's rows move to the device once, not every round
            self._device_cache[key] = batchify(partition, batch_size).to(device)
        rows = self._device_cache[key]
        windows = round_windows(rows.shape[0], seed=seed, server_round=server_round,
                                local_steps=local_steps, bptt=self.bptt)
        carry: dict = {"hidden": None}
        for step, (i, n, scale, reset) in enumerate(windows):
            chunk = rows[i : i + n + 1]
            yield LMBatch(chunk[:-1], chunk[1:], scale, reset,
                          _seed(seed, partition_id, server_round, step, 0x64726F70), carry)  # "drop"

    def loss(self, model: nn.Module, batch: LMBatch) -> Tensor:
        """Cross-entropy + AR + TAR of one window; carries the detached hidden state."""
        hidden = None if batch.reset else batch.carry["hidden"]
        dev = batch.x.device
        with torch.random.fork_rng(devices=[dev] if dev.type != "cpu" else [], device_type=dev.type):
            torch.manual_seed(batch.dropout_seed)
            output, new_hidden, raw, dropped = model(batch.x, hidden)
        batch.carry["hidden"] = detach_hidden(new_hidden)
        ce = F.cross_entropy(output.reshape(-1, output.shape[-1]), batch.y.reshape(-1))
        return ce + ar_tar_loss(raw, dropped, self.alpha, self.beta)

    @staticmethod
    def count_examples(batch: LMBatch) -> int:
        """Rows (sequences) in a window: the ``num-examples`` of a step."""
        return int(batch.x.shape[1])

    # --- evaluation -----------------------------------------------------------------
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Loss and perplexity on the validation and test streams."""
        return {**self._evaluate(model, device, self.corpus.valid, "valid"),
                **self._evaluate(model, device, self.corpus.test, "test")}

    def evaluate_indices(self, model: nn.Module, device: torch.device, stream: Tensor) -> dict[str, float]:
        """Loss and perplexity on a client's own training stream."""
        return self._evaluate(model, device, stream, "eval")

    @torch.no_grad()
    def _evaluate(self, model: nn.Module, device: torch.device, stream: Tensor, prefix: str) -> dict[str, float]:
        model.eval()
        rows = self._eval_rows(stream, device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        hidden, tokens = None, 0
        for i in range(0, rows.shape[0] - 1, self.bptt):
            n = min(self.bptt, rows.shape[0] - 1 - i)
            output, hidden, _, _ = model(rows[i : i + n], hidden)
            target = rows[i + 1 : i + 1 + n]
            loss_sum += F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1),
                                        reduction="sum").double()
            tokens += target.numel()
        loss = float(loss_sum) / tokens
        return {f"{prefix}-loss": loss, f"{prefix}-perplexity": math.exp(min(loss, 700.0))}

    def _eval_rows(self, stream: Tensor, device: torch.device) -> Tensor:
        b = max(1, min(self.eval_batch_size, stream.numel() // 2))
        key = (stream.data_ptr(), stream.numel(), b, str(device))
        if key not in self._device_cache:
            self._device_cache[key] = batchify(stream, b).to(device)
        return self._device_cache[key]


@lru_cache(maxsize=2)
def _corpus(name: str, data_dir: str) -> Corpus:
    return load_corpus(data_dir, name)


def language_task(name: str, data_dir: str | Path) -> LanguageModelTask:
    """The PTB or WikiText-2 task from ``data_dir``; a missing corpus is a FileNotFoundError
    that names the expected files (corpora are never downloaded)."""
    if name not in MODEL_SIZES:
        raise ValueError(f"unknown language task {name!r}; known: {', '.join(MODEL_SIZES)}")
    corpus = _corpus(name, str(Path(data_dir).expanduser().resolve()))
    return LanguageModelTask(name=name, corpus=corpus, model_kwargs={**MODEL_SIZES[name], **DROPOUTS[name]},
                             bptt=BPTT, eval_batch_size=EVAL_BATCH_SIZE)
