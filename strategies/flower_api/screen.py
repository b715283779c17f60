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

from ..core.averaging import check_state
from ..core.buffers import Norm, check_buffers, rules_from_keys
from ..methods.algorithm import Algorithm
from ..methods.reduce import ClientResults
from ..methods.round import GROUP_KINDS, Exchange, Round
from .packing import PACKED, unpack_arrays
from .wire import Reply, client_results, is_multi, read_content, split_named, split_reply


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
    opened = [_open(m) for m in replies]  # packed replies read as sent: (node, other records, arrays, reason)

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
            parts, strays = split_reply(content, clients)
            own, array_strays = split_named(arrays, clients) if arrays is not None else (None, [])
            strays += array_strays
            for pid, part in parts.items():
                if why:
                    read.append(Reply(pid, part, reason=f"its node's reply: {why}"))
                elif strays:
                    read.append(Reply(pid, part, reason=f"the reply of its node carries records {strays} of no client "
                                                        "of the message"))
                elif not part and not (own and own[pid]):
                    read.append(Reply(pid, part, reason="its node's reply carries nothing for this client"))
                else:
                    read.append(read_one(pid, part, own[pid] if own is not None else None))
        read.sort(key=lambda r: r.node)
    refs = references(rnd, read, groups, needs_global=algorithm.needs_global)
    rules = checks.buffer_rules if checks.buffer_rules is not None else rules_from_keys(rnd.state)  # once a screen
    for r in read:
        if r.reason is None:
            r.reason = check(rnd, exchange, r, refs, groups, algorithm, checks, rules)
    sound = [r for r in read if r.reason is None]
    rejected = [r for r in read if r.reason is not None]
    for r in rejected:
        rnd.reject(r.node, r.reason)
        rnd.received(r.nbytes)
    return Screened(client_results(sound, groups), sound, rejected)


def _open(msg: Message) -> tuple[int, RecordDict, dict[str, dict] | None, str | None]:
    """(sender, the reply's records, its arrays decoded if packed, why it cannot be read): a packed
    reply's records are its config and metric records, its arrays decoded from the one payload."""
    node = msg.metadata.src_node_id
    arrays, why = unpack_arrays(msg.content)
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
    return algorithm.check_result(exchange, reply.groups, reply.metrics or {}, checks.trainable, checks.max_lr_scale)


def _layout(state: dict[str, torch.Tensor]) -> tuple:
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in state.items()))
