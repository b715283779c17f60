"""A client host's own training data: the ``local-data`` node config and its file format.

A SuperNode started with ``--node-config 'local-data="/srv/celgc"'`` trains on all the
examples in that directory instead of computing a simulated partition. The format of the
digits task (the only one defined so far) is one NumPy archive, ``DIR/digits.npz``:

* ``x``: pixel intensities in [0, 16] (scikit-learn's ``load_digits().images``
  convention), shape ``[n, 8, 8]`` or ``[n, 64]``, any integer or float dtype;
* ``y``: integer labels in 0..9, shape ``[n]``.

It is read with ``numpy.load(allow_pickle=False)`` (no pickled objects) and standardised
exactly as the task's own training set, so a host holding partition i's examples in the
task's order (``python -m client.local_data export``) trains bit for bit like simulated
partition i -- provided its node config also says ``partition-id=i``, which then only
seeds the minibatch sampling. Without ``partition-id`` the sampling stream is seeded by a
CRC-32 of the archive, so it depends on the data alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from tasks.config import RunConfig

KEY = "local-data"
FILES = {"digits": "digits.npz"}


@dataclass(frozen=True)
class LocalData:
    """A host's own data as a task (its tensors) plus the indices of all its examples."""

    task: object
    indices: np.ndarray
    sampling_id: int
    partition_id: int | None  # the node config's partition-id, if it gave one


def data_file(task: str, directory: str | Path) -> Path:
    if task not in FILES:
        raise ValueError(f"{KEY} is defined for task(s) {', '.join(FILES)} only, got task {task!r}")
    return Path(directory).expanduser() / FILES[task]


def read_digits(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``x`` [n, 8, 8] float64 pixel values and ``y`` [n] int64 labels, validated."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{KEY}: {path} does not exist (expected an .npz with arrays x and y)")
    with np.load(path, allow_pickle=False) as archive:
        missing = {"x", "y"} - set(archive.files)
        if missing:
            raise ValueError(f"{path}: missing array(s) {sorted(missing)}; expected x [n, 8, 8] and y [n]")
        x, y = archive["x"], archive["y"]
    if x.dtype.kind not in "iuf" or y.dtype.kind not in "iu":
        raise ValueError(f"{path}: x must be numeric and y integer, got {x.dtype} and {y.dtype}")
    if x.ndim == 2 and x.shape[1] == 64:
        x = x.reshape(-1, 8, 8)
    if x.ndim != 3 or x.shape[1:] != (8, 8) or y.shape != (len(x),) or len(x) == 0:
        raise ValueError(f"{path}: expected x [n, 8, 8] (or [n, 64]) and y [n] with n >= 1, "
                         f"got {x.shape} and {y.shape}")
    if not np.isfinite(x).all() or x.min() < 0 or x.max() > 16:
        raise ValueError(f"{path}: x must hold pixel values in [0, 16]")
    if y.min() < 0 or y.max() > 9:
        raise ValueError(f"{path}: y must hold labels in 0..9, got {y.min()}..{y.max()}")
    return x.astype(np.float64), y.astype(np.int64)


@lru_cache(maxsize=2)
def _load(cfg: RunConfig, path: str, stamp: tuple[int, int]) -> tuple[object, np.ndarray, int]:
    from tasks import cached_task
    from tasks.digits import standardize

    x, y = read_digits(path)
    base = cached_task(cfg)
    # the task's own memory layout (strides): conv kernels, hence float rounding, depend on it
    train_x = torch.empty_strided((len(x), *base.train_x.shape[1:]), base.train_x.stride(), dtype=base.train_x.dtype)
    train_x.copy_(torch.from_numpy(standardize(x)).reshape(train_x.shape))
    task = dataclasses.replace(base, name=f"{base.name}-local", train_x=train_x, train_y=torch.from_numpy(y),
                               _device_cache={})
    crc = zlib.crc32(Path(path).read_bytes()) & 0x7FFFFFFF
    return task, np.arange(len(y), dtype=np.int64), crc


def local_data(node_config: dict, cfg: RunConfig) -> LocalData | None:
    """The host's own data if the node config names a ``local-data`` directory, else None."""
    if KEY not in node_config:
        return None
    directory = node_config[KEY]
    if not isinstance(directory, str) or not directory:
        raise ValueError(f"{KEY} must be a directory path (a string), got {directory!r}")
    if "num-partitions" in node_config:
        raise ValueError(f"{KEY} and num-partitions exclude each other: a host with its own data has no partition")
    pid = node_config.get("partition-id")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid < 0):
        raise ValueError(f"partition-id must be an integer >= 0, got {pid!r}")
    if cfg.valid_fraction > 0:
        raise ValueError(f"valid-fraction = {cfg.valid_fraction:g} holds out a share of the simulated partitions; a host "
                         f"with its own data ({KEY}) trains on all of it: run with valid-fraction = 0")
    path = data_file(cfg.task, directory)
    st = path.stat() if path.exists() else None
    task, idx, crc = _load(cfg, str(path.resolve()), (st.st_mtime_ns, st.st_size) if st else (0, 0))
    return LocalData(task=task, indices=idx, sampling_id=crc if pid is None else pid, partition_id=pid)


def export_partition(cfg: RunConfig, partition_id: int, directory: str | Path) -> Path:
    """Write simulated partition ``partition_id`` in the local-data format (for tests and demos)."""
    from tasks import partitions
    from tasks.digits import raw_train

    if cfg.task != "digits":
        raise ValueError(f"export is defined for task digits only, got {cfg.task!r}")
    images, labels = raw_train()
    idx = partitions(cfg)[partition_id]
    path = data_file(cfg.task, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=images[idx].astype(np.uint8), y=labels[idx].astype(np.int64))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.local_data",
                                     description="Write simulated partition I of N as a host's local-data directory.")
    parser.add_argument("command", choices=["export"])
    parser.add_argument("directory")
    parser.add_argument("--partition-id", type=int, required=True)
    parser.add_argument("--num-partitions", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partitioner", default="homogeneous")
    ns = parser.parse_args(argv)
    cfg = RunConfig.from_mapping({"num-clients": ns.num_partitions, "seed": ns.seed, "partitioner": ns.partitioner})
    print(export_partition(cfg, ns.partition_id, ns.directory))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
