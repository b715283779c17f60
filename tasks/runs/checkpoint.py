"""Resumable runs: an atomic checkpoint of the global model, the round and the strategy state.

One file, ``<run folder>/checkpoint.pt``, replaced every round by temp file + fsync +
``os.replace`` (+ fsync of the folder), so a crash mid-write leaves the previous checkpoint
intact. It is read with ``torch.load(weights_only=True)``: tensors, numbers, strings,
lists and dicts only, never arbitrary pickled objects; the metadata travels as a JSON string.

No RNG state is saved because none is needed: a client's minibatches are a pure function
of (seed, partition id, round), so global arrays + round + strategy state are the whole
state of a run, and a resumed run ends with the same model, bit for bit, as one that was
never interrupted -- for tasks whose clients keep no state (with ``client-state = "keep"``
the language models' clients start a resumed run, a new Flower run, from a zero state).
No flwr import: the engine uses this module too; ``server.resumed`` runs a Flower strategy
from round k + 1 under Flower's own ``Strategy.start`` loop.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strategies.core.averaging import all_finite, check_state

from .results import parse_lines
from .safe_files import write_atomic

FORMAT = 1
FILENAME = "checkpoint.pt"

# Keys a resumed run may change: they do not enter the arithmetic of a round.
RESUMABLE_CHANGES = frozenset({
    "num-rounds", "resume", "checkpoint-every", "node-wait", "round-timeout", "min-replies",
    "eval-every", "device", "results-dir", "run-name", "data-dir", "download", "eval-train", "tensorboard",
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


def refuse_non_finite(state: Mapping[str, torch.Tensor], server_round: int) -> None:
    """Raise CheckpointError when the global model is not finite: such a model is never
    checkpointed (resume could not recover from it); the last checkpoint stays."""
    bad = [k for k, v in state.items() if not all_finite(v)]
    if bad:
        raise CheckpointError(f"round {server_round}: the global model is not finite ({', '.join(bad[:5])}"
                              f"{', ...' if len(bad) > 5 else ''}); it is not checkpointed and the run stops: "
                              f"the last checkpoint holds the last finite model")


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
    write_atomic(path, lambda f: torch.save(payload, f))
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
    except (KeyError, TypeError, ValueError, CheckpointError) as exc:
        raise CheckpointError(f"{path}: malformed checkpoint ({exc})") from exc


def check_resumable(saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Raise CheckpointError naming every key whose change would alter the arithmetic (both configs
    in today's keys, ``tasks.config.comparable``: a checkpoint written before a method's keys were
    scoped, or before another method was added, resumes)."""
    from ..config import comparable  # the config module imports the registry of methods: only when asked

    saved, current = comparable(saved), comparable(current)
    keys = (set(saved) | set(current)) - RESUMABLE_CHANGES
    diff = sorted(k for k in keys if saved.get(k) != current.get(k))
    if diff:
        pairs = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in diff)
        raise CheckpointError(
            f"the checkpoint was written by a run with other settings ({pairs}); resume with the same "
            f"config (only {', '.join(sorted(RESUMABLE_CHANGES))} may change) or use a new run-name"
        )


def check_tensors(ckpt: Checkpoint, reference: Mapping[str, torch.Tensor] | None, where: str | Path) -> None:
    """Raise CheckpointError unless the checkpoint's arrays fit ``reference`` (the model's state:
    the same keys, shapes and dtypes, every value finite) and its strategy tensors are finite."""
    if reference is not None:
        why = check_state(ckpt.arrays, reference)
        if why is not None:
            raise CheckpointError(f"{where}: the checkpoint does not fit the model: {why}")
    for key, value in ckpt.strategy_state.items():
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{where}: the checkpoint's strategy state {key} holds non-finite values")


def resume_point(folder: str | Path, config: Mapping[str, Any], num_rounds: int,
                 reference: Mapping[str, torch.Tensor] | None = None) -> Checkpoint | None:
    """The checkpoint a run with ``resume=true`` continues from, checked against its config.

    None: no checkpoint, start at round 0 -- allowed only while the folder's results hold no
    trained round (a run killed before its first checkpoint); rows of trained rounds without
    a checkpoint (``checkpoint-every=0``) cannot be continued and are never overwritten.
    ``reference``: the model's state, which the checkpoint's arrays must fit (``check_tensors``).
    """
    ckpt = load_checkpoint(folder)
    if ckpt is None:
        results = Path(folder) / "results.jsonl"
        trained = [row["round"] for row in _rows(results) if row.get("kind") == "round" and row.get("round", 0) > 0]
        if trained:
            raise CheckpointError(
                f"{folder} holds results up to round {max(trained)} but no checkpoint (checkpoint-every=0?): it "
                f"cannot be resumed; choose another run-name")
        return None
    check_tensors(ckpt, reference, checkpoint_path(Path(folder)))
    check_resumable(ckpt.meta.get("config", {}), config)
    if ckpt.round > num_rounds:
        raise CheckpointError(f"the checkpoint is at round {ckpt.round}, past num-rounds={num_rounds}")
    return ckpt


def _rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a results file (its torn last line dropped); a malformed line is a
    ``ResultsError`` naming it."""
    return [obj for _, _, obj in parse_lines(path, torn_ok=True)] if path.exists() else []


def strategy_state(strategy: object) -> dict[str, torch.Tensor | Scalar]:
    """``strategy.state_dict()`` if the strategy keeps state across rounds, else {}."""
    fn = getattr(strategy, "state_dict", None)
    return dict(fn()) if callable(fn) else {}


#: checkpoint entries ``<prefix>/<client id>/<name>`` of the clients' own state (the engine keeps it; on
#: the Flower path it lives with the clients: a kept language-model state, a method's client memory)
CLIENT_RECORDS = ("client-state", "client-memory")


def split_client_records(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[int, dict[str, Any]]]]:
    """(the method's entries, prefix -> client id -> the clients' own entries) of a checkpoint's state."""
    own: dict[str, Any] = {}
    clients: dict[str, dict[int, dict[str, Any]]] = {}
    for key, value in state.items():
        prefix, _, rest = key.partition("/")
        pid, _, name = rest.partition("/")
        if prefix not in CLIENT_RECORDS:
            own[key] = value
        elif not name or not pid.isdigit():
            raise CheckpointError(f"checkpoint entry {key!r} is not {prefix}/<client id>/<name>")
        else:
            clients.setdefault(prefix, {}).setdefault(int(pid), {})[name] = value
    return own, clients


def restore_strategy(strategy: object, state: Mapping[str, torch.Tensor | Scalar]) -> None:
    """Give a checkpointed state back to the strategy (which must accept it)."""
    if not state:
        return
    fn = getattr(strategy, "load_state_dict", None)
    if not callable(fn):
        raise CheckpointError(f"the checkpoint holds strategy state {sorted(state)} but "
                              f"{type(strategy).__name__} has no load_state_dict()")
    fn(dict(state))


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
