"""A run folder is owned by one run: never overwritten, never shared by two live runs.

``claim_run_folder(folder, resume=...)`` is held for the whole run (a context manager) by
the ServerApp and by the engine:

- a lock: an exclusive ``flock`` on ``<folder>/.lock`` (the holder's pid written inside
  for the error message). The kernel drops it when the holder exits or is killed, so a
  crashed run never leaves a stale lock behind; a second live run on the folder is
  refused at once, naming the folder and the holder.
- a folder that already holds a run (``results.jsonl``, ``checkpoint.pt`` or ``model.pt``)
  is refused unless the run resumes it (``resume=true``), with the fix in the message.
- checkpoint temp files left by a writer that was killed mid-write
  (``.checkpoint.pt.<pid>.tmp``) are removed: the lock guarantees no live writer owns them.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK = ".lock"
OWNED = ("results.jsonl", "checkpoint.pt", "model.pt")
STALE = ".checkpoint.pt.*.tmp"


class RunFolderError(RuntimeError):
    """The run folder holds another run's results, or another live run holds it."""


def holds_a_run(folder: str | Path) -> list[str]:
    """The files of ``OWNED`` present in ``folder``."""
    return [name for name in OWNED if (Path(folder) / name).exists()]


def remove_stale_temp_files(folder: str | Path) -> list[Path]:
    """Remove checkpoint temp files of killed writers; call only while holding the lock."""
    removed = []
    for path in sorted(Path(folder).glob(STALE)):
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


@contextmanager
def claim_run_folder(folder: str | Path, *, resume: bool) -> Iterator[Path]:
    """Own ``folder`` for the duration of the ``with`` block (see the module docstring)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise RunFolderError(
                f"{folder} is in use by another live run (pid {holder}); wait for it to end or choose "
                f"another run-name") from None
        present = holds_a_run(folder)
        if present and not resume:
            raise RunFolderError(
                f"{folder} already holds a run ({', '.join(present)}); refusing to overwrite it: continue it "
                f"with resume=true, or choose another run-name (or results-dir)")
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        remove_stale_temp_files(folder)
        yield folder
    finally:
        os.close(fd)  # releases the lock
