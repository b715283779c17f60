"""PTB / WikiText-2 reading, batching, AWD-LSTM sequence lengths and text partitions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tasks.text import (
    EOS,
    UNK,
    batchify,
    bptt_lengths,
    bptt_windows,
    get_batch,
    load_corpus,
    partition_text,
    sample_seq_len,
    text_regions,
    text_shards,
)

PTB_TRAIN = " the cat sat on the mat \n a dog <unk> ran \n the end \n"
PTB_VALID = " the zebra sat \n"  # 'zebra' is unknown -> <unk>
PTB_TEST = " a cat \n the dog ran \n"


def _write_ptb(folder: Path, train: str = PTB_TRAIN, valid: str = PTB_VALID, test: str = PTB_TEST) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ptb.train.txt").write_text(train)
    (folder / "ptb.valid.txt").write_text(valid)
    (folder / "ptb.test.txt").write_text(test)


def test_ptb_vocabulary_and_eos(tmp_path: Path) -> None:
    _write_ptb(tmp_path)
    corpus = load_corpus(tmp_path, "ptb")
    train, valid, test, vocab = corpus  # tuple unpacking works
    assert vocab.itos == ["the", "cat", "sat", "on", "mat", EOS, "a", "dog", UNK, "ran", "end"]
    assert len(vocab) == 11
    assert train.dtype == torch.int64 and train.dim() == 1
    assert vocab.decode(train) == "the cat sat on the mat <eos> a dog <unk> ran <eos> the end <eos>".split()
    assert vocab.decode(valid) == ["the", UNK, "sat", EOS]
    assert vocab.decode(test) == "a cat <eos> the dog ran <eos>".split()
    assert int((train == vocab.eos).sum()) == 3  # one per line


def test_wikitext2_blank_lines_and_subfolder(tmp_path: Path) -> None:
    folder = tmp_path / "wikitext-2"
    folder.mkdir()
    (folder / "wiki.train.tokens").write_text(" \n = Héllo = \n \n word @-@ word <unk> \n", encoding="utf-8")
    (folder / "wiki.valid.tokens").write_text(" word \n", encoding="utf-8")
    (folder / "wiki.test.tokens").write_text(" = new = \n", encoding="utf-8")
    corpus = load_corpus(tmp_path, "wikitext2")  # found in the archive's sub-folder
    words = corpus.vocab.decode(corpus.train)
    assert words == [EOS, "=", "Héllo", "=", EOS, EOS, "word", "@-@", "word", UNK, EOS]
    assert corpus.vocab.decode(corpus.test) == ["=", UNK, "=", EOS]


def test_missing_files_name_the_expected_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        load_corpus(tmp_path, "ptb")
    for name in ("ptb.train.txt", "ptb.valid.txt", "ptb.test.txt"):
        assert str(tmp_path / name) in str(err.value) or name in str(err.value)
    with pytest.raises(FileNotFoundError, match="wiki.valid.tokens"):
        load_corpus(tmp_path, "wikitext2")
    with pytest.raises(ValueError, match="unknown corpus"):
        load_corpus(tmp_path, "enwik8")


def test_unknown_word_without_unk_is_an_error(tmp_path: Path) -> None:
    _write_ptb(tmp_path, train=" the cat \n", valid=" the zebra \n", test=" cat \n")
    with pytest.raises(ValueError, match="zebra"):
        load_corpus(tmp_path, "ptb")


def test_batchify_and_get_batch() -> None:
    stream = torch.arange(103)
    data = batchify(stream, 4)
    assert data.shape == (25, 4) and data.is_contiguous()
    for b in range(4):  # column b is the b-th contiguous row of the stream
        assert torch.equal(data[:, b], torch.arange(25 * b, 25 * (b + 1)))
    x, y = get_batch(data, 0, 10)
    assert x.shape == (10, 4) and torch.equal(y, x + 1)
    x, y = get_batch(data, 20, 10)  # shortened at the end
    assert x.shape == (4, 4) and torch.equal(y[-1], data[-1])
    with pytest.raises(ValueError):
        batchify(torch.arange(5), 4)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_bptt_jitter_bounds_scale_and_determinism() -> None:
    draws = list(bptt_lengths(_g(0), bptt=70, num=2000))
    assert draws == list(bptt_lengths(_g(0), bptt=70, num=2000))
    assert draws != list(bptt_lengths(_g(1), bptt=70, num=2000))
    lens = torch.tensor([n for n, _ in draws], dtype=torch.float64)
    assert all(scale == n / 70 for n, scale in draws)
    assert int(lens.min()) >= 5 and int(lens.max()) < 70 + 5 * 6
    half = lens < 52.5  # draws around bptt/2
    assert 0.02 < float(half.double().mean()) < 0.08  # p(base = bptt/2) = 0.05
    assert abs(float(lens[~half].mean()) - 69.5) < 0.6  # int() truncates N(70, 5)
    # degenerate settings pin the length
    assert sample_seq_len(_g(0), bptt=70, p=1.0, std=0.0) == (70, 1.0)
    assert sample_seq_len(_g(0), bptt=70, p=0.0, std=0.0) == (35, 0.5)
    assert sample_seq_len(_g(0), bptt=4, p=1.0, std=0.0) == (5, 1.25)  # min_len 5
    assert sample_seq_len(_g(0), bptt=70, p=1.0, std=0.0, max_len=60)[0] == 60
    # endless when num is None
    it = bptt_lengths(_g(0))
    assert len([next(it) for _ in range(5)]) == 5


def test_bptt_windows_cover_the_source() -> None:
    windows = bptt_windows(_g(0), total_len=1000, bptt=70)
    assert windows[0][0] == 0
    for (i, n, _), (j, _, _) in zip(windows[:-1], windows[1:], strict=True):
        assert j == i + n
    last_i, last_n, _ = windows[-1]
    assert last_i + last_n == 999  # the last target is the last step
    assert windows == bptt_windows(_g(0), total_len=1000, bptt=70)


def test_text_regions_are_contiguous() -> None:
    stream = torch.arange(1003)
    parts = text_regions(stream, 4)
    assert [len(p) for p in parts] == [250] * 4
    assert torch.equal(torch.cat(parts), torch.arange(1000))


def test_text_shards_cover_the_stream_round_robin() -> None:
    stream = torch.arange(10_007)
    parts = text_shards(stream, 4, block_len=100)
    lengths = {len(p) for p in parts}
    assert len(lengths) == 1
    covered = torch.cat(parts).sort().values
    assert torch.equal(covered, torch.arange(len(covered)))  # disjoint cover of a prefix
    assert 10_007 - len(covered) < 4 * (25 + 1)
    # every client holds a share of every quarter of the corpus
    for p in parts:
        quarters = torch.bincount(p // 2500, minlength=4)
        assert bool((quarters > 0).all())
        assert int(torch.diff(p).ne(1).sum()) >= 20  # made of many blocks
    # block k goes to client k mod N
    b = int(torch.nonzero(torch.diff(parts[0]) != 1)[0]) + 1
    assert int(parts[1][0]) == b and int(parts[0][b]) == 4 * b


def test_partition_modes() -> None:
    stream = torch.arange(400)
    pairs = [
        (partition_text(stream, 2, "heterogeneous"), text_regions(stream, 2)),
        (partition_text(stream, 2, "homogeneous", 50), text_shards(stream, 2, 50)),
    ]
    for got, want in pairs:
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError):
        partition_text(stream, 2, "dirichlet")
    with pytest.raises(ValueError):
        text_regions(torch.arange(3), 4)
