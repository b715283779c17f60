"""Time to accuracy under a network model: what a run's rounds would cost on a given link.

A small, documented model (pure functions; docs/experiments/network-model.md, "Time to accuracy under a network
model"). Every client has its own link to the server with a downlink bandwidth (server -> client), an
uplink bandwidth (client -> server) and a one-way latency; the clients of a round compute and
communicate in parallel, the server's own link and compute are not a bottleneck. One round costs

    compute + exchanges * 2 * latency + 8 * down_bytes / down_bps + 8 * up_bytes / up_bps

where ``down_bytes`` / ``up_bytes`` are what ONE client receives / sends in the round (the run's
``bytes-sent`` / ``bytes-received``, counted by the server over the round's clients, divided by the
clients of the round), ``exchanges`` the message exchanges of a round (the method's modes: CELGC one,
EPISODE two), and ``compute`` the measured training time of one client's round (the run's training
wall-clock per client-step times the local steps of a round). A run without communication (one
client) costs its compute alone. Left out: stragglers and device heterogeneity, contention on the
server's link, compression, server compute, asynchrony, TCP slow start, retransmissions.

The anchor is FedScale's system simulation (Lai et al., ICML 2022, arXiv 2105.11367), which draws each
client's compute speed and bandwidth from device traces and takes a client's round as computation +
(upload + download size) / bandwidth; this model keeps the sum, separates uplink from downlink, adds
latency per message, and uses one link for every client.

Named links (``LINKS``) are this project's choices, not measurements; a TOML file defines others::

    [links.campus]
    down-mbps = 100     # downlink, Mbit/s (10^6 bit/s)
    up-mbps = 40        # uplink, Mbit/s
    latency-ms = 5      # one-way latency per message, ms
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib


@dataclass(frozen=True)
class Link:
    """A client's link to the server: bandwidths in bit/s, one-way latency in s."""

    name: str
    down_bps: float
    up_bps: float
    latency_s: float
    note: str = ""

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise ValueError(f"link name must be letters, digits, '-' or '_' (starting with a letter), got {self.name!r}")
        for key, value in (("down", self.down_bps), ("up", self.up_bps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"link {self.name!r}: {key} bandwidth must be a finite number > 0, got {value!r}")
        if (isinstance(self.latency_s, bool) or not isinstance(self.latency_s, (int, float))
                or not (math.isfinite(self.latency_s) and self.latency_s >= 0)):
            raise ValueError(f"link {self.name!r}: latency must be a finite number >= 0, got {self.latency_s!r}")

    def describe(self) -> str:
        """'10 Gbit/s down, 10 Gbit/s up, 0.1 ms' (latency one way, per message)."""
        return f"{_rate(self.down_bps)} down, {_rate(self.up_bps)} up, {self.latency_s * 1e3:g} ms"


NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")

#: the named links (this project's choices: orders of magnitude, not measurements)
LINKS: dict[str, Link] = {link.name: link for link in (
    Link("datacenter", 10e9, 10e9, 0.1e-3, "10 Gbit/s Ethernet inside one data centre"),
    Link("cross-site", 1e9, 1e9, 20e-3, "organisations joined over a wide-area network (cross-silo)"),
    Link("mobile", 10e6, 2e6, 50e-3, "a phone on a cellular network: slow, asymmetric uplink (cross-device)"),
)}

#: ``--network`` of ``simulations.compare`` and of the runner's ``--compare``
NETWORK_HELP = ("links of the time-to-target table, comma separated: datacenter, cross-site, mobile "
                "(simulations/network.py), .toml files of [links.<name>] tables (down-mbps, up-mbps, latency-ms), "
                "or none (default: the three named links)")

#: the keys of a link in a TOML file: key -> (Link field, factor to the field's unit)
TOML_KEYS = {"down-mbps": ("down_bps", 1e6), "up-mbps": ("up_bps", 1e6), "latency-ms": ("latency_s", 1e-3)}


def _rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def round_seconds(link: Link, *, compute_s: float, exchanges: int, down_bytes: float, up_bytes: float) -> float:
    """One round of one client on ``link``: ``compute_s`` + ``exchanges`` × 2 × latency (a message down
    and one up each) + 8·``down_bytes`` / downlink + 8·``up_bytes`` / uplink (bytes of that client)."""
    if exchanges < 0 or down_bytes < 0 or up_bytes < 0 or compute_s < 0:
        raise ValueError(f"round_seconds needs values >= 0, got compute_s={compute_s}, exchanges={exchanges}, "
                         f"down_bytes={down_bytes}, up_bytes={up_bytes}")
    return (compute_s + exchanges * 2 * link.latency_s + 8 * down_bytes / link.down_bps
            + 8 * up_bytes / link.up_bps)


def run_seconds(rows: Iterable[dict[str, Any]], link: Link, *, until_round: int, step_seconds: float,
                local_steps: int, clients: int, exchanges: int) -> float:
    """Modelled seconds of a run's rounds 1 .. ``until_round`` on ``link``.

    Per round: compute ``step_seconds`` × ``local_steps`` (one client's round), ``exchanges``
    exchanges, and the row's ``bytes-sent`` (down) / ``bytes-received`` (up) over the round's
    ``clients``. ``exchanges = 0`` (no communication: one client) costs the compute alone."""
    if clients < 1 or local_steps < 1:
        raise ValueError(f"run_seconds needs clients >= 1 and local_steps >= 1, got {clients}, {local_steps}")
    total = 0.0
    for row in rows:
        r = int(row.get("round", 0))
        if r < 1 or r > until_round:
            continue
        down = float(row.get("bytes-sent", 0) or 0) / clients if exchanges else 0.0
        up = float(row.get("bytes-received", 0) or 0) / clients if exchanges else 0.0
        total += round_seconds(link, compute_s=step_seconds * local_steps, exchanges=exchanges,
                               down_bytes=down, up_bytes=up)
    return total


def parse_links(spec: str | Sequence[str] | None) -> list[Link]:
    """The links a ``--network`` value names: comma-separated names of ``LINKS`` and paths of TOML files
    (``*.toml``: every link of their ``[links.<name>]`` tables); ``None``: every named link; ``"none"``:
    no link. Errors name the bad item and what is allowed."""
    if spec is None:
        return list(LINKS.values())
    items = [s.strip() for part in ([spec] if isinstance(spec, str) else spec) for s in part.split(",")]
    items = [s for s in items if s]
    if items == ["none"]:
        return []
    if not items:
        raise ValueError(f"--network names no link; known: {', '.join(LINKS)}, a .toml file of [links.<name>] "
                         "tables, or none")
    out: dict[str, Link] = {}
    for item in items:
        if item.endswith(".toml"):
            found = read_links(item)
        elif item in LINKS:
            found = [LINKS[item]]
        else:
            raise ValueError(f"unknown network {item!r}: known {', '.join(LINKS)}, a .toml file of [links.<name>] "
                             "tables, or none")
        for link in found:
            if link.name in out and out[link.name] != link:
                raise ValueError(f"network {link.name!r} is defined twice, differently ({item})")
            out[link.name] = link
    return list(out.values())


def read_links(path: str | Path) -> list[Link]:
    """The links of a TOML file: ``[links.<name>]`` tables with ``down-mbps``, ``up-mbps`` (Mbit/s,
    > 0) and ``latency-ms`` (>= 0), nothing else."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"network file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"network file {path} is not valid TOML: {exc}") from None
    extra = sorted(set(data) - {"links"})
    tables = data.get("links")
    if extra or not isinstance(tables, dict) or not tables:
        raise ValueError(f"network file {path}: expected only [links.<name>] tables with "
                         f"{', '.join(TOML_KEYS)}" + (f"; found {extra}" if extra else ""))
    out = []
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ValueError(f"network file {path}: links.{name} must be a table of {', '.join(TOML_KEYS)}")
        missing, unknown = sorted(set(TOML_KEYS) - set(table)), sorted(set(table) - set(TOML_KEYS))
        if missing or unknown:
            raise ValueError(f"network file {path}: links.{name} needs exactly {', '.join(TOML_KEYS)}"
                             + (f"; missing {missing}" if missing else "") + (f"; unknown {unknown}" if unknown else ""))
        values = {}
        for key, (field_name, scale) in TOML_KEYS.items():
            v = table[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"network file {path}: links.{name}.{key} must be a number, got {v!r}")
            values[field_name] = float(v) * scale
        try:
            out.append(Link(name, note=f"from {path.name}", **values))
        except ValueError as exc:
            raise ValueError(f"network file {path}: {exc}") from None
    return out
