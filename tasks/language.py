"""Word-level language modelling (Penn Treebank, WikiText-2) with AWD-LSTM, for federated runs.

The task object the ClientApp, the ServerApp and the engine use (``load_task`` for
``task = "ptb"`` / ``"wikitext2"``). Reading, batching and the model live in
``tasks.text`` and ``tasks.awd_lstm``; this module decides what a client does in a round.

Partitions (one token stream per client, from (seed, num-clients, partitioner) alone):
``homogeneous`` deals blocks of ``BLOCK_LEN`` tokens round-robin (``text_shards``,
``text-split = "blocks"``) or, with ``text-split = "contiguous"`` (the authors' split), cuts
the corpus into N contiguous regions and has client k read region (k + e) mod N in its
pass e (``rotated_regions``); ``similarity`` with s = 0 gives each client one contiguous
region for the whole run (``text_regions``, the heterogeneous split), s = 100 is
homogeneous, and in between a seeded s% of the blocks is dealt round-robin and the rest cut
into N regions.

A client's round. Its (current region of the) stream is laid out as ``batch-size``
contiguous rows (``batchify``), T positions each, and I windows follow back to back with
the AWD-LSTM length jitter (bptt w.p. 0.95 else bptt/2, then N(base, 5), at least 5); all
clients draw the same lengths in a step, like data-parallel workers sharing one seed (so
naive parallel clipping over N clients equals one machine at batch N b). Each step's lr and
clip are scaled by ``seq_len / bptt`` (``lr_scale``); the hidden state is carried from
window to window, detached (truncated BPTT), and starts at zero whenever the walk wraps
around the end of the rows (a new pass: the next region). The loss is the mean cross-entropy
plus AR (alpha = 2) and TAR (beta = 1): ``train-loss`` includes them, ``train-ce`` is the
cross-entropy alone (what the authors report).

* ``client-state = "keep"`` (the authors' protocol: a worker's hidden state runs through the
  epoch, across averagings): the client keeps its place (``position``, ``pass``) and its
  hidden state from round to round (``state=``, see ``tasks.protocol``); lengths and
  dropout masks are drawn per global step (r - 1) I + s, so R rounds of I steps are exactly
  one round of R I steps when averaging is the identity (N = 1). A client that lost its
  state (restarted) starts at the beginning of its rows with a zero hidden state.
* ``client-state = "reset"`` (stateless clients): round r starts at the nominal position
  ``(r - 1) I bptt mod (T - 1)`` with a zero hidden state; lengths depend on (seed, round,
  step), dropout masks on (seed, partition id, round, step).

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
    carry: dict  # shared by the round's windows (the client's state when it keeps one): hidden.<k>.h/c


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


def rotated_regions(stream: Tensor, num_clients: int) -> list[Tensor]:
    """The authors' homogeneous split: N contiguous regions, client k reading region
    (k + e) mod N in its pass e. Client k's part is the N regions in that order, concatenated
    (the task walks one region a pass: ``LanguageModelTask.regions``)."""
    regions = text_regions(stream, num_clients)
    return [torch.cat([regions[(k + e) % num_clients] for e in range(num_clients)]) for k in range(num_clients)]


def _seed(*entropy: int) -> int:
    return int(np.random.SeedSequence(list(entropy)).generate_state(1, dtype=np.uint64)[0] >> 1)


def _round_lengths(seed: int, server_round: int, local_steps: int, bptt: int,
                   by_step: bool) -> list[tuple[int, float]]:
    """(seq_len, lr_scale) of a round's steps. ``by_step``: one draw per global step (r - 1) I + s,
    so R rounds of I steps draw what one round of R I steps draws (clients that keep state);
    else one generator per round (stateless rounds)."""
    if not by_step:
        gen = torch.Generator().manual_seed(_seed(seed, server_round, 0x62707474))  # "bptt"
        return [sample_seq_len(gen, bptt) for _ in range(local_steps)]
    first = (server_round - 1) * local_steps
    return [sample_seq_len(torch.Generator().manual_seed(_seed(seed, first + s, 0x62707474, 1)), bptt)
            for s in range(local_steps)]


def walk(positions: int, start: int, first_pass: int, lengths: list[tuple[int, float]],
         reset_first: bool) -> list[tuple[int, int, int, float, bool]]:
    """``(pass, start, seq_len, lr_scale, reset)`` of windows laid back to back from ``start``;
    at the end of the rows the walk wraps to 0 with a fresh hidden state and the next pass."""
    out, i, p, reset = [], start, first_pass, reset_first
    for seq_len, scale in lengths:
        if i >= positions:
            i, p, reset = 0, p + 1, True
        n = min(seq_len, positions - i)
        out.append((p, i, n, scale, reset))
        i, reset = i + n, False
    return out


def round_windows(total_len: int, *, seed: int, server_round: int, local_steps: int,
                  bptt: int = BPTT) -> list[tuple[int, int, float, bool]]:
    """``(start, seq_len, lr_scale, reset)`` of a stateless round's windows over rows of ``total_len``."""
    if total_len < 2:
        raise ValueError(f"a client's rows need at least 2 positions, got {total_len}")
    if server_round < 1 or local_steps < 1:
        raise ValueError(f"server-round and local-steps must be >= 1, got {server_round}, {local_steps}")
    positions = total_len - 1  # inputs that have a next-token target
    i = ((server_round - 1) * local_steps * bptt) % positions
    lengths = _round_lengths(seed, server_round, local_steps, bptt, by_step=False)
    return [(i, n, scale, reset) for _, i, n, scale, reset in walk(positions, i, 0, lengths, True)]


