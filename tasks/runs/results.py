"""Results of a run: one JSON-lines file (config + version header, a row per round) and
the final weights, saved so they load without unpickling arbitrary objects.

The header records what produced the run, so that a result can be traced to (seed, config,
code) and a stale one is never reused silently: the versions, the source (``source()``: the
project's version, a digest of its code and, from a git checkout, its commit and whether the
tree was modified) and ``torch-threads``, the writing process's intra-op thread
count (CPU reductions may split by thread, so the count is part of what a CPU result depends
on). A resumed run keeps its header; its first new row records ``resumed-by``: the source and
threads of the process that continued it."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .live_scalars import Scalars
from .safe_files import open_text, write_atomic

PACKAGE = "celgc"
ROOT = Path(__file__).resolve().parents[2]  # the checkout (or site-packages for an installed wheel)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in (PACKAGE, "flwr"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _git(*args: str) -> bytes | None:
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


#: the project's code: the Python files of these folders (tests and docs do not change a result)
CODE_DIRS = ("strategies", "tasks", "client", "server", "simulations", "examples")


def code_digest(root: Path = ROOT) -> str | None:
    """SHA-256 over the path and content of every ``*.py`` file under ``CODE_DIRS`` of ``root``
    (tracked or not: an untracked module can be imported); None when none is there."""
    files = sorted(f for d in CODE_DIRS for f in (root / d).rglob("*.py")
                   if "__pycache__" not in f.parts and f.is_file() and not f.is_symlink())
    if not files:
        return None
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return digest.hexdigest()


@lru_cache(maxsize=1)
def source() -> dict[str, Any]:
    """What code this process runs: ``version`` (the installed project's), ``code`` (``code_digest``:
    what decides whether two runs ran the same code), and where the project runs from a git
    checkout of its own (not a repository that merely contains an installed copy): ``commit``
    and ``dirty`` (tracked files changed, or untracked files not ignored), else None. Computed
    once a process: the code a process imported is the code at its start."""
    out: dict[str, Any] = {"version": versions()[PACKAGE], "code": code_digest(), "commit": None, "dirty": None}
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top.decode().strip()).resolve() != ROOT:
        return out
    commit, status = _git("rev-parse", "HEAD"), _git("status", "--porcelain=v1", "--untracked-files=normal")
    if commit is not None and status is not None:
        out["commit"], out["dirty"] = commit.decode().strip(), bool(status.strip())
    return out


def producer() -> dict[str, Any]:
    """What the header records of the process that writes a run: its source and torch threads."""
    return {"source": source(), "torch-threads": torch.get_num_threads()}


def _describe(src: dict[str, Any]) -> str:
    commit = src.get("commit")
    where = f"commit {commit[:12]}{' (modified)' if src.get('dirty') else ''}" if isinstance(commit, str) else "no git commit"
    return f"version {src.get('version')}, {where}, code {str(src.get('code'))[:12]}"


def other_producer(header: dict[str, Any], rows: list[dict[str, Any]], threads: int | None = None) -> str | None:
    """Why the run of ``header`` and ``rows`` was not made by this code (the same version, code
    digest and torch version) with, given, ``threads`` torch threads, also in any of its resumes
    (``resumed-by``); None when it was. A header without a source (written before sources were
    recorded) is another producer; a commit that changed no code is not."""
    here, torch_here = source(), versions()["torch"]
    made = [("started", header)] + [(f"resumed at round {r.get('resumed-from-round')}", r["resumed-by"])
                                    for r in rows if isinstance(r.get("resumed-by"), dict)]
    for when, entry in made:
        theirs = entry.get("source")
        if not isinstance(theirs, dict):
            return f"{when} by code that recorded no source (older than this check)"
        if here["code"] is None or any(theirs.get(k) != here[k] for k in ("version", "code")):
            return f"{when} by {_describe(theirs)}; this is {_describe(here)}"
        torch_then = (header.get("versions") or {}).get("torch")
        if torch_then != torch_here:
            return f"with torch {torch_then}; this is torch {torch_here}"
        if threads is not None and entry.get("torch-threads") != threads:
            return f"{when} with {entry.get('torch-threads')} torch thread(s), this runs with {threads}"
    return None


def _clean(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class ResultsWriter:
    """Appends one JSON object per line to ``<folder>/results.jsonl`` and flushes it; with
    ``tensorboard = true`` in ``config`` also each row's numbers as TensorBoard scalars in ``folder``
    (``tasks.runs.live_scalars``). The one writer of results rows: the ServerApp and the engine.

    ``resume_from=k`` (a run resumed from its round-k checkpoint) keeps the existing file:
    its header and rows up to round k stay, rows of later rounds (written after the
    checkpoint, redone now) and a torn last line are dropped, new rows are appended.
    """

    def __init__(self, folder: str | Path, config: dict[str, Any], extra: dict[str, Any] | None = None,
                 resume_from: int | None = None) -> None:
        #: the rows as TensorBoard scalars too (``tensorboard = true``); checked before anything is written
        self.scalars = Scalars(folder, resume_from) if config.get("tensorboard") else None
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "results.jsonl"
        if resume_from is not None and self.path.exists():
            self._keep_rows_until(resume_from)
            return
        header = {"kind": "header", "config": config, "versions": versions(), **producer(),
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
        if self.scalars is not None:
            self.scalars.add(values)

    def close(self) -> None:
        """Close the TensorBoard writer, if any (results.jsonl is closed after every row)."""
        if self.scalars is not None:
            self.scalars.close()


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
        row["resumed-by"] = producer()
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
