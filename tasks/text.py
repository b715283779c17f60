"""Word-level language-modelling corpora (Penn Treebank, WikiText-2) and their batching.

Reading. Each split file is read as UTF-8; every line (blank lines included) becomes its
whitespace-separated words followed by ``<eos>``, and the lines are concatenated into one
token stream, as in the AWD-LSTM setup of Merity et al. (2018). The vocabulary is built
from the training split only, ids in order of first appearance; words of the validation or
test split that are not in it become ``<unk>`` (both corpora already contain ``<unk>``;
without it an unknown word is an error). Expected files, in ``data_dir`` or in the
sub-folder the official archives unpack to (``ptb/`` or ``penn/``; ``wikitext-2/``):

* ``ptb``: ``ptb.train.txt``, ``ptb.valid.txt``, ``ptb.test.txt`` (10,000 word types);
* ``wikitext2``: ``wiki.train.tokens``, ``wiki.valid.tokens``, ``wiki.test.tokens``
  (33,278 word types).

Batching. ``batchify`` lays a stream out as [T, B]: B contiguous rows of the stream side by
side, so that consecutive windows ``get_batch(source, i, seq_len)`` continue each row's text
and the hidden state can be carried over. ``sample_seq_len`` / ``bptt_lengths`` /
``bptt_windows`` draw the AWD-LSTM variable truncation length: base ``bptt`` with
probability 0.95 else ``bptt / 2``, then ``seq_len = max(5, int(N(base, 5)))``, with the
learning rate scaled by ``seq_len / bptt`` for that step. All draws come from an explicit
``torch.Generator``.

Federated partitions (one token stream per client, all of equal length):

``text_shards`` (homogeneous)
    The corpus is cut into consecutive blocks of about ``block_len`` tokens which are dealt
    round-robin: block k goes to client ``k mod N``. Every client thus holds a 1/N share of
    every part of the corpus (all articles/sections, in the original order), so the clients'
    token distributions agree up to block-level noise. Block boundaries are the only place
    a client's stream jumps; with blocks of thousands of tokens this is as rare as an
    article boundary.
``text_regions`` (heterogeneous)
    Client i gets the i-th contiguous 1/N of the corpus. Both corpora are ordered by source
    document (PTB: Wall Street Journal articles in file order; WikiText-2: Wikipedia
    articles), so each client sees different articles and topics: a natural, label-free
    non-i.i.d. split.

Cutting the stream into N contiguous equal pieces is thus the *heterogeneous* split here,
not the homogeneous one. ``partition_text`` selects either by name.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "CORPORA",
    "EOS",
    "UNK",
    "Corpus",
    "Vocab",
    "batchify",
    "bptt_lengths",
    "bptt_windows",
    "corpus_files",
    "get_batch",
    "load_corpus",
    "partition_text",
    "sample_seq_len",
    "text_regions",
    "text_shards",
    "tokenize_file",
]

EOS = "<eos>"
UNK = "<unk>"

#: corpus name -> (split file names train/valid/test, sub-folders tried after data_dir)
CORPORA: dict[str, tuple[tuple[str, str, str], tuple[str, ...]]] = {
    "ptb": (("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"), ("ptb", "penn")),
    "wikitext2": (("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"), ("wikitext-2",)),
}


# --------------------------------------------------------------------------- reading
@dataclass
class Vocab:
    """Word <-> id maps; ids follow first appearance in the training split."""

    itos: list[str]

    def __post_init__(self) -> None:
        self.stoi = {w: i for i, w in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ValueError("vocabulary words must be unique")

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, word: object) -> bool:
        return word in self.stoi

    @property
    def eos(self) -> int:
        return self.stoi[EOS]

    @property
    def unk(self) -> int | None:
        return self.stoi.get(UNK)

    def encode(self, words: Sequence[str], where: str = "text") -> Tensor:
        """Ids of ``words`` (int64); unknown words map to ``<unk>``, or raise without it."""
        unk = self.unk
        get = self.stoi.get
        ids = [get(w, unk) for w in words]
        if unk is None and None in ids:
            bad = sorted({w for w in words if w not in self.stoi})
            raise ValueError(
                f"{where}: {len(bad)} word type(s) not in the training vocabulary and no "
                f"{UNK} token to map them to, e.g. {bad[:5]}"
            )
        return torch.tensor(ids, dtype=torch.int64)

    def decode(self, ids: Tensor | Sequence[int]) -> list[str]:
        return [self.itos[int(i)] for i in ids]


class Corpus(NamedTuple):
    """Token-id streams (int64, 1-D) of the three splits, and the vocabulary."""

    train: Tensor
    valid: Tensor
    test: Tensor
    vocab: Vocab


def tokenize_file(path: str | Path) -> list[str]:
    """All words of a file, each line followed by ``<eos>`` (blank lines give ``<eos>``)."""
    words: list[str] = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            words.extend(line.split())
            words.append(EOS)
    return words


def corpus_files(data_dir: str | Path, name: str) -> tuple[Path, Path, Path]:
    """The train/valid/test files of corpus ``name`` under ``data_dir``.

    Looks in ``data_dir`` itself, then in the corpus's usual sub-folders; raises
    ``FileNotFoundError`` listing the exact paths expected.
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; known: {', '.join(CORPORA)}")
    files, subdirs = CORPORA[name]
    data_dir = Path(data_dir)
    candidates = [data_dir] + [data_dir / s for s in subdirs]
    for folder in candidates:
        paths = tuple(folder / f for f in files)
        if all(p.is_file() for p in paths):
            return paths  # type: ignore[return-value]
    expected = "\n  ".join(str((data_dir / f).resolve()) for f in files)
    also = ", ".join(str((data_dir / s).resolve()) + "/" for s in subdirs)
    raise FileNotFoundError(
        f"{name} corpus not found. Expected the files\n  {expected}\n(or the same names in "
        f"{also}). Put them there or point the 'data-dir' config key at their folder; "
        "this corpus is never downloaded automatically."
    )


