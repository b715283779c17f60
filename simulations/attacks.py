"""Clients that lie: what a registered node can send that an honest one would not (for tests,
benchmarks and the deployment drill; never imported by the apps).

``lie(attack, msg, reply)`` rewrites the train reply of one client (the plain, one-client-a-node
format of a state-returning method: CELGC, local SGD) given the message it answers:

* ``sign-flip``: the honest update x_i - x reversed and scaled to ``scale`` times the bound an
  honest client can move (``strategies.core.bound.max_displacement``: I gamma with lambda = 0), so
  the displacement check passes;
* ``bias-push``: every liar moves the model by ``scale`` times the bound along one fixed
  direction (all ones, normalised over the trainable parameters), every round;
* ``bn-var-huge`` / ``bn-mean-huge``: every BatchNorm ``running_var`` = 1e30 / ``running_mean``
  = 1e6 (finite: only a robust aggregation neutralises them);
* ``bn-var-negative`` / ``bn-count-max``: ``running_var`` = -50, ``num_batches_tracked`` =
  2**63 - 1 (rejected by ``strategies.core.buffers``).

``LyingGrid`` is the in-process grid whose nodes holding ``liars`` (partition ids) lie in
every train reply; ``install(attack)`` makes every ClientApp of this interpreter lie (a
deployed SuperNode whose owner changed its code: started with a ``sitecustomize`` that calls it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from flwr.app import ArrayRecord, Message, MessageType

from strategies.core.bound import max_displacement, norm
from strategies.core.settings import RoundSettings
from strategies.flower_api.packing import is_packed, pack, unpack

from .loopback import LoopbackGrid

ATTACKS = ("sign-flip", "bias-push", "bn-var-huge", "bn-mean-huge", "bn-var-negative", "bn-count-max")
BUFFER_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


def trainable_keys(state: dict[str, torch.Tensor]) -> list[str]:
    """The floating-point entries that are not BatchNorm statistics (what the bound covers)."""
    return [k for k, v in state.items() if v.dtype.is_floating_point and not k.endswith(BUFFER_SUFFIXES)]


def lie(attack: str, msg: Message, reply: Message, scale: float = 0.999) -> None:
    """Rewrite ``reply`` (to the train message ``msg``) as ``attack`` does; in place."""
    if attack not in ATTACKS:
        raise ValueError(f"attack must be one of {', '.join(ATTACKS)}, got {attack!r}")
    if reply.has_error():
        return
    packed = is_packed(reply.content)
    content, sent = unpack(reply.content)[0], unpack(msg.content)[0]  # a liar speaks the wire format it was sent
    if "arrays" not in content.array_records:
        return
    state = content["arrays"].to_torch_state_dict()
    if attack in ("sign-flip", "bias-push"):
        x0 = sent["arrays"].to_torch_state_dict()
        s = RoundSettings.from_config(dict(sent["config"]))
        keys = trainable_keys(x0)
        bound = max_displacement(s.local_steps, s.lr, s.clip, s.weight_decay, s.momentum, norm(x0, keys))
        if not math.isfinite(bound):  # no bound (unclipped): as far as the honest client moved
            bound = math.sqrt(sum(float((state[k].double() - x0[k].double()).square().sum()) for k in keys))
        if attack == "sign-flip":
            direction = {k: -(state[k].double() - x0[k].double()) for k in keys}
        else:
            direction = {k: torch.ones_like(x0[k], dtype=torch.float64) for k in keys}
        length = math.sqrt(sum(float(d.square().sum()) for d in direction.values())) or 1.0
        for k in keys:
            state[k] = (x0[k].double() + direction[k] * (scale * bound / length)).to(x0[k].dtype)
    else:
        suffix, value = {"bn-var-huge": ("running_var", 1e30), "bn-mean-huge": ("running_mean", 1e6),
                         "bn-var-negative": ("running_var", -50.0),
                         "bn-count-max": ("num_batches_tracked", 2**63 - 1)}[attack]
        for k in [k for k in state if k.endswith(suffix)]:
            state[k] = torch.full_like(state[k], value)
    content["arrays"] = ArrayRecord(state)
    reply.content = pack(content) if packed else content


class LyingGrid(LoopbackGrid):
    """The in-process grid; the nodes holding the partitions ``liars`` send ``attack``'s train
    replies (the plain format: one node a client)."""

    def __init__(self, *args, attack: str, liars: Iterable[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if attack not in ATTACKS:
            raise ValueError(f"attack must be one of {', '.join(ATTACKS)}, got {attack!r}")
        self.attack, self.liars = attack, set(liars)

    def _deliver(self, msg: Message) -> Message:
        reply = super()._deliver(msg)
        if msg.metadata.message_type == MessageType.TRAIN and \
                self.nodes[msg.metadata.dst_node_id].get("partition-id") in self.liars:
            lie(self.attack, msg, reply)
        return reply


def install(attack: str | Callable[[], str]) -> None:
    """Make this interpreter's ClientApp lie: every train reply it writes is ``attack``'s (a
    callable: asked at each reply, e.g. to read the attack from a file)."""
    import strategies.flower_api.wire as wire

    honest = wire.reply_of

    def reply_of(msg, results, extras, multi=False, **options):
        reply = honest(msg, results, extras, multi=multi, **options)
        if msg.metadata.message_type == MessageType.TRAIN and not multi:
            lie(attack() if callable(attack) else attack, msg, reply)
        return reply

    wire.reply_of = reply_of
