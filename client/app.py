"""The ClientApp: a Flower Message in, the method's client side for this node's client, a Message out.

Thin by design: it reads the node's ``partition-id`` / ``num-partitions`` (or its
``local-data`` directory: the host's own data, see ``client.local_data``), the run config
and the exchange the message carries (``strategies.flower_api.wire.exchange_of``), and hands them to
``client_round`` -- the client side of exactly the method the round's config names
(``algorithm``; a name this node does not have is an error), on the same executor as the
engine's clients. A stateful task's per-client state (the language
model's hidden state and place in its text) and a method's own per-client state (SCAFFOLD's
control variate) live in the node's ``Context.state`` (ArrayRecords per partition id), which
Flower keeps for the node from round to round in simulation and deployment; a restarted
SuperNode starts from an empty state (``client-state = "reset"``: no task state at all).
"""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from strategies.clientapp import round_settings
from strategies.core import client_sampling
from strategies.flower_api import fast_objects
from strategies.flower_api.packing import is_packed
from strategies.flower_api.wire import NODE_SUM_KEY, arrays_of, exchange_of, reply_of, tensors
from strategies.methods import client_side
from strategies.methods.reduce import node_sums, per_client
from strategies.methods.round import GROUP_KINDS
from tasks import cached_task, partitions
from tasks.config import RunConfig
from tasks.device import pick_device
from tasks.host import available_memory, host_id
from tasks.protocol import is_stateful, state_to_cpu
from tasks.runs import stamps

from .host_share import use_host_share
from .local_data import KEY as LOCAL_DATA
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


def node_sums_asked(msg: Message, exchange, results, pids: list[int]):
    """The node's sum of its clients (``strategies.methods.reduce.node_sums``) when the message asks for
    it (``node-aggregation``: the round config's ``node-sum`` names the aggregation), else None."""
    config = next(iter(msg.content.config_records.values()), {})
    aggregation = config.get(NODE_SUM_KEY)
    if aggregation is None or len(pids) < 2 or not is_packed(msg.content):
        return None
    method = client_side(exchange.settings)
    kinds = {**GROUP_KINDS, **method.groups}
    like = {g: _like(exchange.state, kinds.get(g, "state"), results.arrays[g]) for g in results.arrays}
    reference = {g: like[g] if kinds.get(g, "state") in ("state", "buffers") else None for g in like}
    return node_sums(results, like, reference, str(aggregation))


def _like(state: dict, kind: str, arrays) -> dict:
    """A group's layout: the global state, or its entries that the clients' group holds."""
    keys = list(per_client(arrays)[0]) if kind != "state" else list(state)
    return {k: state[k] for k in keys}


#: the trainable parameters' names of a task's model, built once per task object: what a lossy transport rounds
_TRAINABLE: dict[int, tuple[object, list[str]]] = {}


def trainable_names(task: object) -> list[str]:
    kept = _TRAINABLE.get(id(task))
    if kept is None or kept[0] is not task:
        names = [k for k, p in task.build_model().named_parameters() if p.requires_grad]
        kept = _TRAINABLE[id(task)] = (task, names)
    return kept[1]


def run_config(context: Context) -> RunConfig:
    """The run config; num-clients = 0 (follow the federation) becomes this node's num-partitions."""
    cfg = RunConfig.from_app(dict(context.run_config))
    num = context.node_config.get("num-partitions")
    return cfg.with_clients(num) if isinstance(num, int) and not isinstance(num, bool) else cfg


def node_clients(context: Context, cfg: RunConfig) -> list[int]:
    """The clients (partition ids) this node serves: its ``partition-id`` when the federation
    has one node per client, every ``num-partitions``-th from it when it has fewer nodes than
    the run's num-clients (``strategies.core.client_sampling.node_clients``: 8 clients on 2 nodes, 4
    each)."""
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
    if isinstance(num, bool) or not isinstance(num, int) or not 1 <= num <= cfg.num_clients:
        raise ValueError(
            f"the federation has num-partitions={num!r} but the run asks for num-clients={cfg.num_clients}: a node "
            f"serves one or more clients, so num-partitions must be in [1, {cfg.num_clients}]; in simulation run with "
            f"--federation-config \"num-supernodes=K\" for K <= {cfg.num_clients} (or set num-clients={num}); in "
            f"deployment start K SuperNodes with --node-config \"partition-id=i num-partitions=K\""
        )
    if not (0 <= pid < num):
        raise ValueError(f"partition-id must be in [0, {num - 1}] (num-partitions={num}), got {pid}")
    return client_sampling.node_clients(pid, num, cfg.num_clients)


