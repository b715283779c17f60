"""Will a round fit? The memory the message path needs on every host, checked before round 1.

A round of N clients of an M-byte model holds copies of the model in every process it crosses.
Fitted to the peaks ``benchmarks/message_path.py`` measured (docs/message-path.md: the copies each
process held for AWD-LSTM and a user's 85 MB MLP, exact and with node-aggregation and bfloat16,
each planned at or above what was measured), the message path needs, beyond each process's own
start, with ``w`` a model's bytes on the wire (M, or M/2 with a lossy transport) and ``R`` a
node's reply on the wire (its clients' models, or one with node-aggregation):

* ServerApp: ``SERVER_MODEL`` x M (the round's global model: tensors, record, packed payload,
  evaluation, float64 average) plus ``REPLY`` x each reply it holds (pulled objects, joined array,
  decoded tensors) counted in models;
* SuperLink: ``LINK_DOWN`` x w a node (the message down, pulled by each) plus ``LINK_UP`` x every reply;
* SuperNode: ``NODE_COPIES`` x (w + R) plus w;
* ClientApp: ``CLIENT_MODEL`` x M a client (the executor's model, gradients and a step's temporaries)
  plus 2 x (w + R). Training activations beyond that are the task's: not counted.

Nodes report their host's available memory and its id in the federation check
(``tasks.host``); processes of one host (network namespaces included) share one budget. A round
whose need exceeds a host's budget is refused before round 1 with the model's size, the need of
each process and the host's budget, and what would fit: node-aggregation, a lossy transport,
fewer clients a round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import INFO
from typing import Any

from flwr.supercore import log

from tasks.host import available_memory, host_id

#: model copies each process holds (see the module docstring)
SERVER_MODEL = 12
REPLY = 3
LINK_DOWN = 4
LINK_UP = 2.5
NODE_COPIES = 4
CLIENT_MODEL = 4


class MemoryPlanError(RuntimeError):
    """A round would need more memory than a host has."""


@dataclass(frozen=True)
class Need:
    process: str
    host: object  # a host id (``tasks.host.host_id``), or a name standing for an unknown host
    bytes: int
    why: str


def wire_bytes(model_bytes: int, transport: str) -> int:
    """A model's bytes in a message: half for bfloat16 / float16 (the trainable parameters)."""
    return model_bytes if transport == "float32" else model_bytes // 2


def needs(model_bytes: int, node_clients: Mapping[int, int], *, node_sums: bool, transport: str,
          server_host: int | None, node_host: Mapping[int, int | None]) -> list[Need]:
    """What each process of a round needs (``node_clients``: node -> its clients in a round)."""
    m = model_bytes
    w = wire_bytes(m, transport)

    def reply(c: int) -> int:
        return w if node_sums and c > 1 else c * w

    server = server_host if server_host is not None else "the server"
    held = sum((m if node_sums and c > 1 else c * m) for c in node_clients.values())
    out = [Need("ServerApp", server, SERVER_MODEL * m + REPLY * held,
                f"the global model and its float64 average ({SERVER_MODEL} x the model) and the round's replies "
                f"({REPLY} x {held / 1e6:.0f} MB: {'one sum a node' if node_sums else 'one model a client'})"),
           Need("SuperLink", server, int(LINK_DOWN * w * len(node_clients) + LINK_UP * sum(reply(c) for c in
                                                                                        node_clients.values())),
                "the message down to each node and every reply, stored and in flight")]
    for node, c in sorted(node_clients.items()):
        host = node_host.get(node)
        host = host if host is not None else f"node {node}"
        out.append(Need(f"SuperNode {node}", host, NODE_COPIES * (w + reply(c)) + w,
                        f"its message and reply ({c} client(s))"))
        out.append(Need(f"ClientApp {node}", host, CLIENT_MODEL * c * m + 2 * (w + reply(c)),
                        f"{c} client model(s), gradients and a step's temporaries, its message and reply"))
    return out


def check(model_bytes: int, node_clients: Mapping[int, int], *, node_sums: bool, transport: str,
          server_host: int | None, server_memory: int | None, node_host: Mapping[int, int | None],
          node_memory: Mapping[int, int | None], clients: int) -> list[Need]:
    """The needs (``needs``); MemoryPlanError naming the model's size, the needs and the budget where
    a host's needs exceed the memory it reports (a host that reports none is not checked)."""
    plan = needs(model_bytes, node_clients, node_sums=node_sums, transport=transport, server_host=server_host,
                 node_host=node_host)
    budget: dict[object, int] = {}
    if server_memory is not None:
        budget[server_host if server_host is not None else "the server"] = server_memory
    for node, memory in node_memory.items():
        host = node_host.get(node)
        host = host if host is not None else f"node {node}"
        if memory is not None:
            budget[host] = min(memory, budget.get(host, memory))
    by_host: dict[object, list[Need]] = {}
    for need in plan:
        by_host.setdefault(need.host, []).append(need)
    for host, items in by_host.items():
        total = sum(n.bytes for n in items)
        if host in budget and total > budget[host]:
            detail = "; ".join(f"{n.process} {n.bytes / 1e9:.2f} GB ({n.why})" for n in items)
            fits = [] if node_sums else ["node-aggregation = true (one model's bytes a node's reply)"]
            if transport == "float32":
                fits.append('transport = "bfloat16" (half the bytes, lossy)')
            fits.append(f"clients-per-round below {clients}")
            raise MemoryPlanError(
                f"refused before round 1: a round of {clients} clients of a {model_bytes / 1e6:.1f} MB model needs "
                f"about {total / 1e9:.2f} GB of memory on one host, which has {budget[host] / 1e9:.2f} GB available "
                f"(MemAvailable, or CELGC_MEMORY_LIMIT): {detail}. What fits better: {', '.join(fits)}; or a host "
                "with more memory")
    return plan


def plan_memory(cfg: Any, model_bytes: int, watched: Any, nodes: Sequence[int]) -> list[Need]:
    """``check`` for the run's federation (``watched``: its nodes' clients and query answers); logs the plan."""
    per_round = cfg.per_round or cfg.num_clients
    node_clients = {n: max(1, min(len(watched.clients_of(n)), per_round)) for n in nodes}
    claims = {n: watched.claims.get(n) for n in nodes}
    plan = check(model_bytes, node_clients, node_sums=cfg.node_aggregation, transport=cfg.transport,
                 server_host=host_id(), server_memory=available_memory(),
                 node_host={n: getattr(c, "host", None) for n, c in claims.items()},
                 node_memory={n: getattr(c, "memory", None) for n, c in claims.items()}, clients=per_round)
    total = sum(n.bytes for n in plan)
    log(INFO, "Memory: a round of %d clients of a %.1f MB model needs about %.2f GB beyond the processes' start, "
        "all hosts together (server.memory)", per_round, model_bytes / 1e6, total / 1e9)
    return plan
