"""Fault tolerance on the server side: a Grid that records who failed and never waits forever.

A client host that dies or hangs mid-round must not stop the run. ``WatchedGrid`` wraps the
Grid a ServerApp receives and is what the strategy talks to:

* ``send_and_receive`` pushes a round's messages with TTL = the round timeout (a node that
  comes back later does not work through rounds that are over), collects replies until all
  arrived or the timeout passed, and records every destination without a sound reply --
  an error reply (the ClientApp raised, or the SuperLink reports the node unavailable) or
  none within the timeout -- as failed, with the reason. Replies come back sorted by
  partition id, so the strategy's floating-point mean does not depend on arrival order.
* ``get_node_ids`` raises ``NotEnoughNodes`` once the online nodes have served fewer than
  ``min_clients`` clients for ``node_wait`` seconds (Flower's ``sample_nodes`` would otherwise
  wait forever).
* ``take_failures()`` returns and clears what failed since the last call, with nodes named
  by partition id where known (from the federation check or from their train replies), so a
  node that rejoins under a new node id is still "partition 1".

Membership (``expect``): the federation found by the ServerApp's check before round 1 --
each node with ONE distinct partition id -- is the run's membership; with fewer nodes than
clients a node serves several (``clients_of``: every ``spread``-th client from its partition
id, ``strategies.core.client_sampling.node_clients``), and failures, answers and rejections are
recorded per client (a message to such a node names its clients in its config). Only members are
offered to the strategy (``get_node_ids``); a node that connects later is asked for its
partition and admitted only to take over the partition of a member that is offline (a
restarted host with a new node id), otherwise ignored. A train reply that names another
partition than its node's, or echoes another ``server-round`` than the round it answers, is
rejected before the strategy sees it: recorded with the reason and counted
(``take_rejected``), like a failed node. ``min-replies`` therefore counts distinct partitions.
Under partial participation ``expect_round`` narrows who should answer to the round's
sampled partitions: a member that was not sampled is not offline.

Whether a round with failures may proceed (``min-replies``) is decided by the ServerApp.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable
from logging import WARNING

from flwr.app import Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore import log
from flwr.supercore.run import Run

from strategies.core.client_sampling import node_clients
from strategies.flower_api.wire import CLIENTS_KEY
from tasks.runs import stamps

#: the longest wait between two pulls of a round's replies (seconds); after a reply, the next
#: pull comes after ``FIRST_WAIT``, doubling while nothing arrives (measured in simulation,
#: from a ClientApp's end to the server holding its reply: 0.076 s a round with a 0.2 s cap,
#: 0.027 s with 0.05 s; a fixed 0.5 s wait cost 0.28 s a round)
POLL = 0.05
FIRST_WAIT = 0.005


#: seconds before the ServerApp asks the SuperLink again for an object of a reply that is not
#: stored yet (doubling up to ``OBJECT_RETRY_CAP``); Flower 1.42's HttpGrid waits 1 s
#: (``PULL_INITIAL_BACKOFF``), doubling up to 10 s. A large reply's objects arrive over seconds:
#: with a 1 s cap the last retry came up to 1 s after they were all stored (measured on a 85 MB
#: model, 2026-12-04); at 0.1 s a retry is a small request 10 times a second per pulling thread.
OBJECT_RETRY = 0.02
OBJECT_RETRY_CAP = 0.1
#: tries per object: about as long as Flower's own bound (500 tries at its backoff) before the pull fails
OBJECT_TRIES = 5000


def quick_object_pulls() -> None:
    """Make Flower 1.42's ``HttpGrid`` retry an unavailable object after ``OBJECT_RETRY`` s.

    A SuperNode sends a reply's message before its objects, and the ServerApp's next pull can
    find the message with its objects still on their way: ``HttpGrid.pull_messages`` then waits
    Flower's first backoff, 1 s, whatever remains to arrive (measured on a deployed round: the
    reply reached the ServerApp 1-2 s after the ClientApp pushed it). Flower has no setting for
    it; this swaps the ``pull_objects`` that ``flwr.superlink.grid.http_grid`` calls for the same
    function with a short first backoff and cap (``OBJECT_RETRY``, ``OBJECT_RETRY_CAP``), in this
    ServerApp process only (deployment; simulation pulls from memory). It fails loudly if a Flower
    version moves the function."""
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.superlink.grid import http_grid

    current = http_grid.pull_objects
    if getattr(current, "keywords", {}).get("initial_backoff") == OBJECT_RETRY:
        return
    if current is not inflatable_utils.pull_objects:
        raise RuntimeError("flwr.superlink.grid.http_grid.pull_objects is not Flower 1.42's pull_objects: "
                           "quick_object_pulls needs revisiting for this Flower version")
    http_grid.pull_objects = functools.partial(inflatable_utils.pull_objects, initial_backoff=OBJECT_RETRY,
                                               backoff_cap=OBJECT_RETRY_CAP, max_tries_per_object=OBJECT_TRIES)


class NotEnoughNodes(RuntimeError):
    """Fewer nodes than a round needs stayed online for longer than node-wait."""


class WatchedGrid(Grid):
    """Delegating Grid with per-round failure records, message TTL and bounded node waits."""

    def __init__(self, grid: Grid, *, min_clients: int, node_wait: float, poll: float = POLL) -> None:
        if min_clients < 1 or node_wait <= 0 or poll <= 0:
            raise ValueError(f"min_clients >= 1, node_wait > 0 and poll > 0 required, got {min_clients}, {node_wait}, "
                             f"{poll}")
        self.inner = grid
        if type(grid).__name__ == "HttpGrid":  # deployment: replies' objects retried quickly
            quick_object_pulls()
        self.min_clients = min_clients
        self.spread: int | None = None  # nodes of the federation (None: one client per node)
        self.num_clients: int | None = None
        self.node_wait = node_wait
        self.poll = poll
        self.partition_of: dict[int, int] = {}  # node id -> partition id
        self.claims: dict[int, object] = {}  # node id -> its query answer (server.federation.Claim): memory, host
        self.expected: set[int | str] = set()  # who should answer every round (see expect)
        self.members: set[int] | None = None  # node ids of the federation (None: not fixed yet)
        self.round_expected: set[int | str] | None = None  # this round's sampled partitions (None: all expected)
        self._strangers: set[int] = set()  # later nodes refused membership (asked once)
        self._rejected = 0
        self._failures: dict[int | str, str] = {}  # partition id (or "node <id>") -> reason
        self._answered: set[int | str] = set()
        self._short_since: float | None = None

    # --- delegation -----------------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self.inner.set_run(run)

    @property
    def run(self) -> Run:
        return self.inner.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    # --- watched behaviour ------------------------------------------------------------
    def get_node_ids(self) -> Iterable[int]:
        nodes = self._members_online(list(self.inner.get_node_ids()))
        if sum(len(self.clients_of(n)) for n in nodes) >= self.min_clients:
            self._short_since = None
            return nodes
        now = time.monotonic()
        if self._short_since is None:
            self._short_since = now
        elif now - self._short_since > self.node_wait:
            raise NotEnoughNodes(
                f"only {len(nodes)} node(s) online for {self.node_wait:g} s (node-wait), serving "
                f"{sum(len(self.clients_of(n)) for n in nodes)} client(s); a round needs {self.min_clients} (min-replies); "
                f"failed so far: {self.describe(self._failures) or 'none'}"
            )
        return nodes

    def expect(self, nodes: Iterable[int], num_clients: int | None = None, spread: int | None = None) -> None:
        """The federation: these nodes are the members; with ``spread`` (the federation's nodes,
        fewer than ``num_clients``) each serves several clients. Every client (if all nodes have
        partition ids, clients 0..num_clients-1) should answer every round; a round without one
        of them records it as failed."""
        nodes = list(nodes)
        self.members = set(nodes)
        self.num_clients = num_clients
        self.spread = spread if spread is not None and num_clients is not None and spread < num_clients else None
        self.expected = {c for n in nodes for c in self.clients_of(n)}
        if num_clients and all(isinstance(x, int) for x in self.expected):
            self.expected |= set(range(num_clients))

    def exclude(self, node: int, reason: str) -> None:
        """A node left out of the federation (its query answer was malformed or conflicting):
        never asked or trained again; ``reason`` goes into the next round's failures."""
        self._strangers.add(node)
        self._fail(node, reason)

    def clients_of(self, node_id: int) -> list[int | str]:
        """The clients a node serves: its partition id (or "node <id>" when unknown), or with
        fewer nodes than clients every ``spread``-th client from it."""
        pid = self.partition_of.get(node_id)
        if pid is None or self.spread is None:
            return [self.label(node_id)]
        return list(node_clients(pid, self.spread, self.num_clients))

    def expect_round(self, partitions: Iterable[int]) -> None:
        """Only these partitions are expected to answer the coming round (partial participation)."""
        self.round_expected = set(partitions)

    def _members_online(self, online: list[int]) -> list[int]:
        """The online members; a new node may take over the partition of an offline member."""
        if self.members is None:
            return online
        fresh = [n for n in online if n not in self.members and n not in self._strangers]
        if fresh:
            self._admit(fresh, set(online))
        return [n for n in online if n in self.members]

    def _admit(self, fresh: list[int], online: set[int]) -> None:
        queries = [self.inner.create_message(RecordDict(), MessageType.QUERY, n, "membership") for n in fresh]
        for reply in self.inner.send_and_receive(queries, timeout=self.node_wait):
            node = reply.metadata.src_node_id
            info = {} if reply.has_error() else next(iter(reply.content.metric_records.values()), {})
            pid = info.get("partition-id")
            holders = [m for m in self.members if self.partition_of.get(m) == pid]
            if isinstance(pid, int) and not isinstance(pid, bool) and holders and not set(holders) & online:
                for old in holders:
                    self.members.discard(old)
                self.members.add(node)
                self.partition_of[node] = pid
                log(WARNING, "node %d takes over partition %d from offline node %s", node, pid, holders)
            else:
                self._strangers.add(node)
                why = "its partition's member is online" if holders else "it is not a member of this run's federation"
                log(WARNING, "node %d (claims partition-id %r) is ignored: %s", node, pid, why)
        self._strangers.update(n for n in fresh if n not in self.members)

    def label(self, node_id: int) -> int | str:
        """The node's partition id when known, else "node <id>"."""
        pid = self.partition_of.get(node_id)
        return pid if pid is not None else f"node {node_id}"

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        if not messages:
            return []
        if timeout is not None:
            for msg in messages:
                msg.metadata.ttl = float(timeout)
        dst = [m.metadata.dst_node_id for m in messages]
        stamps.mark("push", round=_round_of(messages[0]), messages=len(messages))
        if stamps.enabled():  # what each node was sent, to compare a deployed run with its replay message by message
            for msg in messages:
                stamps.mark("sent", round=_round_of(msg), to=self.label(msg.metadata.dst_node_id), digest=_digest(msg))
        ids = list(self.inner.push_messages(messages))
        stamps.mark("pushed", round=_round_of(messages[0]))
        pending = {mid: node for mid, node in zip(ids, dst, strict=True) if mid}
        sent_round = {mid: _round_of(m) for mid, m in zip(ids, messages, strict=True) if mid}
        named = {mid: _clients_of(m) for mid, m in zip(ids, messages, strict=True) if mid}
        for mid, node, msg in zip(ids, dst, messages, strict=True):
            if not mid:
                self._fail(node, "the SuperLink did not accept the message", _clients_of(msg))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[tuple[int, Message]] = []
        wait = FIRST_WAIT
        while pending:
            got = False
            for reply in self.inner.pull_messages(list(pending)):
                mid = reply.metadata.reply_to_message_id
                node = pending.pop(mid, None)
                if node is None:
                    continue
                stamps.mark("reply", node=node)
                if stamps.enabled():
                    stamps.mark("received", round=sent_round.get(mid), frm=self.label(node), digest=_digest(reply))
                got, clients = True, named.get(mid)
                if reply.has_error():
                    self._fail(node, self._reason(reply, timeout), clients)
                    replies.append((node, reply))
                    continue
                why = self._unsound(node, reply, sent_round.get(mid), clients)
                if why:
                    self._rejected += len(clients) if clients else 1
                    self._fail(node, f"rejected, {why}", clients)
                    continue
                self._learn(node, reply)
                self._answered.update(clients if clients else [self.label(node)])
                replies.append((node, reply))
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            # pull again soon after a reply (the others follow), then back off up to ``poll``
            wait = FIRST_WAIT if got else min(2 * wait, self.poll)
            time.sleep(wait if deadline is None else max(0.0, min(wait, deadline - time.monotonic())))
        for mid, node in pending.items():
            self._fail(node, f"no reply within round-timeout ({timeout:g} s)", named.get(mid))
        # Canonical order (partition id, then node id), not arrival order: a floating-point
        # mean of 3+ clients depends on the order of its terms, and a run must not.
        replies.sort(key=lambda nr: (nr[0] not in self.partition_of, self.partition_of.get(nr[0], 0), nr[0]))
        return [reply for _, reply in replies]

    def take_rejected(self) -> int:
        """Replies rejected for membership or round since the last call (and reset)."""
        out, self._rejected = self._rejected, 0
        return out

    def _unsound(self, node: int, reply: Message, server_round: int | None, clients: list[int] | None = None
                 ) -> str | None:
        """Why a reply breaks membership or the round, or None (``clients``: those the message
        named, for a multi-client node)."""
        if self.members is not None and node not in self.members:
            return f"node {node} is not a member of the federation"
        for name, record in reply.content.metric_records.items():
            pid = record.get("partition-id")
            if clients is not None:
                if pid is not None and (pid not in clients or name != f"metrics.{pid}"):
                    return f"spoofed partition-id {pid!r} in {name!r} (the message named clients {clients})"
            elif pid is not None and node in self.partition_of and pid != self.partition_of[node]:
                return f"spoofed partition-id {pid!r} (the node holds partition {self.partition_of[node]})"
            echoed = record.get("server-round")
            if echoed is not None and server_round is not None and echoed != server_round:
                return f"stale reply: server-round {echoed!r} in a reply to round {server_round}"
        return None

    def take_failures(self) -> dict[int | str, str]:
        """{partition id or "node <id>": reason} since the last call (and forget them),
        including expected members that were not online to be sent anything."""
        expected = self.expected if self.round_expected is None else self.round_expected
        for label in sorted(expected - self._answered - set(self._failures), key=str):
            self._failures[label] = "offline (not online when the round started)"
        out, self._failures, self._answered = self._failures, {}, set()
        self.round_expected = None
        return out

    def relabel(self, line: str) -> str:
        """A strategy's "node <id>: ..." line with the node named by its partition when known."""
        head, sep, rest = line.partition(": ")
        if sep and head.startswith("node ") and head[5:].isdigit():
            return f"{_name(self.label(int(head[5:])))}: {rest}"
        return line

    @staticmethod
    def describe(failures: dict[int | str, str]) -> str:
        return "; ".join(f"{_name(k)}: {reason}" for k, reason in failures.items())

    def _fail(self, node: int, reason: str, clients: list[int] | None = None) -> None:
        """Record every client of the message as failed (its node's own label for one client)."""
        for label in clients if clients else [self.label(node)]:
            self._failures[label] = reason
            log(WARNING, "%s failed: %s", _name(label), reason)

    @staticmethod
    def _reason(reply: Message, timeout: float | None) -> str:
        code = reply.error.code
        if code in (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE):  # expired (TTL)
            return f"no reply within round-timeout ({timeout:g} s)" if timeout is not None else "message expired"
        if code == ErrorCode.NODE_UNAVAILABLE:
            return "node unavailable (it missed its heartbeats)"
        return reply.error.reason or f"error code {code}"

    def _learn(self, node: int, reply: Message) -> None:
        if node in self.partition_of:
            return  # membership is fixed: a reply never moves a node to another partition
        for record in reply.content.metric_records.values():
            pid = record.get("partition-id")
            if isinstance(pid, int) and not isinstance(pid, bool):
                self.partition_of[node] = pid
                return


def _clients_of(msg: Message) -> list[int] | None:
    """The clients a message to a multi-client node names (``strategies.flower_api.wire.CLIENTS_KEY``), or None."""
    for record in msg.content.config_records.values():
        value = record.get(CLIENTS_KEY)
        if isinstance(value, list):
            return [int(v) for v in value]
    return None


def _digest(msg: Message) -> str:
    """SHA-256 over the bytes of every array a message carries (its error, if it is one)."""
    import hashlib

    h = hashlib.sha256()
    if msg.has_error():
        h.update(str(msg.error.reason).encode())
        return h.hexdigest()[:16]
    for name, record in sorted(msg.content.array_records.items()):
        for key, array in record.items():
            h.update(f"{name}/{key}".encode())
            h.update(array.data)
    return h.hexdigest()[:16]


def _round_of(msg: Message) -> int | None:
    for record in msg.content.config_records.values():
        value = record.get("server-round")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _name(label: int | str) -> str:
    return f"partition {label}" if isinstance(label, int) else label