def node_partition(context: Context, cfg: RunConfig) -> int:
    """This node's one client (a node that serves several has no single partition)."""
    clients = node_clients(context, cfg)
    if len(clients) != 1:
        raise ValueError(f"this node serves clients {clients}, not one: the message must name the clients it runs "
                         "(the ServerApp of this project does, in the round config's 'clients')")
    return clients[0]


@app.train()
def train(msg: Message, context: Context) -> Message:
    fast_objects.install()  # this process's reply (and later messages): fewer copies, one hash a chunk
    use_host_share(context)  # deployed: torch threads = this node's share of the host's cores
    stamps.mark("train-start", round=msg.metadata.group_id)
    cfg = run_config(context)
    local = local_data(context.node_config, cfg)  # the host's own data (node config local-data)
    settings = round_settings(msg)  # an error naming every missing key when another strategy drives this app
    exchange = exchange_of(msg, settings)
    multi = exchange.clients != [-1]  # the message names its clients: this node may serve several
    if local:
        pids = [local.sampling_id]
        if multi and exchange.clients != pids:
            raise ValueError(f"this node (own data) is client {local.sampling_id}, the message names {exchange.clients}")
    elif multi:
        serves = node_clients(context, cfg)
        strays = sorted(set(exchange.clients) - set(serves))
        if strays:
            raise ValueError(f"the message names clients {strays}, which this node does not serve (it serves {serves})")
        pids = list(exchange.clients)
    else:
        pids = [node_partition(context, cfg)]
    exchange.clients = pids
    data = (local.task, local.indices) if local else None
    task = local.task if local else cached_task(cfg)
    states = [load_client_state(context, cfg, pid, task) for pid in pids]
    keeps = client_side(settings).keeps_client_memory  # the method the round names, or a clear error
    memories = [load_memory(context, pid) if keeps else None for pid in pids]
    results = client_round(cfg, pids, exchange, data, states, memories, owned=False)  # written into the reply below
    for pid, state, memory in zip(pids, states, memories, strict=True):
        keep_client_state(context, pid, state)
        if memory is not None:
            context.state[memory_key(pid)] = ArrayRecord(state_to_cpu(memory))
    named = not local or local.partition_id is not None
    # partition-id and server-round echoed: the server rejects a reply naming another client or round
    extras = [({"partition-id": pid} if named else {}) | {"server-round": settings.server_round} for pid in pids]
    sums = node_sums_asked(msg, exchange, results, pids)
    reply = reply_of(msg, results, extras, multi=multi, packed=is_packed(msg.content),  # answered as asked
                     transport=cfg.transport, received=exchange.state, trainable=trainable_names(task), sums=sums)
    stamps.mark("train-end", round=msg.metadata.group_id)
    return reply


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Loss and accuracy of the received model on this client's own partition."""
    fast_objects.install()
    use_host_share(context)
    cfg = run_config(context)
    local = local_data(context.node_config, cfg)
    task, parts = (local.task, [local.indices]) if local else (
        cached_task(cfg), [partitions(cfg)[p] for p in node_clients(context, cfg)])
    device = pick_device(cfg.device)
    model = task.build_model().to(device)
    records, _ = arrays_of(msg.content)
    if "arrays" not in records:
        raise ValueError(f"an evaluate message carries the model as 'arrays', got {sorted(records)}")
    model.load_state_dict(tensors(records["arrays"]))
    each = [(task.evaluate_indices(model, device, idx), len(idx)) for idx in parts]
    total = sum(n for _, n in each)
    metrics = dict(each[0][0]) if len(each) == 1 else {  # a node's clients together, weighted by their examples
        k: sum(m[k] * n for m, n in each) / total for k in each[0][0]}
    metrics["num-examples"] = total
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report this node's partition settings, so the server can check the federation."""
    nc = context.node_config
    info = {k: nc[k] for k in ("partition-id", "num-partitions") if isinstance(nc.get(k), int)}
    if LOCAL_DATA in nc:  # a host with its own data: one client, which may have no partition-id
        info["own-data"] = 1
    memory, host = available_memory(), host_id()  # for the server's memory check before round 1 (server.memory)
    if memory is not None:
        info["memory-available"] = memory
    if host is not None:
        info["host"] = host
    return Message(content=RecordDict({"node": MetricRecord(info)}), reply_to=msg)
