"""Process trees of Flower tooling: finding them, tagging them, stopping them (Linux /proc).

Flower's SuperLink spawns ``flower-superexec`` in a NEW session, which spawns
``flwr-simulation``/``flwr-serverapp`` (and Ray), so a process group is not enough: a tree
is the root, its live descendants and every process whose environment carries our tag
(``TAG_VAR=<tag>``, inherited by everything it spawns, orphans included). A process is
named by (pid, start time) so a reused pid is never signalled. ``stop`` is the one
SIGTERM -> bounded wait -> SIGKILL helper of the simulation and deployment tooling.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["TAG_VAR", "alive", "cmdline", "exe", "free_port", "live_pids", "process_tree", "signal_pids",
           "stop", "strip_ansi", "tail"]

TAG_VAR = "FLWR_CLI_HELPER_TAG"
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_GONE = ("Z", "X")


def bin_dir() -> Path:
    """The directory of the current interpreter's console scripts (the venv's bin)."""
    return Path(sys.executable).parent


def exe(name: str) -> str:
    """A console script of the *current* environment, else from PATH."""
    cand = bin_dir() / name
    if cand.exists():
        return str(cand)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"`{name}` not found next to {sys.executable} nor on PATH")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (small race until it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text)


def tail(text: str, lines: int) -> str:
    return "\n".join(strip_ansi(text).rstrip().splitlines()[-lines:])


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a pid from /proc; None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return rest[0], int(rest[1]), int(rest[19])
    except (IndexError, ValueError):
        return None


def _all_stats() -> dict[int, tuple[str, int, int]]:
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    return {pid: st for pid in pids if (st := _stat(pid)) is not None}


def cmdline(pid: int) -> list[str]:
    """The argv of a live process ([] if gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def live_pids() -> dict[int, int]:
    """pid -> start time of every live (non-zombie) process but this one."""
    me = os.getpid()
    return {pid: st[2] for pid, st in _all_stats().items() if pid != me and st[0] not in _GONE}


def process_tree(roots: Iterable[int] = (), tag: str | None = None) -> dict[int, int]:
    """pid -> start time of the live roots, their descendants and (with ``tag``) every
    process carrying ``TAG_VAR=tag`` in its environment. Empty where /proc is missing."""
    stats = _all_stats()
    me = os.getpid()
    found: dict[int, int] = {}
    if tag is not None:
        needle = f"{TAG_VAR}={tag}".encode()
        for pid, st in stats.items():
            if pid == me or st[0] in _GONE:
                continue
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if needle in env.split(b"\0"):
                found[pid] = st[2]
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    stack = [r for r in roots if r in stats]
    seen: set[int] = set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        if pid != me and stats[pid][0] not in _GONE:
            found[pid] = stats[pid][2]
        stack.extend(children.get(pid, []))
    return found


def alive(pids: Mapping[int, int]) -> dict[int, int]:
    """The processes of ``pids`` still alive (same pid AND same start time)."""
    out = {}
    for pid, start in pids.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[0] not in _GONE:
            out[pid] = start
    return out


def signal_pids(pids: Mapping[int, int], sig: int) -> None:
    for pid in alive(pids):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _killpg(popen: subprocess.Popen | None, sig: int) -> None:
    if popen is not None and popen.poll() is None:
        try:
            os.killpg(popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop(popen: subprocess.Popen | None = None, *, pids: Mapping[int, int] | None = None, tag: str | None = None,
         timeout: float = 10.0, kill_timeout: float = 5.0) -> dict[int, int]:
    """Stop a process tree: SIGTERM to ``popen``'s group (it leads a session), to its
    descendants, to ``pids`` and their descendants and to everything tagged ``tag``; poll
    until all are gone (re-scanning the tag for late spawns) for at most ``timeout`` s, then
    SIGKILL the rest and wait at most ``kill_timeout`` s. Returns the survivors ({} normally).
    """
    roots = [popen.pid] if popen is not None and popen.poll() is None else []
    targets = process_tree([*roots, *alive(pids or {})], tag)
    _killpg(popen, signal.SIGTERM)
    signal_pids(targets, signal.SIGTERM)
    for sig, limit in ((None, timeout), (signal.SIGKILL, kill_timeout)):
        if sig is not None:
            _killpg(popen, sig)
            signal_pids(targets, sig)
        deadline = time.monotonic() + limit
        while True:
            if tag is not None:
                targets.update(process_tree((), tag))  # spawned while we waited
            if (popen is None or popen.poll() is not None) and not alive(targets):
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if (popen is None or popen.poll() is not None) and not alive(targets):
            break
    if popen is not None:
        try:
            popen.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
    return alive(targets)
