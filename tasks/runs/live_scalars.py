"""Live curves: a run's results rows as TensorBoard scalars (``tensorboard = true``), beside results.jsonl.

``ResultsWriter`` (``tasks.runs.results``: the one writer of results rows, for the ServerApp and the
engine, so for every backend) hands each row it appended to ``Scalars.add``: every numeric field of
the row (loss, accuracy, clip fraction, bytes, wall-clock, epsilon of a DP run, ...) becomes the
scalar of that name at step = the row's round, in event files in the run folder itself, flushed
after every row. ``tensorboard --logdir RESULTS_DIR`` then shows each run folder as one run: a
sweep's points side by side while they train. results.jsonl stays the record; the event files are
a view of it (float32 values, as TensorBoard stores scalars).

The writer is ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard`` package (the
project's ``tensorboard`` extra). It is created at the first row, so a run refused before it wrote
anything leaves no file behind; a resumed run purges the steps after its checkpoint, as
results.jsonl drops them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

INSTALL = "pip install -e '.[tensorboard]' (or: pip install tensorboard)"


def require() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``; a clear error naming the extra when it cannot be imported."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ValueError(f"tensorboard = true needs the tensorboard package, which is not installed ({exc}): "
                         f"{INSTALL}") from None
    return SummaryWriter


def numeric_fields(row: dict[str, Any]) -> dict[str, float]:
    """The row's numeric fields but its round (the step): ints and floats, not booleans; non-finite
    values as they are (results.jsonl writes them as strings: they are not numbers there either)."""
    return {k: float(v) for k, v in row.items()
            if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool) and not
            (isinstance(v, float) and not math.isfinite(v))}


class Scalars:
    """The TensorBoard scalars of one run folder (``resume_from``: the checkpoint's round of a resumed run)."""

    def __init__(self, folder: str | Path, resume_from: int | None = None) -> None:
        self._make = require()  # checked at the start of the run, before any round
        self.folder = Path(folder)
        self.resume_from = resume_from
        self._writer: Any = None

    def add(self, row: dict[str, Any]) -> None:
        step = int(row["round"])
        if self._writer is None:
            purge = None if self.resume_from is None else self.resume_from + 1
            self._writer = self._make(log_dir=str(self.folder), purge_step=purge)
        for key, value in numeric_fields(row).items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