def hidden_state(state: dict[str, Tensor]) -> list[tuple[Tensor, Tensor]] | None:
    """The hidden state kept in a client state (None: start from zero)."""
    if "hidden.0.h" not in state:
        return None
    layers = sum(1 for k in state if k.startswith("hidden.") and k.endswith(".h"))
    return [(state[f"hidden.{k}.h"], state[f"hidden.{k}.c"]) for k in range(layers)]


def keep_hidden(state: dict[str, Tensor], hidden: list[tuple[Tensor, Tensor]] | None) -> None:
    """Store ``hidden`` (detached) in ``state``; None clears it."""
    for k in [k for k in state if k.startswith("hidden.")]:
        del state[k]
    for k, (h, c) in enumerate(detach_hidden(hidden) if hidden is not None else []):
        state[f"hidden.{k}.h"], state[f"hidden.{k}.c"] = h, c


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
    regions: int = 1  # > 1: text-split contiguous, a client's part is its regions in rotation order
    stateful = True  # clients may carry (hidden state, position, pass) across rounds
    counts_rows = True  # count_examples: a window's rows, batch-size of them (the server checks num-examples)
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
        if self.regions > 1:
            if self.regions != cfg.num_clients:
                raise ValueError(f"the task was built for {self.regions} regions, the run has num-clients={cfg.num_clients}")
            return rotated_regions(self.corpus.train, cfg.num_clients)
        return split_stream(self.corpus.train, cfg.num_clients, cfg.partitioner, cfg.similarity, cfg.seed)

    # --- training -------------------------------------------------------------------
    def _rows(self, partition: Tensor, batch_size: int, device: torch.device) -> Tensor:
        """[regions, T, b]: each region of the client's stream in ``batch_size`` rows."""
        key = ("train", partition.data_ptr(), partition.numel(), batch_size, str(device))
        if key not in self._device_cache:  # the client's rows move to the device once, not every round
            regions = partition[: partition.numel() // self.regions * self.regions].view(self.regions, -1)
            self._device_cache[key] = torch.stack([batchify(r, batch_size) for r in regions]).to(device)
        return self._device_cache[key]

    def round_batches(
        self, partition: Tensor, *, seed: int, partition_id: int, server_round: int,
        local_steps: int, batch_size: int, device: torch.device, state: dict[str, Tensor] | None = None,
    ) -> Iterator[LMBatch]:
        """The round's windows of client ``partition_id`` (its token stream), on ``device``.

        ``state`` (a client that keeps state; empty: a fresh one) holds ``position`` and
        ``pass`` in its rows and the hidden state, and is updated window by window; None: the
        stateless round (nominal position, zero hidden state at the round's start)."""
        rows = self._rows(partition, batch_size, device)
        positions = rows.shape[1] - 1
        if positions < 1:
            raise ValueError(f"a client's rows need at least 2 positions, got {rows.shape[1]}")
        if server_round < 1 or local_steps < 1:
            raise ValueError(f"server-round and local-steps must be >= 1, got {server_round}, {local_steps}")
        lengths = _round_lengths(seed, server_round, local_steps, self.bptt, by_step=state is not None)
        if state is None:
            nominal = (server_round - 1) * local_steps * self.bptt
            windows = walk(positions, nominal % positions, nominal // positions, lengths, True)
            carry: dict = {}
        else:
            windows = walk(positions, int(state.get("position", 0)), int(state.get("pass", 0)), lengths, False)
            carry = state
        first = (server_round - 1) * local_steps
        for step, (p, i, n, scale, reset) in enumerate(windows):
            chunk = rows[p % self.regions, i : i + n + 1]
            if state is not None:
                state["position"] = torch.tensor(i + n, dtype=torch.int64)
                state["pass"] = torch.tensor(p, dtype=torch.int64)
                drop = _seed(seed, partition_id, first + step, 0x64726F70, 1)  # by global step
            else:
                drop = _seed(seed, partition_id, server_round, step, 0x64726F70)  # "drop"
            yield LMBatch(chunk[:-1], chunk[1:], scale, reset, drop, carry)

    def loss_terms(self, model: nn.Module, batch: LMBatch) -> tuple[Tensor, Tensor]:
        """(cross-entropy + AR + TAR, cross-entropy) of one window; keeps the detached hidden state."""
        hidden = None if batch.reset else hidden_state(batch.carry)
        dev = batch.x.device
        with torch.random.fork_rng(devices=[dev] if dev.type != "cpu" else [], device_type=dev.type):
            torch.manual_seed(batch.dropout_seed)
            output, new_hidden, raw, dropped = model(batch.x, hidden)
        keep_hidden(batch.carry, new_hidden)
        ce = F.cross_entropy(output.reshape(-1, output.shape[-1]), batch.y.reshape(-1))
        return ce + ar_tar_loss(raw, dropped, self.alpha, self.beta), ce

    def loss(self, model: nn.Module, batch: LMBatch) -> Tensor:
        """Cross-entropy + AR + TAR of one window (the training loss)."""
        return self.loss_terms(model, batch)[0]

    @property
    def max_lr_scale(self) -> float:
        """The largest ``lr_scale`` an honest client uses, for the server's reply filter:
        seq_len = base + 5 z with z ~ N(0, 1) (``sample_seq_len``); a 20-sigma draw (probability
        below 1e-88 a step) bounds it: (bptt + 100) / bptt."""
        return (self.bptt + 20 * 5.0) / self.bptt

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

    def evaluate_train(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Loss (cross-entropy) and perplexity of the whole training stream (``eval-train``)."""
        return self._evaluate(model, device, self.corpus.train, "train-eval")

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


def language_task(name: str, data_dir: str | Path, regions: int = 1) -> LanguageModelTask:
    """The PTB or WikiText-2 task from ``data_dir``; a missing corpus is a FileNotFoundError
    that names the expected files (corpora are never downloaded). ``regions`` > 1: the
    authors' homogeneous split (``rotated_regions``) over that many clients."""
    if name not in MODEL_SIZES:
        raise ValueError(f"unknown language task {name!r}; known: {', '.join(MODEL_SIZES)}")
    corpus = _corpus(name, str(Path(data_dir).expanduser().resolve()))
    return LanguageModelTask(name=name, corpus=corpus, model_kwargs={**MODEL_SIZES[name], **DROPOUTS[name]},
                             bptt=BPTT, eval_batch_size=EVAL_BATCH_SIZE, regions=regions)
