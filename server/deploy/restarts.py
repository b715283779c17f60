"""Automatic resumption: whether a run that ended without completing is submitted again with
``resume=true``, and why not. One policy for ``submit.sh --restarts N`` (which runs this file as
a script) and ``python -m simulations.flower --restarts N`` (which imports it); stdlib only.

A run is submitted again, from its last checkpoint, when it failed for a reason a new ServerApp
can overcome: its ServerApp died (Flower marks the run ``finished:failed`` with ``No heartbeat
received from the task`` once its heartbeat expired: up to 60 s), the SuperLink died with it
(restarted with its ``--database``), or the ServerApp failed on a fault of the federation (too
few replies, too few nodes online). It is not submitted again, and the reason is said, when

* it was stopped (``finished:stopped``: an operator's ``flwr stop``, not a fault);
* its run config was refused (``celgc run failed: ...`` without the method: the config was not
  even read, a new submission would be refused alike);
* it cannot resume: ``CheckpointError`` (no checkpoint behind trained rows, a changed config, a
  checkpoint that does not fit the model) or ``RunFolderError`` (the folder belongs to another run);
* the resumed run failed again with the same cause as the run it resumed (a fault that a restart
  does not clear: the next restart would fail the same way);
* the app's code changed since the first submission (``fab_hash``: the FAB ``flwr run`` builds;
  checked by the caller before it submits again): a resumed run would continue with other code.

    python3 restarts.py verdict STATUS DETAILS [PREVIOUS_CAUSE] < run.log
        prints two lines: "restart" or "stop", then the cause (or the reason to stop)
    python restarts.py fab-hash APP_DIR     (with flwr installed: the SHA-256 of the FAB flwr would build)
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: the words a failed run's log line starts its cause with (``server.app.FAILED_MARK``: this module is
#: read by tools that run any app, so it is not imported from there)
FAILED_MARK = "celgc run failed"
#: exceptions that say the run cannot continue from its folder
CANNOT_RESUME = ("CheckpointError", "RunFolderError")
COMPLETED, STOPPED = "finished:completed", "finished:stopped"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # simulations.flower.processes strips the same


def failure_cause(logs: str) -> str:
    """The one-line cause the ServerApp logged (``celgc run failed (<method> on <task>): ...``), or ""."""
    for line in reversed(_ANSI.sub("", logs).splitlines()):
        if FAILED_MARK in line:
            return line[line.index(FAILED_MARK):].strip()
    return ""


def cause_of(status: str, details: str, logs: str) -> str:
    """What ended the run, in one line: the ServerApp's own cause, else Flower's status details."""
    cause = failure_cause(logs)
    if cause:
        return cause
    details = " ".join(str(details or "").split())
    return f"{status}: {details}" if details and details != "N/A" else status or "unknown status"


def stop_reason(status: str, cause: str, previous_cause: str | None = None) -> str | None:
    """Why a run that ended with ``status`` and ``cause`` (``cause_of``) is not submitted again, or
    None: submit it again with resume=true. ``previous_cause``: the cause of the run it resumed."""
    if status == COMPLETED:
        return "it completed"
    if status == STOPPED:
        return "it was stopped (flwr stop): an operator's decision, not a fault"
    if cause.startswith(FAILED_MARK + ":"):
        return f"its run config was refused, a new submission would be too ({cause})"
    if any(name in cause for name in CANNOT_RESUME):
        return f"it cannot resume from its folder ({cause})"
    if previous_cause is not None and cause == previous_cause and cause.startswith(FAILED_MARK):
        return f"the resumed run failed again with the same cause ({cause})"
    return None


def fab_hash(app: str | Path) -> str:
    """The SHA-256 (hex) of the FAB that ``flwr run APP`` builds and submits (Flower reports its first
    8 characters as ``fab-hash``): equal while the app's files are."""
    import hashlib

    from flwr.cli.build import build_fab_from_disk

    return hashlib.sha256(build_fab_from_disk(Path(app).expanduser().resolve())).hexdigest()


def main(argv: list[str]) -> int:
    if argv[:1] == ["verdict"] and len(argv) in (3, 4):
        status, details = argv[1], argv[2]
        cause = cause_of(status, details, sys.stdin.read())
        why = stop_reason(status, cause, argv[3] if len(argv) == 4 and argv[3] else None)
        print("stop" if why else "restart")
        print(why or cause)
        return 0
    if argv[:1] == ["fab-hash"] and len(argv) == 2:
        print(fab_hash(argv[1]))
        return 0
    print(__doc__.strip().split("\n\n")[-1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
