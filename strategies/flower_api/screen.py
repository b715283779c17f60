"""The server's checks of one exchange's replies, before the method sees any (flwr Messages in).

Every reply is read field by field (``strategies.flower_api.wire.read_reply``: one MetricRecord, its
weight, ranged metrics, the array groups the exchange's method expects) and then checked
against what an honest client of this exchange can send: each group's keys, shapes and
dtypes against the global model's (or, without one, against the layout most replies share),
every floating-point value finite, the buffers within what an honest client's forwards can
make of the global ones (``strategies.core.buffers``: BatchNorm counters exact, variances >= their
floor, integers in range), and the method's own ``check_result`` -- its bound on how
far an honest client moves (``Algorithm.bound``), naive's lr scale. A reply that fails is
recorded in the round as rejected with its reason (``Round.reject``; its bytes counted),
never averaged and never a crash; the sound ones go to the method as ``ClientResults``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from flwr.app import Message, RecordDict

from ..core.averaging import check_state, finalize
from ..core.buffers import Norm, check_buffers, rules_from_keys
from ..methods.algorithm import Algorithm
from ..methods.reduce import ClientResults, NodeSum
from ..methods.round import GROUP_KINDS, Exchange, Round
from .packing import PACKED, unpack_arrays
from .wire import SUM, Reply, client_results, is_multi, read_content, split_named, split_reply


@dataclass(frozen=True)
class Checks:
    """What the server checks in a reply beyond its structure."""

    weighted_by_key: str = "num-examples"
    verify_examples: bool = False  # num-examples = the exchange's steps x batch size
    trainable: Sequence[str] | None = None  # the trainable parameters (the bound's and gradients' keys)
    max_lr_scale: float = 1.0  # the largest lr scale an honest client's batches carry
    #: the model's BatchNorm layers (``strategies.core.buffers.buffer_rules``): the server knows the
    #: clients' forwards, so counters are exact and variances floored; None: known by key names only
    buffer_rules: tuple[Norm, ...] | None = None
    #: the relative rounding of a lossy transport (``wire.TRANSPORT_ERROR``): the bound is taken for an lr
    #: scale larger by that factor (every method's bound grows at least linearly in the lr scale)
    transport_error: float = 0.0


@dataclass
class Screened:
    """One exchange's replies after the checks: the sound ones as the method's results."""

    results: ClientResults
    sound: list[Reply]
    rejected: list[Reply]


def screen(rnd: Round, exchange: Exchange, replies: Sequence[Message], algorithm: Algorithm, checks: Checks,
           holders: Mapping[int, Sequence[int]] | None = None) -> Screened:
    """Read and check the (non-error) ``replies`` of ``exchange``; rejections recorded in ``rnd``.
    ``holders`` (node -> the exchange's clients it serves): each node's reply is one reply per
    client (``strategies.flower_api.wire.split_reply``), each read and checked on its own; the results in
    the order of the clients' ids."""
    groups = algorithm.reply_groups(exchange.mode)
    settings = exchange.settings if checks.verify_examples else None
    opened = [_open(m, exchange.state) for m in replies]  # packed replies read as sent: (node, records, arrays, reason)
    summed: list[tuple[list[int], dict[str, dict]]] = []  # node-aggregation: (the node's clients, its sums)

    def read_one(client: int, content, arrays) -> Reply:
        return read_content(client, content, groups, weighted_by_key=checks.weighted_by_key, settings=settings,
                            arrays=arrays)

    if holders is None:
        read = [Reply(node, content, reason=why) if why else read_one(node, content, arrays)
                for node, content, arrays, why in opened]
    elif not is_multi(holders):  # one client a node, the plain format: the reply is its client's
        read = [Reply(holders[node][0], content, reason=why) if why else read_one(holders[node][0], content, arrays)
                for node, content, arrays, why in opened if node in holders]
        read.sort(key=lambda r: r.node)
    else:
        read = []
        for node, content, arrays, why in opened:
            clients = holders.get(node, [])
            sums = {n[:-len(SUM) - 1]: v for n, v in (arrays or {}).items() if n.endswith(f".{SUM}")}
            rest = None if arrays is None else {n: v for n, v in arrays.items() if not n.endswith(f".{SUM}")}
            parts, strays = split_reply(content, clients)
            own, array_strays = split_named(rest, clients) if rest is not None else (None, [])
            strays += array_strays
            if sums and not why and (set(sums) != set(groups) or any(own[p] for p in own)):
                why = f"a node's sum must hold exactly the groups {list(groups)} and no client's own arrays"
            for pid, part in parts.items():
                if why:
                    read.append(Reply(pid, part, reason=f"its node's reply: {why}"))
                elif strays:
                    read.append(Reply(pid, part, reason=f"the reply of its node carries records {strays} of no client "
                                                        "of the message"))
                elif not part and not (own and own[pid]):
                    read.append(Reply(pid, part, reason="its node's reply carries nothing for this client"))
                elif sums:  # its arrays are in the node's sum: the client's own metrics only
                    r = read_content(pid, part, (), weighted_by_key=checks.weighted_by_key, settings=settings, arrays={})
                    if r.reason is None and r.metrics.get("in-sum") is None:
                        r.reason = "a client of a node's sum must say whether it is in it (in-sum)"
                    read.append(r)
                else:
                    read.append(read_one(pid, part, own[pid] if own is not None else None))
            if sums and not why and not strays:
                summed.append((list(parts), sums))
        read.sort(key=lambda r: r.node)
    in_sums = {pid for pids, _ in summed for pid in pids}
    refs = references(rnd, [r for r in read if r.node not in in_sums], groups, needs_global=algorithm.needs_global)
    rules = checks.buffer_rules if checks.buffer_rules is not None else rules_from_keys(rnd.state)  # once a screen
    for r in read:
        if r.reason is None and r.node not in in_sums:
            r.reason = check(rnd, exchange, r, refs, groups, algorithm, checks, rules)
    node_results = []
    for pids, sums in summed:
        members = [r for r in read if r.node in pids and r.reason is None]
        why = check_node_sum(rnd, exchange, sums, [r for r in members if r.metrics["in-sum"] == 1], refs, groups,
                             algorithm, checks, rules)
        if why is not None:
            for r in members:
                r.reason = f"its node's sum: {why}"
        elif members:
            ok = torch.tensor([r.metrics["in-sum"] == 1 for r in members])
            node_results.append(NodeSum(client_results(members, ()), ok, {g: dict(v) for g, v in sums.items()}))
    sound = [r for r in read if r.reason is None]
    rejected = [r for r in read if r.reason is not None]
    for r in rejected:
        rnd.reject(r.node, r.reason)
        rnd.received(r.nbytes)
    results = client_results([r for r in sound if r.node not in in_sums], groups)
    results.node_sums = node_results
    return Screened(results, sound, rejected)


def check_node_sum(rnd: Round, exchange: Exchange, sums: Mapping[str, Mapping[str, torch.Tensor]],
                   members: Sequence[Reply], refs: dict[str, dict | None], groups: Sequence[str], algorithm: Algorithm,
                   checks: Checks, rules: Sequence[Norm]) -> str | None:
    """Why a node's sum cannot come from honest clients of ``exchange``, or None: the node's
    average -- the global group plus the summed update over the clients' factors (1 each, or
    their weights), cast as the model -- is checked as one reply (keys, shapes, finite values,
    buffers, the method's bound: an average of points within the bound is within it)."""
    if not members:
        return None  # none of its clients is in the sum: it adds nothing
    if rnd.algorithm.hyper.aggregation == "examples":
        total = sum(r.weight for r in members)
    else:
        total = float(len(members))
    if not total > 0:
        return f"its clients' weights sum to {total}"
    average = {}
    for group in groups:
        ref, summed = refs[group], sums[group]
        if ref is None:
            return "no global model for this round: configure_train must run first"
        if set(summed) != set(ref) or any(tuple(summed[k].shape) != tuple(v.shape) for k, v in ref.items()):
            return f"{group}: keys or shapes differ from the global model's"
        base = ref if rnd.summed_from_global(group) else None
        mean = {k: summed[k] / total + (base[k] if base is not None else 0.0) for k in ref}  # float32: a check
        average[group] = finalize(mean, ref)
    return check(rnd, exchange, Reply(-1, RecordDict(), groups=average, metrics={}), refs, groups, algorithm, checks,
                 rules)


def _open(msg: Message, reference: Mapping | None) -> tuple[int, RecordDict, dict[str, dict] | None, str | None]:
    """(sender, the reply's records, its arrays decoded if packed, why it cannot be read): a packed
    reply's records are its config and metric records, its arrays decoded from the one payload
    (differences from the global model added to ``reference``: a lossy transport's updates)."""
    node = msg.metadata.src_node_id
    arrays, why = unpack_arrays(msg.content, reference)
    if arrays is None:
        return node, msg.content, None, why
    return node, RecordDict({n: r for n, r in msg.content.items() if n != PACKED}), arrays, None


def references(rnd: Round, read: Sequence[Reply], groups: Sequence[str], *, needs_global: bool
               ) -> dict[str, dict | None]:
    """What each group of a reply is checked against: the global model's layout, or without
    one the layout most replies share (None: nothing to check against -- a method that steps
    on the global model cannot go on without it)."""
    decoded = [r for r in read if r.reason is None]
    out: dict[str, dict | None] = {}
    for group in groups:
        if rnd.state:
            try:
                out[group] = rnd.like(group, decoded[0].groups if decoded else None)
            except ValueError:
                out[group] = None
            continue
        layouts = Counter(_layout(r.groups[group]) for r in decoded)
        if needs_global or not layouts:
            out[group] = None
            continue
        common = layouts.most_common(1)[0][0]
        out[group] = next(r.groups[group] for r in decoded if _layout(r.groups[group]) == common)
    return out


def check(rnd: Round, exchange: Exchange, reply: Reply, refs: dict[str, dict | None], groups: Sequence[str],
          algorithm: Algorithm, checks: Checks, rules: Sequence[Norm]) -> str | None:
    """Why one decoded reply cannot come from an honest client of ``exchange``, or None; ``rules``: the
    buffer rules (the model's, or derived from the global state's keys once per screen)."""
    kinds = {**GROUP_KINDS, **algorithm.groups}
    known = checks.buffer_rules is not None
    forwards = exchange.settings.local_steps if known else None
    for group in groups:
        ref = refs[group]
        if ref is None:
            return "no global model for this round: configure_train must run first"
        why = check_state(reply.groups[group], ref)
        if why is None and rnd.state and kinds.get(group, "state") in ("state", "buffers"):
            why = check_buffers(reply.groups[group], rnd.state, rules, forwards)
        if why is not None:
            return why if len(groups) == 1 else f"{group}: {why}"
    if not rnd.state:
        return None
    return algorithm.check_result(exchange, reply.groups, reply.metrics or {}, checks.trainable,
                                  checks.max_lr_scale * (1 + checks.transport_error))


def _layout(state: dict[str, torch.Tensor]) -> tuple:
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in state.items()))
