"""An in-process Flower Grid: the real ServerApp and ClientApp objects, no SuperLink.

Messages built by a strategy are handed straight to ``client_app(message, context)`` of
the node they are addressed to; an exception in the ClientApp becomes an error reply, as
a SuperNode would send. Nodes carry ``partition-id`` / ``num-partitions`` in their node
config, like simulated SuperNodes. Clients run one after another in this process, so a
run costs only its computation: used by the offline demo (``simulations.demo``) and by
fast end-to-end and parity tests. ``run_in_process(run_config)`` runs this project's
ServerApp and ClientApp on such a grid; ``FaultyGrid`` fails chosen clients in chosen rounds
(the in-process twin of a deployment's faults: ``simulations.replay``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

_RUN_IDS = itertools.count(1)


class LoopbackGrid(Grid):
    def __init__(self, client_app, run_config: dict, num_nodes: int, num_partitions: int | None = None,
                 node_configs: list[dict] | None = None) -> None:
        self.client_app = client_app
        self.run_config = dict(run_config)
        configs = node_configs or [
            {"partition-id": i, "num-partitions": num_partitions or num_nodes} for i in range(num_nodes)
        ]
        self.nodes = {1000 + i: cfg for i, cfg in enumerate(configs)}
        self._run = Run.create_empty(next(_RUN_IDS))
        TaskIdentity.run_id = self._run.run_id  # what a running ServerApp process has set
        TaskIdentity.node_id = 0
        TaskIdentity.task_id = 0
        self._replies: dict[str, Message] = {}
        self.contexts: dict[int, Context] = {}  # one per node for the whole run, as a SuperNode keeps it
        self.sent: list[Message] = []

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def _deliver(self, msg: Message) -> Message:
        msg.metadata.__dict__["_message_id"] = str(uuid4())
        msg.metadata.__dict__["_run_id"] = self._run.run_id
        node = msg.metadata.dst_node_id
        context = self.contexts.get(node)
        if context is None:
            context = self.contexts[node] = Context(run_id=self._run.run_id, node_id=node,
                                                    node_config=dict(self.nodes[node]), state=RecordDict(),
                                                    run_config=dict(self.run_config))
        try:
            reply = self.client_app(msg, context)
        except Exception as exc:  # what a SuperNode reports for a failing ClientApp
            reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
        reply.metadata.__dict__["_src_node_id"] = node
        return reply

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            self.sent.append(msg)
            reply = self._deliver(msg)
            ids.append(msg.metadata.message_id)
            self._replies[msg.metadata.message_id] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return list(self.pull_messages(self.push_messages(messages)))


class FaultyGrid(LoopbackGrid):
    """Loopback grid where partition p fails in the rounds ``failures[p]``: its train reply is
    an error (a crashed ClientApp) or, with ``silent``, never comes (a dead or hung host); and,
    in the rounds ``offline[p]``, its node is not online when the round starts (not asked)."""

    def __init__(self, *args, failures: dict[int, set[int]], silent: bool = False,
                 offline: dict[int, set[int]] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failures = failures
        self.silent = silent
        self.offline = offline or {}  # partition p's node is not online when the rounds offline[p] start
        self._round = 0  # the last round whose train messages were pushed

    def get_node_ids(self) -> Iterable[int]:
        """The nodes online for the next round: a node offline when a round starts is not asked at
        all (the server then expects one client fewer: its uniform weights are 1/expected)."""
        upcoming = self._round + 1
        return [n for n in super().get_node_ids()
                if upcoming not in self.offline.get(self.nodes[n].get("partition-id"), ())]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            self.sent.append(msg)
            if msg.metadata.message_type == "train":
                self._round = max(self._round, int(msg.content["config"]["server-round"]))
            pid = self.nodes[msg.metadata.dst_node_id].get("partition-id")
            if msg.metadata.message_type == "train" and \
                    int(msg.content["config"]["server-round"]) in self.failures.get(pid, ()):
                msg.metadata.__dict__["_message_id"] = str(uuid4())
                if not self.silent:
                    reply = Message(Error(code=0, reason="ClientApp crashed"), reply_to=msg)
                    reply.metadata.__dict__["_src_node_id"] = msg.metadata.dst_node_id
                    self._replies[msg.metadata.message_id] = reply
            else:
                reply = self._deliver(msg)  # sets the message id
                self._replies[msg.metadata.message_id] = reply
            ids.append(msg.metadata.message_id)
        return ids


def run_server_app(server_app, grid: LoopbackGrid) -> None:
    """Run a ServerApp's main against the grid with the grid's run config."""
    context = Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(),
                      run_config=dict(grid.run_config))
    server_app(grid, context)


def run_in_process(run_config: dict, num_nodes: int | None = None) -> None:
    """Run this project's ServerApp with ``num_nodes`` (default: num-clients, 8 for 0) ClientApps
    in this process; ``run_config`` holds run-config keys (missing ones take the defaults)."""
    from client.app import app as client_app
    from server.app import app as server_app
    from tasks.config import RunConfig

    cfg = {**RunConfig().to_mapping(), **run_config}
    nodes = num_nodes or RunConfig.from_mapping(cfg).with_clients(None).num_clients
    run_server_app(server_app, LoopbackGrid(client_app, cfg, nodes))
