"""Every write in a run folder, without following symlinks (pure stdlib).

Someone with write access to a run folder (or an operator's mistake) can plant a symlink
named like a file the run writes -- ``results.jsonl``, ``.lock``, ``model.pt``, a temp file --
pointing anywhere; a plain ``open(path, "w")`` follows it and overwrites the target. Here:

* files are opened with ``O_NOFOLLOW``: a symlink in their place is an ``UnsafeFile`` error
  naming the path, never followed;
* a file replaced whole (checkpoint, weights, the results kept on resume) is written to an
  exclusive temp file (``O_CREAT | O_EXCL | O_NOFOLLOW``, ``.<name>.<pid>.tmp``), synced and
  renamed over the target: ``os.replace`` replaces a symlink itself, never its target.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

_FLAGS = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class UnsafeFile(RuntimeError):
    """A file of the run folder is a symlink (or cannot be created exclusively)."""


def temp_name(path: Path) -> Path:
    """The temp file of ``path``'s writer in this process (what ``stale`` patterns match)."""
    return path.parent / f".{path.name}.{os.getpid()}.tmp"


def stale_patterns(names: tuple[str, ...]) -> list[str]:
    """Glob patterns of the temp files of killed writers of ``names``."""
    return [f".{name}.*.tmp" for name in names]


def open_fd(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses a symlink at ``path`` (``UnsafeFile`` naming it)."""
    try:
        return os.open(path, flags | _FLAGS, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.EEXIST and Path(path).is_symlink()):
            raise UnsafeFile(f"refusing to write through the symlink {path} (a run writes only its own files; "
                             "remove the link)") from None
        raise


def open_text(path: str | Path, mode: str) -> IO[str]:
    """``path`` opened for text writing, ``mode`` "w" (truncate) or "a" (append), without
    following a symlink."""
    flags = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND}[mode]
    return os.fdopen(open_fd(path, flags), mode)


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """Replace ``path`` by what ``write(file)`` writes: an exclusive temp file, synced, renamed
    over ``path`` (a symlink there is replaced, not followed)."""
    path = Path(path)
    tmp = temp_name(path)
    if tmp.is_symlink() or tmp.exists():  # a killed writer's leftover with our pid, or a planted link
        tmp.unlink()
    fd = open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
    return path
