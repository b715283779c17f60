"""This host's memory and identity, as the run's memory check sees them (Linux ``/proc``; elsewhere unknown).

``available_memory()``: what a run may still use here -- ``MemAvailable`` of ``/proc/meminfo``, or
``CELGC_MEMORY_LIMIT`` (bytes, or with a K/M/G suffix) where an operator caps it (a host shared
with other work) -- None where unknown. ``host_id()``: one number per kernel (its boot id): the
processes of one machine share its memory, network namespaces included, so nodes reporting the
same id share one budget.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

#: an operator's cap on what a run may use on this host (bytes; K, M, G suffixes: powers of 1024)
LIMIT = "CELGC_MEMORY_LIMIT"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"24G"`` -> bytes; an error names the value and the form."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"{LIMIT} must be a number of bytes, optionally with K, M, G or T, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def available_memory() -> int | None:
    """Bytes a run may still use on this host: ``CELGC_MEMORY_LIMIT`` if set, else ``MemAvailable``."""
    if os.environ.get(LIMIT):
        return parse_bytes(os.environ[LIMIT])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_id() -> int | None:
    """A number shared by every process of this machine (the kernel's boot id), None where unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    return int.from_bytes(hashlib.sha256(boot.encode()).digest()[:6], "big")  # fits a MetricRecord int exactly
