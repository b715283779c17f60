"""Results of a run: one JSON-lines file (config + version header, a row per round) and
the final weights, saved so they load without unpickling arbitrary objects."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .safe_files import open_text, write_atomic

PACKAGE = "celgc"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in (PACKAGE, "flwr"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _clean(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class ResultsWriter:
    """Appends one JSON object per line to ``<folder>/results.jsonl`` and flushes it.

    ``resume_from=k`` (a run resumed from its round-k checkpoint) keeps the existing file:
    its header and rows up to round k stay, rows of later rounds (written after the
    checkpoint, redone now) and a torn last line are dropped, new rows are appended.
    """

    def __init__(self, folder: str | Path, config: dict[str, Any], extra: dict[str, Any] | None = None,
                 resume_from: int | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "results.jsonl"
        if resume_from is not None and self.path.exists():
            self._keep_rows_until(resume_from)
            return
        header = {"kind": "header", "config": config, "versions": versions(),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(extra or {})}
        with open_text(self.path, "w") as f:
            f.write(json.dumps({k: _clean(v) for k, v in header.items()}) + "\n")

    def _keep_rows_until(self, last_round: int) -> None:
        kept = [line for _, line, obj in parse_lines(self.path, torn_ok=True)
                if obj.get("kind") != "round" or obj["round"] <= last_round]
        write_atomic(self.path, lambda f: f.write("".join(line + "\n" for line in kept).encode()))

    def row(self, values: dict[str, Any]) -> None:
        with open_text(self.path, "a") as f:
            f.write(json.dumps({"kind": "round", **{k: _clean(v) for k, v in values.items()}}) + "\n")
            f.flush()
            os.fsync(f.fileno())


class TooFewReplies(RuntimeError):
    """A round ended with fewer sound replies than min-replies asks for: the run fails."""


def check_replies(server_round: int, replies: int, required: int, failures: list[str]) -> None:
    """Raise TooFewReplies naming the round and what failed when ``replies < required``."""
    if replies < required:
        why = "; ".join(x for x in failures if x) or "none recorded"
        raise TooFewReplies(f"round {server_round}: {replies} sound replies, {required} required (min-replies); "
                            f"failures: {why}")


def round_row(server_round: int, global_epoch: float, *, lr: float | None = None, clip: float | None = None,
              failed_nodes: list[Any] | None = None, failures: list[str] | None = None,
              resumed_from: int | None = None, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """One results row, the same keys in the same order for the ServerApp and the engine.

    Round 0 (the initial model) has only the first three keys; a trained round adds the
    failed nodes (and their reasons), the round a resumed run continued from, lr, clip and
    the round's metrics; the caller adds the evaluation and ``wall-clock``.
    """
    row: dict[str, Any] = {"round": server_round, "global-epoch": global_epoch, "communication-rounds": server_round}
    if server_round == 0:
        return row
    row["failed-nodes"] = list(failed_nodes or [])
    if failures:
        row["failures"] = list(failures)
    if resumed_from:
        row["resumed-from-round"] = resumed_from
    row.update({"lr": lr, "clip": clip})
    row.update(metrics or {})
    return row


class RunClock:
    """Training wall-clock: time since the start, central evaluation excluded; a resumed
    run continues from the wall-clock its checkpoint recorded."""

    def __init__(self, already: float = 0.0) -> None:
        self.start = time.monotonic() - already
        self.excluded = 0.0

    def exclude(self, seconds: float) -> None:
        self.excluded += seconds

    def now(self) -> float:
        return time.monotonic() - self.start - self.excluded


class ResultsError(ValueError):
    """A results file holds a line that is not one of a run's rows."""


def parse_lines(path: str | Path, *, torn_ok: bool = False) -> list[tuple[int, str, dict[str, Any]]]:
    """(line number, text, object) of every line of a results file, checked: each line a JSON
    object, a round row's ``round`` an integer >= 0. ``torn_ok``: a last line that is not
    JSON (torn by a crash mid-write) is dropped. Anything else is a ``ResultsError`` naming
    the file and the line."""
    path = Path(path)
    lines = path.read_text().splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if torn_ok and number == len(lines):
                continue
            raise ResultsError(f"{path} line {number} is not JSON ({exc.msg}): {line[:80]!r}") from None
        if not isinstance(obj, dict):
            raise ResultsError(f"{path} line {number} is not a JSON object but {type(obj).__name__}: {line[:80]!r}")
        if obj.get("kind", "round") == "round":
            r = obj.get("round")
            if not (isinstance(r, int) and not isinstance(r, bool) and r >= 0):
                raise ResultsError(f"{path} line {number}: a round row needs \"round\", an integer >= 0, got {r!r}")
        out.append((number, line, obj))
    return out


def read_results(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, round rows) of a results file (``parse_lines``' checks)."""
    header: dict[str, Any] = {}
    rows = []
    for _, _, obj in parse_lines(path):
        if obj.get("kind") == "header":
            header = obj
        else:
            rows.append(obj)
    return header, rows


def save_weights(state: dict[str, torch.Tensor], path: str | Path) -> Path:
    """Write a state dict atomically (exclusive temp file + rename, no symlink followed)."""
    cpu = {k: v.detach().cpu() for k, v in state.items()}
    return write_atomic(path, lambda f: torch.save(cpu, f))


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Load weights with ``weights_only=True``: tensors and plain containers only."""
    return torch.load(Path(path), map_location="cpu", weights_only=True)
