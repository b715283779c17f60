"""Flower Messages <-> the algorithm layer's exchanges and results (the one place a reply is read).

``messages`` turns an ``Exchange`` into one train Message per client: the global arrays
(``arrayrecord_key``), the exchange's per-client ArrayRecords (``correction``, ``control``)
and the ConfigRecord (the caller's ``train_config`` plus ``RoundSettings.to_config()``) --
or, given the nodes that serve the clients (``holders``) and some node serving several, one
Message per node: the global arrays once, the config with ``clients`` (the partition ids it
runs), each client's arrays as ``<name>.<partition id>``; its reply carries ``<group>.<id>``
and ``metrics.<id>`` per client, which ``split_reply`` turns back into one reply per client
(with one client a node, the plain format to the node).
``read_reply`` parses one reply field by field into typed values -- its one MetricRecord
(``strategies.methods.replies``), its weight (``weighted_by_key``), its ArrayRecords decoded into the
groups the exchange's method expects -- or the reason to reject it; nothing here raises on
client input. ``client_results`` stacks the sound replies into the algorithm's
``ClientResults``. Client side: ``exchange_of`` reads a train Message back into an exchange and
``reply_of`` writes a client's results as the reply.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from ..core.averaging import state_nbytes
from ..core.client_metrics import table_from_records
from ..core.settings import RoundSettings
from ..methods.algorithm import Exchange
from ..methods.reduce import ClientResults, per_client
from ..methods.replies import parse_metrics
from .packing import Restore, pack_arrays, packed_content, unpack_arrays

T = TypeVar("T")


@dataclass
class Reply:
    """One reply, read: its groups of arrays, metrics and weight, or the reason it is rejected."""

    node: int
    content: RecordDict
    groups: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    metrics: dict[str, Any] | None = None
    record: MetricRecord | None = None
    weight: float = 0.0
    reason: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(state_nbytes(g) for g in self.groups.values())


#: the round-config key naming the clients (partition ids) a multi-client node runs in an exchange
CLIENTS_KEY = "clients"
#: the round-config key asking a multi-client node for its clients' sum (``node-aggregation``): the aggregation
NODE_SUM_KEY = "node-sum"
#: the suffix of a reply's record holding a group's node sum (``<group>.sum``)
SUM = "sum"

#: ``transport`` (the run config's): the dtype the model's trainable parameters travel in (None: as they are)
TRANSPORTS = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: the largest relative error of one value rounded to the transport dtype (round to nearest: half an ulp; float16
#: also rounds |x| < 6.1e-5 to its subnormals, 2**-24 apart: an absolute error the bound's slack covers)
TRANSPORT_ERROR = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}


def encode(state: Mapping[str, torch.Tensor], keys: Sequence[str] | None, transport: str,
           reference: Mapping[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Restore]]:
    """``state`` for a lossy ``transport``: its floating-point ``keys`` (the trainable parameters;
    None: every floating-point entry) rounded to the transport dtype -- as differences from
    ``reference`` where given (a reply: the update, not the parameters, is rounded) -- and how
    the reader restores them (``packing.pack_arrays``' ``restore``). Exact transport: as it is."""
    wire = TRANSPORTS[transport]
    if wire is None:
        return dict(state), {}
    chosen = set(state if keys is None else keys)
    out, restore = {}, {}
    for key, value in state.items():
        if key in chosen and value.is_floating_point() and value.dtype != wire:
            base = value.detach() if reference is None else value.detach() - reference[key].to(value.device)
            out[key] = base.to(wire)
            restore[key] = (str(value.dtype).removeprefix("torch."), reference is not None)
        else:
            out[key] = value
    return out, restore


def _arrays(state: Mapping[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: v.detach().cpu() for k, v in state.items()})


#: one record of a message's arrays before it is written: Flower's ``ArrayRecord`` or a state of tensors
Arrays = ArrayRecord | Mapping[str, torch.Tensor]


def tensors(record: Arrays) -> dict[str, torch.Tensor]:
    """A record's arrays as tensors (an ``ArrayRecord`` decoded; decoded ones as they are)."""
    return record.to_torch_state_dict() if isinstance(record, ArrayRecord) else dict(record)


def write(records: Mapping[str, Arrays], others: Mapping[str, Any], *, packed: bool,
          payload: Array | None = None, restore: Mapping[str, Mapping[str, Restore]] | None = None) -> RecordDict:
    """A message's content: its array ``records`` and its ``others`` (config, metric records) --
    ``packed``: the arrays in ONE packed record (``payload``: already packed, e.g. shared by the
    messages of an exchange; ``restore``: its lossy entries, ``encode``), others after it; plain:
    each record an ArrayRecord, in order."""
    if packed:
        return packed_content(payload if payload is not None else pack_arrays(records, restore), others)
    content = RecordDict()
    for name, record in records.items():
        content[name] = record if isinstance(record, ArrayRecord) else _arrays(record)
    for name, record in others.items():
        content[name] = record
    return content


def messages(exchange: Exchange, arrays: ArrayRecord, config: ConfigRecord, *, arrayrecord_key: str,
             configrecord_key: str, message_type: str = MessageType.TRAIN,
             holders: Mapping[int, Sequence[int]] | None = None, packed: bool = False,
             transport: str = "float32", trainable: Sequence[str] | None = None,
             node_sum: str | None = None) -> list[Message]:
    """One Message per client of ``exchange``, or with ``holders`` (node -> the exchange's clients
    it serves) one per node (the caller's ``config`` is copied, never changed); ``packed``: each
    message's arrays as one packed record (``strategies.flower_api.packing``, for this project's ClientApp);
    messages that carry the global model alone share one packed payload (packed, hashed and
    stored once). A lossy ``transport`` (packed only) sends the global model's ``trainable``
    parameters rounded (``encode``). ``node_sum`` (an aggregation, packed only): a node serving several
    clients is asked for their sum (``NODE_SUM_KEY``, ``reply_of``)."""
    shared: Array | None = None
    restore: dict[str, dict[str, Restore]] = {}
    if packed and TRANSPORTS[transport] is not None:
        model, restore[arrayrecord_key] = encode(exchange.state, trainable, transport)
        arrays = model  # the global model's tensors, rounded where lossy
    out = []
    for node, node_config, records in _layouts(exchange, arrays, config, arrayrecord_key, holders):
        if packed and node_sum is not None and CLIENTS_KEY in node_config and len(node_config[CLIENTS_KEY]) > 1:
            node_config = ConfigRecord({**node_config, NODE_SUM_KEY: node_sum})
        payload = None
        if packed and len(records) == 1:
            shared = payload = shared if shared is not None else pack_arrays(records, restore)
        content = write(records, {configrecord_key: node_config}, packed=packed, payload=payload, restore=restore)
        out.append(Message(content=content, dst_node_id=node, message_type=message_type))
    return out


def _layouts(exchange: Exchange, arrays: Arrays, config: ConfigRecord, arrayrecord_key: str,
             holders: Mapping[int, Sequence[int]] | None) -> list[tuple[int, ConfigRecord, dict[str, Arrays]]]:
    """(destination node, config, array records) of each message: the global arrays first, then
    the exchange's per-client arrays (suffixed with the client's id for a multi-client node)."""
    own = ConfigRecord(dict(config))
    for key, value in exchange.settings.to_config().items():
        own[key] = value
    if holders is None:
        return [(node, own, {arrayrecord_key: arrays, **{name: per[i] for name, per in exchange.arrays.items()}})
                for i, node in enumerate(exchange.clients)]
    position = {pid: i for i, pid in enumerate(exchange.clients)}
    if not is_multi(holders):  # one client a node: the plain format, sent to the node
        return [(node, own, {arrayrecord_key: arrays, **{name: per[position[pid]] for name, per in exchange.arrays.items()}})
                for node, (pid,) in holders.items()]
    out = []
    for node, clients in holders.items():
        node_config = ConfigRecord(dict(own))
        node_config[CLIENTS_KEY] = [int(pid) for pid in clients]
        records: dict[str, Arrays] = {arrayrecord_key: arrays}
        for pid in clients:
            for name, per in exchange.arrays.items():
                records[f"{name}.{pid}"] = per[position[pid]]
        out.append((node, node_config, records))
    return out


class NamedClients(dict):
    """node -> the exchange's clients it serves, always in the suffixed format (the clients named),
    even where each node has one client of this exchange: an ``assign`` hook returns it when a node
    serves several clients of the federation, since a node's one sampled client (partial
    participation) cannot be told from the others of the node by a plain message."""


def is_multi(holders: Mapping[int, Sequence[int]] | None) -> bool:
    """Whether the messages name their clients (the suffixed format): some node serves several of
    the clients, or ``holders`` is ``NamedClients``; with one client a node the messages and
    replies keep the plain format."""
    return holders is not None and (isinstance(holders, NamedClients) or
                                    any(len(clients) != 1 for clients in holders.values()))


def split_named(items: Mapping[str, T], clients: Sequence[int]) -> tuple[dict[int, dict[str, T]], list[str]]:
    """A multi-client node's named items as one dict per client (``<name>.<id>`` -> ``<name>``), and
    the names that belong to none of ``clients``."""
    out: dict[int, dict[str, T]] = {int(pid): {} for pid in clients}
    strays = []
    for name, item in items.items():
        base, sep, suffix = name.rpartition(".")
        if sep and suffix.isdigit() and int(suffix) in out:
            out[int(suffix)][base] = item
        else:
            strays.append(name)
    return out, strays


def split_reply(content: RecordDict, clients: Sequence[int]) -> tuple[dict[int, RecordDict], list[str]]:
    """A multi-client node's reply as one RecordDict per client (``<name>.<id>`` -> ``<name>``),
    and the names of records that belong to none of ``clients``."""
    parts, strays = split_named(content, clients)
    return {pid: RecordDict(part) for pid, part in parts.items()}, strays


def arrays_of(content: RecordDict) -> tuple[dict[str, Arrays], RecordDict]:
    """A message's array records (decoded tensors where it is packed, else its ArrayRecords) and
    its other records; a packed payload that cannot be read raises ValueError with the reason."""
    decoded, why = unpack_arrays(content)
    if why is not None:
        raise ValueError(why)
    if decoded is None:
        return dict(content.array_records), content
    return dict(decoded), RecordDict({n: r for n, r in content.items() if not isinstance(r, ArrayRecord)})


def read_reply(msg: Message, groups: Sequence[str], *, weighted_by_key: str,
               settings: RoundSettings | None = None) -> Reply:
    """Read one reply of an exchange whose replies carry the array ``groups`` (``("arrays",)``:
    exactly one ArrayRecord under any key; otherwise exactly those ArrayRecords).
    ``settings``: the exchange's, to check the num-examples an honest client reports (its
    steps x batch size); None: not checked."""
    return read_content(msg.metadata.src_node_id, msg.content, groups, weighted_by_key=weighted_by_key,
                        settings=settings)


def read_content(node: int, content: RecordDict, groups: Sequence[str], *, weighted_by_key: str,
                 settings: RoundSettings | None = None, arrays: Mapping[str, Arrays] | None = None) -> Reply:
    """``read_reply`` of one client's records (``node``: the client's id in the results);
    ``arrays``: its array records already decoded (a packed reply), instead of ``content``'s."""
    records = content.metric_records
    if len(records) != 1:
        return Reply(node, content, reason=f"expected exactly one MetricRecord, got {len(records)}")
    record = next(iter(records.values()))
    if weighted_by_key not in record:
        return Reply(node, content, record=record, reason=f"metrics lack {weighted_by_key!r} (weighted_by_key)")
    weight = record[weighted_by_key]
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not (math.isfinite(weight) and weight >= 0):
        return Reply(node, content, record=record,
                     reason=f"{weighted_by_key} must be a finite number >= 0, got {weight!r}")
    metrics, reason = parse_metrics(record)
    if reason is None and settings is not None and "num-examples" in metrics:
        expected = settings.local_steps * settings.batch_size
        if metrics["num-examples"] != expected:
            reason = (f"num-examples {record['num-examples']!r} is not the {expected} example{'' if expected == 1 else 's'} of "
                      f"{settings.local_steps} step(s) of batch size {settings.batch_size}")
    if reason is not None:
        return Reply(node, content, metrics=metrics, record=record, reason=reason)
    reply = Reply(node, content, metrics=metrics, record=record, weight=float(weight))
    arrays = content.array_records if arrays is None else arrays
    if tuple(groups) == ("arrays",):
        if len(arrays) != 1:
            reply.reason = f"expected exactly one ArrayRecord, got {len(arrays)}"
            return reply
        named = {"arrays": next(iter(arrays.values()))}
    else:
        if set(arrays) != set(groups):
            reply.reason = f"expected ArrayRecords {', '.join(repr(g) for g in groups)}, got {sorted(arrays)}"
            return reply
        named = {g: arrays[g] for g in groups}
    try:
        reply.groups = {g: tensors(record) for g, record in named.items()}
    except Exception as exc:  # a malformed payload must not end the run
        reply.groups = {}
        reply.reason = f"arrays could not be decoded ({exc})"
        return reply
    names = list(reply.groups)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            both = sorted(set(reply.groups[a]) & set(reply.groups[b]))
            if both and "arrays" not in (a, b):
                reply.reason = f"keys both in {a} and {b}: {both}"
                return reply
    return reply


def client_results(replies: Sequence[Reply], groups: Sequence[str]) -> ClientResults:
    """The sound replies as the algorithm's ``ClientResults`` (ids: the nodes)."""
    scales = [r.metrics.get("lr-scale") for r in replies]
    scalars = {}
    if any(s is not None for s in scales):
        scalars["lr-scale"] = torch.tensor([1.0 if s is None else float(s) for s in scales], dtype=torch.float64)
    return ClientResults([r.node for r in replies], {g: [r.groups[g] for r in replies] for g in groups},
                         table_from_records([r.metrics for r in replies]),
                         torch.tensor([r.weight for r in replies], dtype=torch.float64), scalars)


# --- the client side ------------------------------------------------------------------------
def exchange_of(msg: Message, settings: RoundSettings) -> Exchange:
    """A train Message as the exchange of its clients: the global model (its one ArrayRecord, or
    the one named ``arrays`` beside the per-client records, e.g. ``correction``), the
    ``settings`` and the per-client arrays. A message to a multi-client node (``clients`` in its
    config) names its clients, ``ids`` of the exchange; otherwise the exchange has one client,
    id -1 (the node's own). A packed message (``strategies.flower_api.packing``) is read as the one it packs."""
    records, _ = arrays_of(msg.content)
    config = next(iter(msg.content.config_records.values()), {})
    clients = config.get(CLIENTS_KEY)
    if clients is not None:
        if not (isinstance(clients, list) and clients and all(_is_id(c) for c in clients)
                and len(set(clients)) == len(clients)):
            raise ValueError(f"the round's config names clients={clients!r}: a list of distinct partition ids")
        if "arrays" not in records:
            raise ValueError(f"a message to a multi-client node carries the global model as 'arrays', got {sorted(records)}")
        parts, strays = split_named({k: v for k, v in records.items() if k != "arrays"}, clients)
        if strays:
            raise ValueError(f"records {strays} name no client of this message (clients {clients})")
        names = {name for part in parts.values() for name in part}
        missing = [(name, pid) for name in sorted(names) for pid, part in parts.items() if name not in part]
        if missing:
            raise ValueError(f"per-client records missing: {', '.join(f'{n}.{p}' for n, p in missing)}")
        extra = {name: [tensors(parts[pid][name]) for pid in clients] for name in sorted(names)}
        return Exchange(settings, [int(c) for c in clients], tensors(records["arrays"]), extra)
    if len(records) == 1:
        model = next(iter(records))
    elif "arrays" in records:
        model = "arrays"
    else:
        raise ValueError(f"a train message with several ArrayRecords carries the global model as 'arrays', got "
                         f"{sorted(records)}")
    extra = {name: [tensors(record)] for name, record in records.items() if name != model}
    return Exchange(settings, [-1], tensors(records[model]), extra)


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def reply_of(msg: Message, results: ClientResults, extras: Sequence[Mapping[str, float | int]],
             multi: bool = False, packed: bool = False, transport: str = "float32",
             received: Mapping[str, torch.Tensor] | None = None, trainable: Sequence[str] | None = None,
             sums: tuple[Mapping[str, Mapping[str, torch.Tensor]], torch.Tensor] | None = None) -> Message:
    """The reply of a node's clients: each client's groups as ArrayRecords and its metrics
    (``ClientResults.metrics_of``, plus its ``extras``) as a MetricRecord -- under the plain
    names for the one client of a node (``multi`` False), as ``<name>.<id>`` for each client of a
    multi-client node; ``packed``: all arrays in one packed record (``strategies.flower_api.packing``).
    A lossy ``transport`` (packed only) sends each client's model (its ``arrays`` group) as its
    ``trainable`` parameters' rounded difference from the ``received`` global model (``encode``).
    ``sums`` (``reduce.node_sums``: per group the clients' float64 sum, and which clients it holds;
    packed only): ONE record per group, ``<group>.sum``, in place of the clients' arrays -- its
    floating-point entries in float32 (or the lossy transport's dtype), read back as float64 --
    and each client's metrics with ``in-sum``."""
    if sums is not None:
        return _sum_reply(msg, results, extras, sums, transport)
    records: dict[str, Arrays] = {}
    restore: dict[str, dict[str, Restore]] = {}
    others: dict[str, MetricRecord] = {}
    lossy = packed and TRANSPORTS[transport] is not None and received is not None
    for i, pid in enumerate(results.ids):
        suffix = f".{pid}" if multi else ""
        for name, arrays in results.arrays.items():
            records[f"{name}{suffix}"] = per_client(arrays)[i]
            if lossy and name == "arrays":
                records[f"{name}{suffix}"], restore[f"{name}{suffix}"] = encode(
                    per_client(arrays)[i], trainable, transport, reference=received)
        others[f"metrics{suffix}"] = MetricRecord({**results.metrics_of(i), **extras[i]})
    if packed:
        return Message(content=write(records, others, packed=True, restore=restore), reply_to=msg)
    content = RecordDict()  # each client's arrays, then its metrics
    for pid in results.ids:
        suffix = f".{pid}" if multi else ""
        for name in results.arrays:
            content[f"{name}{suffix}"] = _arrays(records[f"{name}{suffix}"])
        content[f"metrics{suffix}"] = others[f"metrics{suffix}"]
    return Message(content=content, reply_to=msg)


def _sum_reply(msg: Message, results: ClientResults, extras: Sequence[Mapping[str, float | int]],
               sums: tuple[Mapping[str, Mapping[str, torch.Tensor]], torch.Tensor], transport: str) -> Message:
    """A multi-client node's reply with its clients' sum (``reply_of``'s ``sums``): floating-point
    entries in float32 (a lossy transport: its dtype, read back as float32), an integer buffer's sum
    in float64."""
    groups, ok = sums
    wire = TRANSPORTS[transport] or torch.float32
    records: dict[str, Arrays] = {}
    restore: dict[str, dict[str, Restore]] = {}
    for name, group in groups.items():
        record = f"{name}.{SUM}"
        records[record] = {k: v.to(wire) if _was_float(results, name, k) else v for k, v in group.items()}
        restore[record] = {k: ("float32", False) for k, v in records[record].items() if v.dtype == wire != torch.float32}
    others = {f"metrics.{pid}": MetricRecord({**results.metrics_of(i), **extras[i], "in-sum": int(bool(ok[i]))})
              for i, pid in enumerate(results.ids)}
    return Message(content=write(records, others, packed=True, restore=restore), reply_to=msg)


def _was_float(results: ClientResults, group: str, key: str) -> bool:
    """Whether a group's entry is floating-point in the clients' results (an integer buffer's sum stays float64)."""
    first = per_client(results.arrays[group])[0] if len(results) else {}
    value = first.get(key)
    return value is None or value.is_floating_point()
