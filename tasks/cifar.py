"""CIFAR-10: reading the data set from disk and augmenting batches on the device.

Files. ``load_cifar10(data_dir, download)`` looks for the standard "python version" of
CIFAR-10 (https://www.cs.toronto.edu/~kriz/cifar.html) in ``data_dir``:

* ``<data_dir>/cifar-10-batches-py/`` holding ``data_batch_1`` ... ``data_batch_5`` and
  ``test_batch``, or
* the archive ``<data_dir>/cifar-10-python.tar.gz``, which is unpacked next to it.

Those batch files are read directly (``read_cifar10_batches``), without torchvision: each
is a Python pickle of a dict holding a ``uint8`` array ``data`` [n, 3072] (the 1024 red,
then green, then blue pixels of each image, row-major) and a list ``labels``. The pickles
are loaded by a restricted unpickler that only builds plain containers and NumPy arrays, so
a tampered file cannot run code. torchvision is used only to download (``download=True``,
the ``download`` config key); it is imported lazily and is otherwise not needed. Nothing
ever falls back to random data: a missing data set is a ``FileNotFoundError`` that says
where to put the files.

Device side. ``normalize`` turns ``uint8`` [N, 32, 32, 3] images into float [N, 3, 32, 32]
with the CIFAR-10 channel mean and std; ``random_crop_flip`` is the standard augmentation
(random 32x32 crop of the image zero-padded by 4 pixels, and a horizontal flip with
probability 1/2) done for a whole batch with one gather, drawn from a ``torch.Generator``.
"""

from __future__ import annotations

import codecs
import functools
import io
import pickle
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ARCHIVE_NAME",
    "BATCHES_DIR",
    "CIFAR10_BLACK",
    "CIFAR10_CLASSES",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "TEST_BATCH",
    "TRAIN_BATCHES",
    "load_cifar10",
    "normalize",
    "random_crop_flip",
    "read_cifar10_batches",
    "restricted_pickle_load",
]

BATCHES_DIR = "cifar-10-batches-py"
ARCHIVE_NAME = "cifar-10-python.tar.gz"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)

#: Per-channel mean and standard deviation of the 50,000 CIFAR-10 training images
#: (pixel values scaled to [0, 1]).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
#: A black pixel after ``normalize``: the ``fill`` that makes ``random_crop_flip`` on
#: normalised images pad exactly like padding the raw image with zeros.
CIFAR10_BLACK = tuple(-m / s for m, s in zip(CIFAR10_MEAN, CIFAR10_STD, strict=True))

_IMAGE_SIZE = 32
_PIXELS = 3 * _IMAGE_SIZE * _IMAGE_SIZE


# --------------------------------------------------------------------------- pickle reading
def _reconstruct_function():
    """NumPy's array-unpickling helper, found without naming its (version-dependent) module."""
    return np.zeros(1).__reduce__()[0]


def _frombuffer_function():
    """NumPy's protocol-5 array-unpickling helper (arrays pickled by Python 3.8+ defaults)."""
    return np.zeros(1).__reduce_ex__(5)[0]


# Globals a CIFAR batch pickle may name. The files were written by Python 2 with NumPy 1
# (``numpy.core.multiarray``); a NumPy 2 writer names ``numpy._core.multiarray``.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct_function(),
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct_function(),
    ("numpy.core.numeric", "_frombuffer"): _frombuffer_function(),
    ("numpy._core.numeric", "_frombuffer"): _frombuffer_function(),
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    # Python 3 writers at protocol <= 2 store bytes as _codecs.encode(str, "latin1").
    ("_codecs", "encode"): codecs.encode,
    ("builtins", "bytearray"): bytearray,
    ("__builtin__", "bytearray"): bytearray,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: D102 - pickle API
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: CIFAR batch files hold only "
                "NumPy arrays, lists and strings"
            ) from None


