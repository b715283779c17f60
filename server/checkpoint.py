"""Resumable runs: an atomic checkpoint of the global model, the round and the strategy state.

One file, ``<run folder>/checkpoint.pt``, replaced every round by temp file + fsync +
``os.replace`` (+ fsync of the folder), so a crash mid-write leaves the previous checkpoint
intact. It is read with ``torch.load(weights_only=True)``: tensors, numbers, strings,
lists and dicts only, never arbitrary pickled objects; the metadata travels as a JSON string.

No RNG state is saved because none is needed: a client's minibatches are a pure function
of (seed, partition id, round), so global arrays + round + strategy state are the whole
state of a run, and a resumed run ends with the same model, bit for bit, as one that was
never interrupted -- for tasks whose clients keep no state (with ``client-state = "keep"``
the language models' clients start a resumed run, a new Flower run, from a zero state). ``ResumedStrategy`` runs a strategy from round k + 1 under Flower's own
``Strategy.start`` loop.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

FORMAT = 1
FILENAME = "checkpoint.pt"

# Keys a resumed run may change: they do not enter the arithmetic of a round.
RESUMABLE_CHANGES = frozenset({
    "num-rounds", "resume", "checkpoint-every", "node-wait", "round-timeout", "min-replies",
    "eval-every", "device", "results-dir", "run-name", "data-dir", "download", "eval-train",
})

Scalar = bool | int | float | str


class CheckpointError(RuntimeError):
    """A checkpoint is unreadable, malformed, or belongs to a different run config."""


@dataclass(frozen=True)
class Checkpoint:
    """The state of a run after ``round`` rounds (0: the initial model)."""

    round: int
    arrays: dict[str, torch.Tensor]
    strategy_state: dict[str, torch.Tensor | Scalar] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.round, bool) or not isinstance(self.round, int) or self.round < 0:
            raise CheckpointError(f"round must be an integer >= 0, got {self.round!r}")
        if not self.arrays or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                      for k, v in self.arrays.items()):
            raise CheckpointError("arrays must be a non-empty dict of name -> tensor")
        for key, value in self.strategy_state.items():
            if not isinstance(key, str) or not isinstance(value, (torch.Tensor, bool, int, float, str)):
                raise CheckpointError(f"strategy state {key!r}: only tensors, numbers and strings are allowed, "
                                      f"got {type(value).__name__}")


def checkpoint_path(folder: str | Path) -> Path:
    return Path(folder) / FILENAME


def save_checkpoint(folder: str | Path, ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` to ``folder/checkpoint.pt`` atomically; returns the path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(folder)
    payload = {
        "format": FORMAT,
        "round": ckpt.round,
        "arrays": {k: v.detach().cpu().contiguous() for k, v in ckpt.arrays.items()},
        "strategy": {k: v.detach().cpu().contiguous() if isinstance(v, torch.Tensor) else v
                     for k, v in ckpt.strategy_state.items()},
        "meta": json.dumps(ckpt.meta, default=_json_default),
    }
    tmp = folder / f".{FILENAME}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(folder)
    return path


def load_checkpoint(folder: str | Path) -> Checkpoint | None:
    """The checkpoint in ``folder`` (or at a file path), None if there is none.

    Raises CheckpointError for a file that is not a checkpoint of this format, including
    any pickle that is more than tensors and plain containers.
    """
    path = Path(folder)
    if path.is_dir() or not path.suffix:
        path = checkpoint_path(path)
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError for foreign objects, RuntimeError for a torn file
        raise CheckpointError(f"{path} is not a loadable checkpoint ({type(exc).__name__}: {exc})") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a checkpoint of format {FORMAT}")
    try:
        meta = json.loads(payload["meta"])
        return Checkpoint(round=payload["round"], arrays=dict(payload["arrays"]),
                          strategy_state=dict(payload["strategy"]), meta=meta)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: malformed checkpoint ({exc})") from exc


def check_resumable(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Raise CheckpointError naming every key whose change would alter the arithmetic."""
    keys = (set(saved) | set(current)) - RESUMABLE_CHANGES
    diff = sorted(k for k in keys if saved.get(k) != current.get(k))
    if diff:
        pairs = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in diff)
        raise CheckpointError(
            f"the checkpoint was written by a run with other settings ({pairs}); resume with the same "
            f"config (only {', '.join(sorted(RESUMABLE_CHANGES))} may change) or use a new run-name"
        )


def strategy_state(strategy: object) -> dict[str, torch.Tensor | Scalar]:
    """``strategy.state_dict()`` if the strategy keeps state across rounds, else {}."""
    fn = getattr(strategy, "state_dict", None)
    return dict(fn()) if callable(fn) else {}


def restore_strategy(strategy: object, state: Mapping[str, torch.Tensor | Scalar]) -> None:
    """Give a checkpointed state back to the strategy (which must accept it)."""
    if not state:
        return
    fn = getattr(strategy, "load_state_dict", None)
    if not callable(fn):
        raise CheckpointError(f"the checkpoint holds strategy state {sorted(state)} but "
                              f"{type(strategy).__name__} has no load_state_dict()")
    fn(dict(state))


class ResumedStrategy(Strategy):
    """``inner`` seen from round ``done`` on: its round r is this wrapper's round r - done.

    ``ResumedStrategy(s, k).start(num_rounds=n - k, ...)`` runs rounds k + 1 ... n of ``s``
    in Flower's ``Strategy.start`` loop. Its initial ``evaluate_fn(0, ...)`` call is the
    state already evaluated by the interrupted run: wrap evaluate_fn with ``shift_evaluate``.
    """

    def __init__(self, inner: Strategy, done: int) -> None:
        if done < 0:
            raise ValueError(f"done must be >= 0, got {done}")
        self.inner = inner
        self.done = done

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.inner.configure_train(server_round + self.done, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.inner.aggregate_train(server_round + self.done, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round + self.done, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round + self.done, replies)

    def shift_evaluate(self, evaluate_fn):  # noqa: ANN001, ANN201 - Flower's evaluate_fn type
        """evaluate_fn in the inner strategy's round numbers; skips the resumed round itself."""
        def shifted(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if self.done and server_round == 0:
                return None
            return evaluate_fn(server_round + self.done, arrays)
        return shifted


def _json_default(value: Any) -> Any:
    if isinstance(value, (tuple, set)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
