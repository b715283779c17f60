"""Peak resident memory and CPU seconds of every process of a run, sampled from /proc.

``ProcessMonitor(pids)`` samples, in a thread every ``interval`` s, each live process that
``pids()`` names: its resident memory (VmRSS; the peak kept per process and for the sum over
the processes alive at once) and its CPU seconds (user + system, the last value seen: a
process that exits between two samples loses at most one interval). ``roles()`` groups the
processes by what they are (SuperLink, SuperNode, ServerApp, warm runner, ClientApp worker,
flwr-clientapp, engine, Ray, ...) from their command lines (a warm runner's forked worker by its
parent): per role the largest peak of one process, the number of processes and their CPU seconds
together.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

#: (substring of the command line, role); the first that matches names the process
ROLES = (
    ("flwr-serverapp", "ServerApp"),
    ("flwr-clientapp", "ClientApp (flwr-clientapp)"),
    ("flwr-simulation", "simulation (ServerApp + Ray driver)"),
    ("flower-superlink", "SuperLink"),
    ("flower-supernode", "SuperNode"),
    ("flower-superexec", "SuperExec"),
    ("warm_runner.py", "warm runner"),
    ("simulations.engine", "engine"),
    ("ray::", "Ray worker"),
    ("raylet", "Ray"),
    ("gcs_server", "Ray"),
    ("ray/", "Ray"),
    ("ray.", "Ray"),
    ("grpc_reference", "gRPC reference"),
)


def role_of(cmdline: str, comm: str = "") -> str:
    for needle, role in ROLES:
        if needle in cmdline or needle in comm:
            return role
    return "other: " + (comm or cmdline.split(" ", 1)[0].rsplit("/", 1)[-1])[:40]


@dataclass
class Seen:
    role: str
    ppid: int = 0
    peak_rss: int = 0
    cpu: float = 0.0


@dataclass
class ProcessMonitor:
    pids: Callable[[], Iterable[int]]
    interval: float = 0.2
    seen: dict[int, Seen] = field(default_factory=dict)
    peak_total: int = 0

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        total = 0
        for pid in list(self.pids()):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                statm = Path(f"/proc/{pid}/statm").read_text().split()
            except OSError:
                continue
            comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            rss = int(statm[1]) * _PAGE
            cpu = (int(rest[11]) + int(rest[12])) / _HZ
            entry = self.seen.get(pid)
            if entry is None:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    cmd = ""
                entry = self.seen[pid] = Seen(role_of(cmd, comm), int(rest[1]))
            entry.peak_rss = max(entry.peak_rss, rss)
            entry.cpu = max(entry.cpu, cpu)
            total += rss
        self.peak_total = max(self.peak_total, total)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> ProcessMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak(self) -> int:
        return self.peak_total

    def roles(self) -> dict[str, dict[str, float]]:
        """role -> {"processes", "peak MiB" (the largest of one process), "cpu s" (all together)}."""
        out: dict[str, dict[str, float]] = {}
        for s in self.seen.values():
            role = s.role
            parent = self.seen.get(s.ppid)
            if role == "warm runner" and parent is not None and parent.role == "warm runner":
                role = "ClientApp worker (warm)"  # forked from the runner: the same command line
            r = out.setdefault(role, {"processes": 0, "peak MiB": 0.0, "cpu s": 0.0})
            r["processes"] += 1
            r["peak MiB"] = max(r["peak MiB"], s.peak_rss / 2**20)
            r["cpu s"] += s.cpu
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["cpu s"]))