def load_corpus(data_dir: str | Path, name: str) -> Corpus:
    """Read corpus ``name`` (``'ptb'`` or ``'wikitext2'``) into id streams and a vocabulary."""
    train_p, valid_p, test_p = corpus_files(data_dir, name)
    train_words = tokenize_file(train_p)
    vocab = Vocab(list(dict.fromkeys(train_words)))
    return Corpus(
        train=vocab.encode(train_words, str(train_p)),
        valid=vocab.encode(tokenize_file(valid_p), str(valid_p)),
        test=vocab.encode(tokenize_file(test_p), str(test_p)),
        vocab=vocab,
    )


# --------------------------------------------------------------------------- batching
def batchify(stream: Tensor, batch_size: int) -> Tensor:
    """[T, B] layout: the stream cut into ``batch_size`` contiguous rows (remainder dropped),
    row b being column b. ``T = len(stream) // batch_size``."""
    if stream.dim() != 1:
        raise ValueError(f"batchify needs a 1-D token stream, got shape {list(stream.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch-size must be >= 1, got {batch_size}")
    steps = stream.numel() // batch_size
    if steps < 2:
        raise ValueError(
            f"a stream of {stream.numel()} tokens is too short for batch-size {batch_size} "
            "(lower batch-size or num-clients)"
        )
    return stream[: steps * batch_size].view(batch_size, steps).t().contiguous()


def get_batch(source: Tensor, i: int, seq_len: int) -> tuple[Tensor, Tensor]:
    """Inputs ``source[i : i+L]`` and next-token targets ``source[i+1 : i+1+L]``, both [L, B],
    with ``L = min(seq_len, len(source) - 1 - i)``."""
    n = min(seq_len, source.shape[0] - 1 - i)
    if n < 1:
        raise ValueError(f"no targets left at position {i} of a source of length {source.shape[0]}")
    return source[i : i + n], source[i + 1 : i + 1 + n]


