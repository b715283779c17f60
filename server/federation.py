"""Who is in the federation: the nodes' answers to the query before round 1, read and decided.

Every connected node is asked for its ``partition-id`` / ``num-partitions`` (node config) and
``own-data``. A registered node can answer anything, so an answer is read field by field
(``read_claim``: integers, not bools, in range -- NaN, inf, a list, a string or a float is a
reason, never an exception) and the federation is decided from all answers (``decide``):

* its size K is the ``num-partitions`` most nodes report (a tie: the one reported first);
  none reported: num-clients. A node reporting another K is excluded;
* each partition is held by the first node that claimed it (in the order the answers came);
  a later claimant is excluded. So a liar that answers first can take a partition: its replies
  are then checked like any node's, and the honest holder is excluded and named;
* a ``partition-id`` outside 0..K-1, or none (except a host with its own data, which is one
  anonymous client), excludes the node.

An excluded node is never sent a train message; the ServerApp records why (round 1's
``failures``) and starts without it while ``min-replies`` can be met. Only a federation that
cannot start at all is an error (``FederationError`` in ``server.app``, with the fix). A
majority K above num-clients is the operator's misconfiguration and stops the run at once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Claim:
    """A node's answer, read: its partition id and federation size (None: not given)."""

    pid: int | None = None
    num: int | None = None
    own_data: bool = False
    memory: int | None = None  # bytes its host has available (``tasks.host``), for the memory check
    host: int | None = None  # its host's id: nodes of one host share its memory


@dataclass
class Federation:
    """The decided federation: K, each member's partition, the excluded nodes and why."""

    size: int
    partition_of: dict[int, int] = field(default_factory=dict)
    anonymous: list[int] = field(default_factory=list)  # hosts with their own data and no partition id
    excluded: dict[int, str] = field(default_factory=dict)
    reported_size: bool = False  # some node reported num-partitions

    @property
    def members(self) -> list[int]:
        return sorted([*self.partition_of, *self.anonymous])


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return repr(value)


def read_claim(info: Mapping[str, Any]) -> Claim | str:
    """A node's query answer as a ``Claim``, or the reason it cannot be one."""
    num, pid = info.get("num-partitions"), info.get("partition-id")
    if num is not None and not (_int(num) and num >= 1):
        return f"num-partitions={_shown(num)} is not an integer >= 1"
    if pid is not None and not (_int(pid) and pid >= 0):
        return f"partition-id={_shown(pid)} is not an integer >= 0"
    if pid is not None and num is not None and pid >= num:
        return f"partition-id={pid} is not below its num-partitions={num}"
    memory, host = info.get("memory-available"), info.get("host")
    memory = memory if _int(memory) and memory > 0 else None  # a node's own business: a wrong value is ignored
    host = host if _int(host) and host >= 0 else None
    return Claim(pid, num, info.get("own-data") == 1, memory, host)


NO_PARTITION = ("node config has no partition-id: start every SuperNode with --node-config \"partition-id=i "
                "num-partitions=K\" (K nodes, i = 0..K-1, K <= num-clients={num_clients})")


def decide(claims: Mapping[int, Claim | str], num_clients: int) -> Federation:
    """The federation of the answers ``claims`` (node -> its claim or the reason it was
    unreadable, in the order the answers came)."""
    sizes = Counter(c.num for c in claims.values() if isinstance(c, Claim) and c.num is not None)
    order = [c.num for c in claims.values() if isinstance(c, Claim) and c.num is not None]
    size = max(sizes, key=lambda k: (sizes[k], -order.index(k))) if sizes else num_clients
    fed = Federation(size, reported_size=bool(sizes))
    for node, claim in claims.items():
        if isinstance(claim, str):
            fed.excluded[node] = claim
        elif claim.num is not None and claim.num != size:
            fed.excluded[node] = (f"num-partitions={claim.num} differs from the federation's {size} (what "
                                  f"{sizes[size]} of {sum(sizes.values())} nodes report)")
        elif claim.pid is None:
            if claim.own_data and claim.num is None:
                fed.anonymous.append(node)  # a host with its own data: one client, seeded by its data
            else:
                fed.excluded[node] = NO_PARTITION.format(num_clients=num_clients)
        elif claim.pid >= size:
            fed.excluded[node] = f"partition-id={claim.pid} is outside the federation's 0..{size - 1}"
        else:
            holder = next((n for n, p in fed.partition_of.items() if p == claim.pid), None)
            if holder is not None:
                fed.excluded[node] = (f"nodes {holder} and {node} both claim partition-id={claim.pid}: give every "
                                      f"SuperNode its own --node-config \"partition-id=i num-partitions={size}\" "
                                      f"(i = 0..{size - 1}); node {holder} answered first and keeps it")
            else:
                fed.partition_of[node] = claim.pid
    return fed