def restricted_pickle_load(data: bytes) -> object:
    """Unpickle ``data`` allowing only containers, strings, numbers and NumPy arrays.

    Python 2 strings are decoded as latin-1 (as NumPy needs for its array payloads).
    """
    return _RestrictedUnpickler(io.BytesIO(data), encoding="latin1").load()


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    obj = restricted_pickle_load(path.read_bytes())
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    entries = {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in obj.items()}
    if "data" not in entries or not ({"labels", "fine_labels"} & entries.keys()):
        raise ValueError(f"{path}: not a CIFAR batch (keys {sorted(entries)}; need 'data' and 'labels')")
    data = np.asarray(entries["data"])
    labels = np.asarray(entries.get("labels", entries.get("fine_labels")), dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _PIXELS:
        raise ValueError(f"{path}: 'data' must be uint8 [n, {_PIXELS}], got {data.dtype} {list(data.shape)}")
    if labels.shape != (data.shape[0],):
        raise ValueError(f"{path}: {labels.size} labels for {data.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{path}: labels must lie in 0..9, got {labels.min()}..{labels.max()}")
    images = data.reshape(-1, 3, _IMAGE_SIZE, _IMAGE_SIZE).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels


def _missing(folder: Path, names: Sequence[str]) -> list[str]:
    return [n for n in names if not (folder / n).is_file()]


def read_cifar10_batches(folder: str | Path) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Read an unpacked ``cifar-10-batches-py`` folder without torchvision.

    Returns ``(train_x, train_y, test_x, test_y)``: images ``uint8`` [N, 32, 32, 3] (HWC,
    RGB) and labels ``int64`` [N], the training set in ``data_batch_1..5`` order.
    """
    folder = Path(folder)
    missing = _missing(folder, TRAIN_BATCHES + (TEST_BATCH,))
    if missing:
        raise FileNotFoundError(f"CIFAR-10 batch files missing from {folder}: {', '.join(missing)}")
    train = [_read_batch(folder / n) for n in TRAIN_BATCHES]
    test_x, test_y = _read_batch(folder / TEST_BATCH)
    train_x = np.concatenate([x for x, _ in train])
    train_y = np.concatenate([y for _, y in train])
    return (torch.from_numpy(train_x), torch.from_numpy(train_y),
            torch.from_numpy(test_x), torch.from_numpy(test_y))


def _extract_archive(archive: Path, dest: Path) -> None:
    """Unpack the official archive (only its regular files under ``cifar-10-batches-py/``)."""
    with tarfile.open(archive, "r:gz") as tar:
        members = [m for m in tar.getmembers()
                   if m.isfile() and Path(m.name).parts[:1] == (BATCHES_DIR,) and ".." not in Path(m.name).parts]
        if not members:
            raise ValueError(f"{archive} holds no {BATCHES_DIR}/ folder: not the CIFAR-10 python archive")
        for m in members:
            target = dest / m.name
            target.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            assert src is not None
            target.write_bytes(src.read())


def _download(data_dir: Path) -> None:
    try:
        from torchvision.datasets import CIFAR10  # noqa: PLC0415 - optional, lazy
    except Exception as err:  # ImportError, or a broken torchvision build
        raise RuntimeError(
            "downloading CIFAR-10 needs torchvision, which could not be imported "
            f"({type(err).__name__}: {err}). Install torchvision, or download "
            f"{ARCHIVE_NAME} yourself and put it (or its {BATCHES_DIR}/ folder) in {data_dir}"
        ) from err
    data_dir.mkdir(parents=True, exist_ok=True)
    # Downloads, checks the archive's MD5 and unpacks it to <data_dir>/cifar-10-batches-py.
    CIFAR10(root=str(data_dir), train=True, download=True)
    CIFAR10(root=str(data_dir), train=False, download=True)


def load_cifar10(data_dir: str | Path, download: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """CIFAR-10 from ``data_dir``: ``(train_x, train_y, test_x, test_y)``.

    Images are ``uint8`` [N, 32, 32, 3] (50,000 train, 10,000 test), labels ``int64`` [N].
    Reads ``<data_dir>/cifar-10-batches-py/`` directly; unpacks
    ``<data_dir>/cifar-10-python.tar.gz`` first if only the archive is there; downloads
    (through torchvision) only when ``download`` is true. Otherwise a missing data set
    raises ``FileNotFoundError`` saying where the files go.
    """
    data_dir = Path(data_dir)
    folder = data_dir / BATCHES_DIR
    archive = data_dir / ARCHIVE_NAME
    needed = TRAIN_BATCHES + (TEST_BATCH,)
    if _missing(folder, needed) and archive.is_file():
        _extract_archive(archive, data_dir)
    if _missing(folder, needed) and download:
        _download(data_dir)
    missing = _missing(folder, needed)
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 not found: expected the folder {folder.resolve()} with "
            f"{', '.join(needed)} (missing: {', '.join(missing)}), or the archive "
            f"{archive.resolve()} (the 'CIFAR-10 python version' from "
            "https://www.cs.toronto.edu/~kriz/cifar.html). Put the files there, point the "
            "'data-dir' config key at the folder that holds them, or set the config key "
            "'download = true' to let torchvision download them."
        )
    return read_cifar10_batches(folder)


# --------------------------------------------------------------------------- device side
@functools.lru_cache(maxsize=8)
def _channel_stats(mean: tuple, std: tuple, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """Mean and std as tensors on ``device``, made once (not a host-to-device copy per batch)."""
    return torch.tensor(mean, dtype=dtype, device=device), torch.tensor(std, dtype=dtype, device=device)


def normalize(
    images: Tensor,
    mean: Sequence[float] = CIFAR10_MEAN,
    std: Sequence[float] = CIFAR10_STD,
    channels_last: bool = False,
) -> Tensor:
    """``uint8`` [..., 32, 32, 3] (HWC) -> float32 [..., 3, 32, 32], scaled to [0, 1] and
    standardised per channel. With ``channels_last`` the result keeps NHWC strides."""
    x = images.to(torch.float32) / 255.0
    m, s = _channel_stats(tuple(mean), tuple(std), x.dtype, x.device)
    x = ((x - m) / s).movedim(-1, -3)
    if channels_last and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    return x.contiguous()


def random_crop_flip(
    x: Tensor,
    generator: torch.Generator,
    padding: int = 4,
    flip: bool = True,
    fill: float | Sequence[float] = 0.0,
) -> Tensor:
    """Random crop of the ``padding``-padded image plus a random horizontal flip, per image.

    ``x`` is [..., C, H, W] (any leading batch dims, contiguous or channels_last); the
    result has the same shape, dtype, device and memory format. Each image independently
    gets a crop offset uniform in ``{0, ..., 2*padding}`` per axis and, when ``flip``, a
    mirror with probability 1/2; everything is drawn from ``generator`` (same generator
    state -> same output) on the generator's device and applied with a single gather, no
    per-image loop. ``fill`` is the padding value, a scalar or one per channel: 0 pads
    normalised images with the mean colour; ``CIFAR10_BLACK`` reproduces zero-padding of
    the raw image (as torchvision's ``RandomCrop(32, padding=4)`` before ``Normalize``).
    """
    if x.dim() < 3:
        raise ValueError(f"random_crop_flip needs [..., C, H, W], got shape {list(x.shape)}")
    *lead, c, h, w = x.shape
    channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    xb = x.reshape(-1, c, h, w)
    b = xb.shape[0]
    p = padding
    if isinstance(fill, (int, float)):
        padded = torch.nn.functional.pad(xb, (p, p, p, p), value=float(fill))
    else:
        f = torch.as_tensor(fill, dtype=xb.dtype, device=xb.device).reshape(1, c, 1, 1)
        padded = torch.nn.functional.pad(xb - f, (p, p, p, p)) + f

    gdev = generator.device
    off = torch.randint(0, 2 * p + 1, (2, b), generator=generator, device=gdev).to(xb.device)
    if flip:
        mirror = (torch.rand(b, generator=generator, device=gdev) < 0.5).to(xb.device)
    else:
        mirror = torch.zeros(b, dtype=torch.bool, device=xb.device)
    ar_h = torch.arange(h, device=xb.device)
    ar_w = torch.arange(w, device=xb.device)
    rows = off[0, :, None] + ar_h  # [B, H]
    cols = off[1, :, None] + torch.where(mirror[:, None], (w - 1) - ar_w, ar_w)  # [B, W]
    bidx = torch.arange(b, device=xb.device)[:, None, None]
    out = padded[bidx, :, rows[:, :, None], cols[:, None, :]]  # [B, H, W, C]
    out = out.permute(0, 3, 1, 2)  # [B, C, H, W] with NHWC strides
    if channels_last:
        return out
    return out.contiguous().reshape(*lead, c, h, w)
