"""CIFAR-10 reading (no torchvision, tiny fake batch files) and batch augmentation."""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.cifar import (
    ARCHIVE_NAME,
    BATCHES_DIR,
    CIFAR10_BLACK,
    TEST_BATCH,
    TRAIN_BATCHES,
    load_cifar10,
    normalize,
    random_crop_flip,
    read_cifar10_batches,
    restricted_pickle_load,
)


class _Py2StylePickler(pickle._Pickler):
    """Writes pickles like the official files (Python 2 cPickle, protocol 2, NumPy 1):
    strings and bytes as Python 2 ``str`` opcodes, arrays via ``numpy.core.multiarray``."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj):
        data = obj if isinstance(obj, bytes) else obj.encode("latin1")
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str
    dispatch[str] = _save_py2_str

    def save_global(self, obj, name=None):
        module = obj.__module__.replace("numpy._core", "numpy.core")
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode("ascii"))
        self.memoize(obj)


def _batch(rng: np.random.Generator, n: int, label_offset: int) -> dict:
    return {
        "batch_label": "training batch",
        "labels": [int((i + label_offset) % 10) for i in range(n)],
        "data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        "filenames": [f"img_{i}.png" for i in range(n)],
    }


def _write(path: Path, obj: dict, style: str) -> None:
    if style == "py2":
        buf = io.BytesIO()
        _Py2StylePickler(buf, protocol=2).dump(obj)
        path.write_bytes(buf.getvalue())
    else:  # a modern writer at the given protocol
        path.write_bytes(pickle.dumps(obj, protocol=int(style)))


def _fake_cifar(root: Path, n: int = 4, style: str = "py2") -> dict[str, dict]:
    folder = root / BATCHES_DIR
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    batches = {}
    for k, name in enumerate(TRAIN_BATCHES + (TEST_BATCH,)):
        batches[name] = _batch(rng, n, k)
        _write(folder / name, batches[name], style)
    return batches


def test_fake_file_has_the_official_layout(tmp_path: Path) -> None:
    _fake_cifar(tmp_path)
    raw = (tmp_path / BATCHES_DIR / "data_batch_1").read_bytes()
    assert raw.startswith(b"\x80\x02}")
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in raw and b"numpy._core" not in raw


@pytest.mark.parametrize("style", ["py2", "2", "5"])
def test_load_fake_batches(tmp_path: Path, style: str) -> None:
    batches = _fake_cifar(tmp_path, n=4, style=style)
    train_x, train_y, test_x, test_y = load_cifar10(tmp_path, download=False)
    assert train_x.shape == (20, 32, 32, 3) and train_x.dtype == torch.uint8
    assert test_x.shape == (4, 32, 32, 3) and test_x.dtype == torch.uint8
    assert train_y.dtype == torch.int64 and test_y.dtype == torch.int64
    expected_y = np.concatenate([batches[n]["labels"] for n in TRAIN_BATCHES])
    assert train_y.tolist() == expected_y.tolist()
    assert test_y.tolist() == batches[TEST_BATCH]["labels"]
    # row layout: 1024 red, 1024 green, 1024 blue values, each 32x32 row-major
    row = batches["data_batch_2"]["data"][1]
    img = train_x[4 + 1].numpy()
    assert img[0, 0, 0] == row[0] and img[0, 0, 1] == row[1024] and img[0, 0, 2] == row[2048]
    assert img[2, 5, 1] == row[1024 + 2 * 32 + 5]
    np.testing.assert_array_equal(img, row.reshape(3, 32, 32).transpose(1, 2, 0))


def test_missing_data_names_the_place_and_the_download_key(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        load_cifar10(tmp_path / "nowhere", download=False)
    msg = str(err.value)
    assert BATCHES_DIR in msg and ARCHIVE_NAME in msg and "download" in msg and "nowhere" in msg


def test_partial_folder_lists_missing_files(tmp_path: Path) -> None:
    _fake_cifar(tmp_path)
    os.remove(tmp_path / BATCHES_DIR / "data_batch_3")
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        load_cifar10(tmp_path, download=False)


def test_archive_is_unpacked(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _fake_cifar(src)
    dest = tmp_path / "data"
    dest.mkdir()
    with tarfile.open(dest / ARCHIVE_NAME, "w:gz") as tar:
        tar.add(src / BATCHES_DIR, arcname=BATCHES_DIR)
    train_x, train_y, test_x, test_y = load_cifar10(dest, download=False)
    assert train_x.shape == (20, 32, 32, 3) and (dest / BATCHES_DIR / TEST_BATCH).is_file()


def test_download_without_torchvision_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import fails
    monkeypatch.setitem(sys.modules, "torchvision.datasets", None)
    with pytest.raises(RuntimeError, match="torchvision"):
        load_cifar10(tmp_path, download=True)


def test_restricted_unpickler_refuses_other_globals(tmp_path: Path) -> None:
    evil = pickle.dumps({"data": os.getcwd}, protocol=2)
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        restricted_pickle_load(evil)
    _fake_cifar(tmp_path)
    (tmp_path / BATCHES_DIR / TEST_BATCH).write_bytes(evil)
    with pytest.raises(pickle.UnpicklingError):
        read_cifar10_batches(tmp_path / BATCHES_DIR)


def test_bad_content_is_rejected(tmp_path: Path) -> None:
    _fake_cifar(tmp_path)
    bad = _batch(np.random.default_rng(1), 3, 0)
    bad["labels"] = [0, 1]
    _write(tmp_path / BATCHES_DIR / TEST_BATCH, bad, "py2")
    with pytest.raises(ValueError, match="labels"):
        read_cifar10_batches(tmp_path / BATCHES_DIR)


def test_normalize() -> None:
    x = torch.randint(0, 256, (5, 32, 32, 3), dtype=torch.uint8)
    y = normalize(x)
    assert y.shape == (5, 3, 32, 32) and y.dtype == torch.float32 and y.is_contiguous()
    torch.testing.assert_close(y[:, 0], (x[..., 0].float() / 255 - 0.4914) / 0.2470)
    assert normalize(x, channels_last=True).is_contiguous(memory_format=torch.channels_last)
    xf = x.float()
    normalize(xf)
    assert torch.equal(xf, x.float())  # float input is not modified in place
    black = normalize(torch.zeros(1, 32, 32, 3, dtype=torch.uint8))
    torch.testing.assert_close(black[0, :, 0, 0], torch.tensor(CIFAR10_BLACK))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_augmentation_shape_and_determinism() -> None:
    x = torch.randn(16, 3, 32, 32)
    a = random_crop_flip(x, _gen(3))
    b = random_crop_flip(x, _gen(3))
    c = random_crop_flip(x, _gen(4))
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b) and not torch.equal(a, c)
    # leading batch dims (e.g. [clients, batch, C, H, W]) are kept
    assert random_crop_flip(x.view(2, 8, 3, 32, 32), _gen(3)).shape == (2, 8, 3, 32, 32)
    cl = x.contiguous(memory_format=torch.channels_last)
    out_cl = random_crop_flip(cl, _gen(3))
    assert out_cl.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(out_cl, a)


def test_flip_actually_flips() -> None:
    x = torch.randn(64, 3, 32, 32)
    out = random_crop_flip(x, _gen(0), padding=0)
    same = (out == x).flatten(1).all(1)
    mirrored = (out == x.flip(-1)).flatten(1).all(1)
    assert bool((same | mirrored).all())
    assert 10 < int(mirrored.sum()) < 54  # about half flipped
    assert torch.equal(random_crop_flip(x, _gen(0), padding=0, flip=False), x)


def test_crop_is_a_window_of_the_zero_padded_image() -> None:
    x = torch.randn(12, 3, 32, 32) + 5.0  # no zeros inside the image
    out = random_crop_flip(x, _gen(1), padding=4, flip=False)
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    offsets = set()
    for i in range(len(x)):
        hits = [(dy, dx) for dy in range(9) for dx in range(9)
                if torch.equal(out[i], padded[i, :, dy : dy + 32, dx : dx + 32])]
        assert len(hits) == 1
        offsets.add(hits[0])
    assert len(offsets) > 1  # offsets vary across the batch


def test_per_channel_fill() -> None:
    x = torch.zeros(8, 3, 32, 32)
    out = random_crop_flip(x, _gen(2), padding=4, fill=(1.0, 2.0, 3.0))
    vals = set(out.unique().tolist())
    assert vals <= {0.0, 1.0, 2.0, 3.0} and len(vals) > 1
    border = out != 0
    # a padded pixel carries its channel's fill in every channel
    assert torch.equal(border[:, 0], border[:, 2])
    assert bool((out[:, 1][border[:, 1]] == 2.0).all())
