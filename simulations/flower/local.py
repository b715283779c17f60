"""Find and stop the SuperLink that ``flwr run .`` started for one FLWR_HOME -- and only it.

flwr 1.42 (``flwr.cli.local_superlink``) starts it detached, with no pid file, as
``flower-superlink --insecure --simulation ... --port 39091 --log-file
$FLWR_HOME/local-superlink/superlink.log ...``. The port is the same for every user and
every FLWR_HOME, so it identifies nothing; the ``--log-file`` path does. A process is
ours when its argv runs ``flower-superlink`` with that exact log file and it belongs to
this user; it is stopped with its descendants (SuperExec, flwr-simulation, Ray).
"""

from __future__ import annotations

import os
from pathlib import Path

from .processes import cmdline, live_pids, stop

__all__ = ["find_local_superlinks", "local_log_file", "stop_local_superlink"]

# flwr.cli.local_superlink._get_local_superlink_paths (private): FLWR_HOME/local-superlink/
_RUNTIME_DIR = "local-superlink"
_LOG_NAME = "superlink.log"


def local_log_file(flwr_home: str | os.PathLike[str] | None = None) -> Path:
    """The ``--log-file`` of the local SuperLink of ``flwr_home`` (default: the FLWR_HOME
    that flwr itself would use, ``flwr.supercore.utils.get_flwr_home()``)."""
    if flwr_home is None:
        from flwr.supercore.utils import get_flwr_home  # flwr only when asked

        flwr_home = get_flwr_home()
    return Path(flwr_home).expanduser().absolute() / _RUNTIME_DIR / _LOG_NAME


def _runs_superlink(argv: list[str]) -> bool:
    return any(os.path.basename(part) == "flower-superlink" for part in argv[:2])


def _log_file_arg(argv: list[str]) -> str | None:
    for i, part in enumerate(argv):
        if part == "--log-file" and i + 1 < len(argv):
            return argv[i + 1]
        if part.startswith("--log-file="):
            return part.split("=", 1)[1]
    return None


def _owned_by_me(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def find_local_superlinks(flwr_home: str | os.PathLike[str] | None = None) -> dict[int, int]:
    """pid -> start time of this user's ``flower-superlink`` processes logging to
    ``local_log_file(flwr_home)`` (normally one; {} when none runs)."""
    wanted = os.path.realpath(local_log_file(flwr_home))
    found = {}
    for pid, start in live_pids().items():
        argv = cmdline(pid)
        if not _runs_superlink(argv):
            continue
        log_file = _log_file_arg(argv)
        if log_file is None or not _owned_by_me(pid):
            continue
        if not os.path.isabs(log_file):  # relative to the SuperLink's own working directory
            try:
                log_file = os.path.join(os.readlink(f"/proc/{pid}/cwd"), log_file)
            except OSError:
                continue
        if os.path.realpath(log_file) == wanted:
            found[pid] = start
    return found


def stop_local_superlink(flwr_home: str | os.PathLike[str] | None = None, timeout: float = 10.0) -> dict[int, int]:
    """Stop the local SuperLink(s) of ``flwr_home`` and their descendants (SIGTERM, then
    SIGKILL after ``timeout``); returns the SuperLink processes found ({}: none ran).
    RuntimeError if any survives."""
    found = find_local_superlinks(flwr_home)
    if found:
        left = stop(pids=found, timeout=timeout)
        if left:
            raise RuntimeError(f"processes {sorted(left)} of the local SuperLink survived SIGKILL")
    return found
