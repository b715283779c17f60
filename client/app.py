"""The ClientApp: a Flower Message in, the method's client side for this node's client, a Message out.

Thin by design: it reads the node's ``partition-id`` / ``num-partitions`` (or its
``local-data`` directory: the host's own data, see ``client.local_data``), the run config
and the exchange the message carries (``strategies.wire.exchange_of``), and hands them to
``client_round`` -- the client side of the method that answers the exchange's mode, on the
same executor as the engine's clients. A stateful task's per-client state (the language
model's hidden state and place in its text) and a method's own per-client state (SCAFFOLD's
control variate) live in the node's ``Context.state`` (ArrayRecords per partition id), which
Flower keeps for the node from round to round in simulation and deployment; a restarted
SuperNode starts from an empty state (``client-state = "reset"``: no task state at all).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from strategies.algorithms import answering
from strategies.clientapp import round_settings
from strategies.wire import exchange_of, reply_of
from tasks import cached_task, partitions
from tasks.config import RunConfig
from tasks.device import pick_device
from tasks.protocol import is_stateful, state_to_cpu

from .local_data import local_data
from .local_round import client_round

app = ClientApp()


def state_key(pid: int) -> str:
    """Where this node keeps partition ``pid``'s client state in ``Context.state``."""
    return f"client-state.{pid}"


def load_client_state(context: Context, cfg: RunConfig, pid: int, task: object) -> dict | None:
    """The client state kept in this node's ``Context.state`` (empty: none yet, e.g. after a
    restart of the SuperNode), or None when the round is stateless (``client-state = "reset"``
    or a task without state)."""
    if cfg.client_state != "keep" or not is_stateful(task):
        return None
    record = context.state.get(state_key(pid))
    return dict(record.to_torch_state_dict()) if isinstance(record, ArrayRecord) else {}


def keep_client_state(context: Context, pid: int, client_state: dict | None) -> None:
    if client_state is not None:
        context.state[state_key(pid)] = ArrayRecord(state_to_cpu(client_state))


def memory_key(pid: int) -> str:
    """Where this node keeps partition ``pid``'s method state (e.g. SCAFFOLD's c_i) in ``Context.state``."""
    return f"method-state.{pid}"


def load_memory(context: Context, pid: int) -> dict:
    record = context.state.get(memory_key(pid))
    return dict(record.to_torch_state_dict()) if isinstance(record, ArrayRecord) else {}


def run_config(context: Context) -> RunConfig:
    """The run config; num-clients = 0 (follow the federation) becomes this node's num-partitions."""
    cfg = RunConfig.from_mapping(dict(context.run_config))
    num = context.node_config.get("num-partitions")
    return cfg.with_clients(num) if isinstance(num, int) and not isinstance(num, bool) else cfg


def node_partition(context: Context, cfg: RunConfig) -> int:
    """This node's partition id, checked against the run's num-clients."""
    nc = context.node_config
    if not cfg.num_clients:
        raise ValueError("num-clients=0 follows the federation's num-partitions, which this node's config lacks: start "
                         "the SuperNode with --node-config \"partition-id=i num-partitions=N\" or set num-clients=N")
    if "partition-id" not in nc:
        raise ValueError(
            "node config has no partition-id: start the SuperNode with "
            f"--node-config \"partition-id=<0..{cfg.num_clients - 1}> num-partitions={cfg.num_clients}\""
        )
    pid = nc["partition-id"]
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise ValueError(f"partition-id must be an integer, got {pid!r}")
    num = nc.get("num-partitions", cfg.num_clients)
    if num != cfg.num_clients:
        raise ValueError(
            f"the federation has num-partitions={num} but the run asks for num-clients={cfg.num_clients}: "
            f"in simulation run with --federation-config \"num-supernodes={cfg.num_clients}\" "
            f"(or set num-clients={num}); in deployment start {cfg.num_clients} SuperNodes with "
            f"--node-config \"partition-id=i num-partitions={cfg.num_clients}\""
        )
    if not (0 <= pid < cfg.num_clients):
        raise ValueError(f"partition-id must be in [0, {cfg.num_clients - 1}], got {pid}")
    return pid


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = run_config(context)
    local = local_data(context.node_config, cfg)  # the host's own data (node config local-data)
    pid = local.sampling_id if local else node_partition(context, cfg)
    data = (local.task, local.indices) if local else None
    settings = round_settings(msg)  # an error naming every missing key when another strategy drives this app
    exchange = exchange_of(msg, settings)
    client_state = load_client_state(context, cfg, pid, local.task if local else cached_task(cfg))
    memory = load_memory(context, pid) if answering(settings.mode).keeps_client_memory else None
    results = client_round(cfg, pid, exchange, data, client_state, memory)
    keep_client_state(context, pid, client_state)
    if memory is not None:
        context.state[memory_key(pid)] = ArrayRecord(state_to_cpu(memory))
    extra = {"partition-id": pid} if not local or local.partition_id is not None else {}
    extra["server-round"] = settings.server_round  # echoed: the server rejects a reply to another round
    return reply_of(msg, results, extra)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Loss and accuracy of the received model on this client's own partition."""
    cfg = run_config(context)
    local = local_data(context.node_config, cfg)
    task, idx = (local.task, local.indices) if local else (cached_task(cfg), partitions(cfg)[node_partition(context, cfg)])
    device = pick_device(cfg.device)
    model = task.build_model().to(device)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    metrics = task.evaluate_indices(model, device, idx)
    metrics["num-examples"] = len(idx)
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's partition settings, so the server can check the federation."""
    nc = context.node_config
    info = {k: nc[k] for k in ("partition-id", "num-partitions") if isinstance(nc.get(k), int)}
    return Message(content=RecordDict({"node": MetricRecord(info)}), reply_to=msg)
