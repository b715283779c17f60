"""Time stamps of a round's parts, for the deployment benchmark (off unless asked for).

With ``CELGC_STAMPS=<file>`` in its environment, a process appends one JSON line per mark to
that file: ``{"event", "t" (Unix time, s), "pid", ...}``. The server's grid marks the push of
a round's messages and each reply it receives, the ClientApp the start and end of a train
message, the warm runner the moment it acquired a task; processes of one machine share the
clock, so ``benchmarks/flower_speed.py`` can split a deployed round into its parts. Unset (the
default), ``mark`` is one dictionary lookup and writes nothing. Standard library only: the
runner, the ClientApp and the ServerApp all use it.
"""

from __future__ import annotations

import json
import os
import time

ENV = "CELGC_STAMPS"


def enabled() -> bool:
    """Whether marks are written (``$CELGC_STAMPS`` is set): for marks that cost more than a lookup."""
    return bool(os.environ.get(ENV))


def mark(event: str, **fields: object) -> None:
    """Append ``event`` with the current time to ``$CELGC_STAMPS`` (nothing when unset)."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}, default=str)
    with open(path, "a", encoding="utf-8") as fh:  # one short write per line: lines stay whole
        fh.write(line + "\n")


def read(path: str | os.PathLike) -> list[dict]:
    """The marks of a stamp file, oldest first (a torn last line is skipped)."""
    out = []
    try:
        text = open(path, encoding="utf-8").read()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return sorted(out, key=lambda m: m["t"])
