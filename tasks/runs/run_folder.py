"""A run folder is owned by one run: never overwritten, never shared by two live runs.

``claim_run_folder(folder, resume=...)`` is held for the whole run (a context manager) by
the ServerApp and by the engine:

- a lock: an exclusive ``flock`` on ``<folder>/.lock`` (the holder's pid written inside
  for the error message). The kernel drops it when the holder exits or is killed, so a
  crashed run never leaves a stale lock behind; a second live run on the folder is
  refused at once, naming the folder and the holder.
- a folder that already holds a run (``results.jsonl``, ``checkpoint.pt`` or ``model.pt``)
  is refused unless the run resumes it (``resume=true``), with the fix in the message.
- temp files left by a writer that was killed mid-write (``.checkpoint.pt.<pid>.tmp``,
  ``.model.pt.<pid>.tmp``, ``.results.jsonl.<pid>.tmp``) are removed: the lock guarantees no
  live writer owns them.
- no symlink is followed: a run folder that is a symlink is refused, and every file of the
  run is opened without following one (``tasks.runs.safe_files``).
- a run that ends before it wrote anything (refused before round 0: a bad task, too many
  clients, ...; or stopped that early) leaves no folder behind: the folders the claim created
  are removed again when they hold nothing but the lock.

``stopped_at(folder, resume_command)`` says, in one line, where a stopped run is and how to go
on (the engine's, the runner's and the Flower wrapper's answer to Ctrl-C and SIGTERM).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .safe_files import open_fd, stale_patterns

LOCK = ".lock"
OWNED = ("results.jsonl", "checkpoint.pt", "model.pt")
STALE = stale_patterns(OWNED)


class RunFolderError(RuntimeError):
    """The run folder holds another run's results, or another live run holds it."""


def holds_a_run(folder: str | Path) -> list[str]:
    """The files of ``OWNED`` present in ``folder``."""
    return [name for name in OWNED if (Path(folder) / name).exists()]


def remove_stale_temp_files(folder: str | Path) -> list[Path]:
    """Remove checkpoint temp files of killed writers; call only while holding the lock."""
    removed = []
    for pattern in STALE:
        for path in sorted(Path(folder).glob(pattern)):
            path.unlink(missing_ok=True)  # a symlink is removed itself, never its target
            removed.append(path)
    return removed


def refusal(folder: Path, present: list[str]) -> str:
    """Why a run without resume=true may not use ``folder``, and what to do: a finished run
    (its ``model.pt`` written) is kept; one that did not finish (it failed or was stopped) can
    be resumed from its checkpoint, or started fresh under another name."""
    head = f"{folder} already holds a run ({', '.join(present)}); refusing to overwrite it"
    if "model.pt" in present:
        return f"{head}: continue it with resume=true, or choose another run-name (or results-dir)"
    from .checkpoint import CheckpointError, _rows, load_checkpoint

    rounds = [r["round"] for r in _rows(folder / "results.jsonl") if r.get("kind") == "round"]
    reached = f"its results reach round {max(rounds)}" if rounds else "it wrote no round"
    try:
        ckpt = load_checkpoint(folder)
    except CheckpointError as exc:
        return (f"{head}: that run did not finish (no model.pt; {reached}) and its checkpoint is unreadable "
                f"({exc}): start it fresh with another run-name (or results-dir), or delete the folder")
    if ckpt is not None:
        fix = f"resume it from its round-{ckpt.round} checkpoint with resume=true"
    elif not any(r > 0 for r in rounds):
        fix = "resume=true starts it again at round 0 in this folder (it has no checkpoint yet)"
    else:
        return (f"{head}: that run did not finish (it failed or was stopped: no model.pt; {reached}) and has no "
                f"checkpoint (checkpoint-every=0?), so it cannot be resumed: start it fresh with another run-name "
                f"(or results-dir), or delete the folder")
    return (f"{head}: that run did not finish (it failed or was stopped: no model.pt; {reached}): {fix}, or start "
            f"it fresh with another run-name (or results-dir), or delete the folder")


@contextmanager
def claim_run_folder(folder: str | Path, *, resume: bool) -> Iterator[Path]:
    """Own ``folder`` for the duration of the ``with`` block (see the module docstring)."""
    folder = Path(folder)
    created = [p for p in [folder, *folder.parents] if not p.exists()]  # deepest first: removed again if left empty
    if folder.is_symlink():
        raise RunFolderError(f"{folder} is a symlink to {os.readlink(folder)}: a run folder must be a real folder "
                             "inside results-dir (a run writes nowhere else); remove the link or choose another "
                             "run-name")
    folder.mkdir(parents=True, exist_ok=True)
    fd = open_fd(folder / LOCK, os.O_RDWR | os.O_CREAT)
    locked = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise RunFolderError(
                f"{folder} is in use by another live run (pid {holder}); wait for it to end or choose "
                f"another run-name") from None
        present = holds_a_run(folder)
        if present and not resume:
            raise RunFolderError(refusal(folder, present))
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        remove_stale_temp_files(folder)
        yield folder
    finally:
        if locked and created and not holds_a_run(folder) and [p.name for p in folder.iterdir()] == [LOCK]:
            (folder / LOCK).unlink(missing_ok=True)  # still locked: no other run is between the check and the unlink
            for path in created:
                try:
                    path.rmdir()
                except OSError:  # not empty (another run's files): kept
                    break
        os.close(fd)  # releases the lock


def stopped_at(folder: str | Path, resume_command: str) -> str:
    """Where the run of ``folder`` stopped and how it goes on, one line: ``resume_command`` (the
    run's own command with resume=true) when its checkpoint (or no trained round yet) lets it
    continue, else why it cannot."""
    folder = Path(folder)
    from .checkpoint import CheckpointError, _rows, load_checkpoint

    if not holds_a_run(folder):
        return f"stopped before round 0: nothing was written ({folder} not kept); start it again with the same command"
    rounds = [r["round"] for r in _rows(folder / "results.jsonl") if r.get("kind") == "round"]
    reached = f"after round {max(rounds)}" if rounds else "before round 0"
    if "model.pt" in holds_a_run(folder):
        return f"stopped after its last round: {folder} holds the finished run (model.pt)"
    try:
        ckpt = load_checkpoint(folder)
    except CheckpointError as exc:
        return f"stopped {reached}; {folder} keeps its rows but its checkpoint is unreadable ({exc}): start it fresh"
    if ckpt is not None:
        return (f"stopped {reached}; {folder} keeps its rows and the round-{ckpt.round} checkpoint; resume it "
                f"(bit-identical to an uninterrupted run) with: {resume_command}")
    if not any(r > 0 for r in rounds):
        return f"stopped {reached}; {folder} has no trained round yet; start it again in that folder with: {resume_command}"
    return (f"stopped {reached}; {folder} keeps its rows but has no checkpoint (checkpoint-every=0?), so it cannot "
            "be resumed: start it fresh with another run-name")