def sample_seq_len(
    generator: torch.Generator,
    bptt: int = 70,
    p: float = 0.95,
    std: float = 5.0,
    min_len: int = 5,
    max_len: int | None = None,
) -> tuple[int, float]:
    """One AWD-LSTM truncation length and its learning-rate scale ``seq_len / bptt``.

    base = ``bptt`` with probability ``p`` else ``bptt / 2``; ``seq_len = max(min_len,
    int(base + std * N(0, 1)))`` (int truncates toward zero), capped at ``max_len`` if given.
    """
    u = torch.rand(1, generator=generator, device=generator.device)
    z = torch.randn(1, generator=generator, device=generator.device)
    base = bptt if float(u) < p else bptt / 2
    seq_len = max(min_len, int(base + std * float(z)))
    if max_len is not None:
        seq_len = min(seq_len, max_len)
    return seq_len, seq_len / bptt


def bptt_lengths(
    generator: torch.Generator,
    bptt: int = 70,
    num: int | None = None,
    p: float = 0.95,
    std: float = 5.0,
    min_len: int = 5,
    max_len: int | None = None,
) -> Iterator[tuple[int, float]]:
    """``num`` draws (endless if None) of ``(seq_len, lr_scale)``, see ``sample_seq_len``."""
    k = 0
    while num is None or k < num:
        yield sample_seq_len(generator, bptt, p, std, min_len, max_len)
        k += 1


def bptt_windows(
    generator: torch.Generator,
    total_len: int,
    bptt: int = 70,
    start: int = 0,
    p: float = 0.95,
    std: float = 5.0,
    min_len: int = 5,
    max_len: int | None = None,
) -> list[tuple[int, int, float]]:
    """One pass over a batchified source of ``total_len`` steps, as the AWD-LSTM epoch loop:
    ``(i, seq_len, lr_scale)`` windows from ``start`` on, back to back; the last window is
    shortened to end at ``total_len - 1`` (its lr_scale keeps the drawn length)."""
    out = []
    i = start
    while i < total_len - 2:
        seq_len, scale = sample_seq_len(generator, bptt, p, std, min_len, max_len)
        n = min(seq_len, total_len - 1 - i)
        out.append((i, n, scale))
        i += n
    return out


# --------------------------------------------------------------------------- partitions
def _check(stream: Tensor, num_clients: int) -> int:
    if stream.dim() != 1:
        raise ValueError(f"expected a 1-D token stream, got shape {list(stream.shape)}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    per_client = stream.numel() // num_clients
    if per_client < 1:
        raise ValueError(f"{stream.numel()} tokens cannot be split among {num_clients} clients")
    return per_client


def text_regions(stream: Tensor, num_clients: int) -> list[Tensor]:
    """Heterogeneous split: client i gets the i-th contiguous 1/N of the stream.

    All parts have ``len(stream) // N`` tokens (fewer than N trailing tokens dropped).
    """
    per_client = _check(stream, num_clients)
    return list(stream[: per_client * num_clients].view(num_clients, per_client).unbind(0))


def text_shards(stream: Tensor, num_clients: int, block_len: int = 2048) -> list[Tensor]:
    """Homogeneous split: contiguous blocks of about ``block_len`` tokens dealt round-robin.

    With ``L = len(stream) // N`` tokens per client, each client gets ``m = max(1,
    round(L / block_len))`` blocks of ``b = L // m`` tokens; block k of the stream (k < N*m)
    goes to client ``k mod N``, and each client's blocks are concatenated in stream order.
    All parts have ``m * b`` tokens; fewer than ``N * (m + 1)`` trailing tokens are dropped.
    """
    per_client = _check(stream, num_clients)
    if block_len < 1:
        raise ValueError(f"block_len must be >= 1, got {block_len}")
    m = max(1, round(per_client / block_len))
    b = per_client // m
    blocks = stream[: m * num_clients * b].view(m, num_clients, b)
    return [blocks[:, c, :].reshape(-1) for c in range(num_clients)]


def partition_text(stream: Tensor, num_clients: int, mode: str = "homogeneous", block_len: int = 2048) -> list[Tensor]:
    """``text_shards`` for ``mode='homogeneous'``, ``text_regions`` for ``'heterogeneous'``."""
    if mode == "homogeneous":
        return text_shards(stream, num_clients, block_len)
    if mode == "heterogeneous":
        return text_regions(stream, num_clients)
    raise ValueError(f"unknown text partition mode {mode!r}; use 'homogeneous' or 'heterogeneous'")
