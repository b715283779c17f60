"""SCAFFOLD: stochastic controlled averaging, the heterogeneity baseline of EPISODE (every backend).

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning" (ICML 2020, https://arxiv.org/abs/1910.06378), Algorithm 1 with the
control variates of option II and the global step size eta_g = 1 (the paper's experiments).
Round r, server model x, server control c (zeros at first), sampled clients S of all N:

1. client i in S receives (x, c, c_i) and, from y_i = x, takes I steps

       y_i <- y_i - eta (g_i(y_i) - c_i + c)        (+ lambda y_i, heavy-ball as torch.optim.SGD)

   then computes its new control (option II)

       c_i+ = c_i - c + (x - y_i) / (I eta)

   and sends y_i and c_i+;
2. the server: x <- x + mean_S (y_i - x) = mean_S y_i (BatchNorm statistics averaged like
   parameters), dc_i = c_i+ - c_i, c <- c + (|S| / N) mean_S dc_i, and c_i <- c_i+ for the
   replies it averaged.

**The server keeps every client's c_i** (zeros at first; sent with c, an empty record while it
is zero) and commits c_i+ only for a reply it averaged. Whatever happens to a reply -- rejected
by a check, lost, timed out, non-finite, its node restarted -- the c_i the next round uses and c
stay consistent: c = (1/N) sum_i c_i over all N clients (to float rounding; tested against a
float64 reference with planted faults), and the clients hold no state of the method, so a
restarted node loses nothing and a resumed run continues with c and every c_i from the
checkpoint (``state_dict``), bit for bit. The cost, against clients keeping c_i themselves:
one more trainable-sized record down to each sampled client that trained before (c_i), the
reply's size unchanged (c_i+ instead of dc_i), and N controls in the server's memory and its
checkpoints. (The alternative -- clients keep c_i+ pending until the server acknowledges it in
their next exchange -- costs no bytes but still loses c_i with a restarted client host or a
resumed Flower run, whose ``Context.state`` is new.) The model's updates are those of clients
keeping c_i themselves, bit for bit (dc_i is computed from the same two tensors).

The steps are not clipped (``clip = "off"``): the baseline as the EPISODE paper runs it, so
no displacement bound holds. Refused, each with an error naming the key, because the paper does
not define them and option II would then no longer hold: ``momentum`` > 0 (the heavy-ball step
is not eta (g - c_i + c), so (x - y_i) / (I eta) is no longer the mean corrected gradient),
batches that scale their step (``lr_scale``: the word-level language tasks ``ptb`` and
``wikitext2``, whose sequence-length jitter multiplies eta step by step) and a robust
``aggregation`` (``median``, ``trimmed-mean``: a coordinate-wise statistic of the control deltas
breaks c = mean c_i). A step whose corrected gradient is not finite is skipped and counted, as
every step here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..core.clipped_sgd import clipped_sgd_step, grad_norm
from ..core.local_update import Rule
from ..core.settings import Hyper, Mode
from .algorithm import Algorithm, Exchange, Round, Server
from .reduce import ClientResults, per_client


def _step(params, grads, bufs, cfg, lr_scale, extra):
    """SGD on the corrected gradient g - c_i + c (``extra``: c - c_i); ``grad-norm``: |g|."""
    new, bufs, stats = clipped_sgd_step(params, [g + e for g, e in zip(grads, extra, strict=True)], bufs, cfg,
                                        lr_scale=lr_scale)
    return new, bufs, {**stats, "grad-norm": grad_norm(grads)}


class SCAFFOLD(Algorithm):
    """I local steps corrected by the control variates c - c_i; models and controls averaged;
    the server keeps every client's c_i and commits it only for a reply it averaged."""

    name = "scaffold"
    paper = "Karimireddy et al., ICML 2020, https://arxiv.org/abs/1910.06378"
    shared_defaults = {"clip": math.inf}  # unclipped steps: clip off unless the run sets it
    modes = (Mode.SCAFFOLD,)
    keeps_client_records = True
    groups = {"control": "trainable"}  # c_i+, shaped as the trainable parameters

    def __init__(self, hyper: Hyper, **kw: Any) -> None:
        super().__init__(hyper, **kw)
        self.control: dict[str, Tensor] = {}  # c; empty: zeros
        self.client_controls: dict[int, dict[str, Tensor]] = {}  # c_i by client id; absent: zeros

    @classmethod
    def problems(cls, hyper: Hyper) -> list[str]:
        out = [] if not hyper.clipping else [f"clip must be \"off\" for algorithm 'scaffold' (SCAFFOLD takes "
                                             f"unclipped steps), got {hyper.clip}"]
        if hyper.momentum != 0:
            out.append(f"momentum must be 0 for algorithm 'scaffold', got {hyper.momentum}: its control update "
                       "c_i+ = c_i - c + (x - y_i)/(I lr) (option II) is the mean corrected gradient only for plain SGD "
                       "steps, and the paper defines no momentum variant")
        if hyper.aggregation in ("median", "trimmed-mean"):
            out.append(f"aggregation {hyper.aggregation!r} is refused for algorithm 'scaffold' (use 'uniform' or "
                       "'examples'): a coordinate-wise robust statistic of the control deltas is undefined by the paper "
                       "and breaks c = mean of the clients' c_i")
        return out

    @classmethod
    def config_problems(cls, cfg: Any) -> list[str]:
        if cfg.task in LR_SCALED_TASKS:
            return [f"task {cfg.task!r} is refused for algorithm 'scaffold': its batches scale each step's lr by "
                    "seq_len/bptt (lr_scale), which the control update (x - y_i)/(I lr) does not include"]
        return []

    def server(self, rnd: Round) -> Server:
        c = self.control or {k: torch.zeros_like(rnd.state[k]) for k in (rnd.trainable or [])}
        held = [self.client_controls.get(i, {}) for i in rnd.clients]  # empty: zeros (nothing to send)
        results = yield rnd.exchange(Mode.SCAFFOLD, arrays={"control": [c] * len(rnd.clients), "client-control": held})
        news = per_client(results.arrays.get("control", []))
        deltas = []
        for i, new in zip(results.ids, news, strict=True):  # dc_i = c_i+ - c_i, as a client keeping c_i computes it
            mine = self.client_controls.get(i, {})
            deltas.append({k: v - mine[k] if k in mine else v - torch.zeros_like(v) for k, v in new.items()})
        average = rnd.mean(dataclasses.replace(results, arrays={**results.arrays, "control": deltas}),
                           "arrays", "control")
        for i, new, ok in zip(results.ids, news, average.ok.tolist(), strict=True):
            if ok:  # committed only for a reply averaged into c: c stays the mean of the c_i
                self.client_controls[i] = {k: v.detach().clone() for k, v in new.items()}
        if average.arrays is None:
            return rnd.finish(None, average)
        share = average.replies / (self.population or rnd.expected)  # |S| / N
        delta = average.arrays["control"]
        self.control = {k: (c[k] if k in c else torch.zeros_like(v)) + share * v for k, v in delta.items()}
        return rnd.finish(average.arrays["arrays"], average)

    @classmethod
    def client(cls, exchange: Exchange, group) -> ClientResults:
        s = exchange.settings
        names, device = group.trainable, group.device
        x = {k: exchange.state[k].to(device) for k in names}
        zero = {k: torch.zeros_like(x[k]) for k in names}

        def of(record: str) -> list[dict[str, Tensor]]:  # one mapping per client; a missing tensor: zeros
            sent = exchange.arrays.get(record) or [{}] * group.n
            return [{k: c[k].to(device) if k in c else zero[k] for k in names} for c in sent]

        theirs, mine = of("control"), of("client-control")
        table = group.train(s, rule=RULE, extra=[[c[k] - ci[k] for k in names] for c, ci in zip(theirs, mine)])
        news = [{k: ci[k] - c[k] + (x[k] - y[k].detach()) / (s.local_steps * s.lr) for k in names}  # option II
                for y, c, ci in zip(per_client(group.states()), theirs, mine, strict=True)]
        return group.results({"arrays": group.states(), "control": news}, table)

    def reply_groups(self, mode: Mode) -> tuple[str, ...]:
        return ("arrays", "control")

    # --- server state (checkpoints): c and every c_i ------------------------------------
    def state_dict(self) -> dict[str, Tensor]:
        out = {f"control/{k}": v for k, v in self.control.items()}
        for i, ci in sorted(self.client_controls.items()):
            out.update({f"client-control/{i}/{k}": v for k, v in ci.items()})
        return out

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        control: dict[str, Tensor] = {}
        clients: dict[int, dict[str, Tensor]] = {}
        for key, value in state.items():
            kind, _, rest = key.partition("/")
            if kind == "control" and rest:
                control[rest] = value
                continue
            i, _, name = rest.partition("/")
            if kind != "client-control" or not name or not i.lstrip("-").isdigit():
                raise ValueError(f"scaffold: checkpoint entry {key!r} is neither control/<name> nor "
                                 "client-control/<client>/<name>")
            clients.setdefault(int(i), {})[name] = value
        self.control, self.client_controls = control, clients

    def summary(self) -> list[str]:
        return [f"SCAFFOLD ({self.paper}): I = {self.hyper.local_steps} local steps corrected by c - c_i "
                "(option II), eta_g = 1; the server keeps every c_i, committed when it averages the reply"]


RULE = Rule(_step)
#: the project's tasks whose batches carry an ``lr_scale`` (tasks.language: sequence-length jitter)
LR_SCALED_TASKS = ("ptb", "wikitext2")
