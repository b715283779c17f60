"""A deployed ClientApp's share of its host's cores (torch threads), as start_supernode.sh asks.

``CELGC_TORCH_THREADS`` (set by ``server/deploy/start_supernode.sh --threads``): an integer N
gives N torch threads; ``auto`` gives the host's cores divided by the SuperNodes running on it
(at least 1), counted at the node's first message of a run and kept for the run in the node's
``Context.state`` -- results depend on the thread count (a float reduction's order), so a run's
clients keep theirs when another SuperNode of the host stops or starts mid-run. Two ClientApps
with torch's default threads each on a 2-core host ran 31 training steps in 1-10 s instead of 0.12 s with one thread each
(issue 28's probe). Unset (simulation, the engine, the tests' in-process apps): nothing changes.
"""

from __future__ import annotations

import os
from pathlib import Path

from flwr.app import ConfigRecord, Context

from tasks.runs import stamps

ENV = "CELGC_TORCH_THREADS"


def supernodes_on_host() -> int:
    """Live ``flower-supernode`` processes this machine shows (at least 1: the caller's own)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"flower-supernode") for a in argv[:2]):
            count += 1
    return max(count, 1)


def threads_wanted(value: str | None = None, cores: int | None = None) -> int | None:
    """The torch threads ``CELGC_TORCH_THREADS`` asks for (None: unset, leave torch alone)."""
    value = os.environ.get(ENV) if value is None else value
    if not value:
        return None
    if value == "auto":
        return max(1, (cores or os.cpu_count() or 1) // supernodes_on_host())
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ENV} must be an integer >= 1 or 'auto', got {value!r}")
    return int(value)


#: where a node keeps the run's thread count in ``Context.state``
STATE_KEY = "host-share"


def use_host_share(context: Context) -> None:
    """Set torch's intra-op threads to this ClientApp's share of the host (if asked), the same
    for every message of the run."""
    kept = context.state.get(STATE_KEY)
    if isinstance(kept, ConfigRecord) and isinstance(kept.get("threads"), int):
        n = kept["threads"]
    else:
        n = threads_wanted()
        if n is None:
            return
        context.state[STATE_KEY] = ConfigRecord({"threads": n})
    if n is not None:
        import torch

        before = torch.get_num_threads()
        if before != n:
            torch.set_num_threads(n)
        stamps.mark("host-share", run=context.run_id, threads=torch.get_num_threads(), before=before)
