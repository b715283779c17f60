"""SCAFFOLD: stochastic controlled averaging, the heterogeneity baseline of EPISODE (every backend).

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning" (ICML 2020, https://arxiv.org/abs/1910.06378), Algorithm 1 with the
control variates of option II and the global step size eta_g = 1 (the paper's experiments).
Round r, server model x, server control c (zeros at first), sampled clients S of all N:

1. client i in S receives (x, c) and, from y_i = x, takes I steps

       y_i <- y_i - eta (g_i(y_i) - c_i + c)        (+ lambda y_i, heavy-ball as torch.optim.SGD)

   with its own control c_i (zeros at first, kept by the client across rounds -- Flower's
   ``Context.state``, the engine per client -- also while it is not sampled), then

       c_i+ = c_i - c + (x - y_i) / (I eta)          (option II)

   and sends y_i and dc_i = c_i+ - c_i, keeping c_i <- c_i+;
2. the server: x <- x + mean_S (y_i - x) = mean_S y_i (BatchNorm statistics averaged like
   parameters) and c <- c + (|S| / N) mean_S dc_i.

The steps are not clipped (``clip = "off"``): the baseline as the EPISODE paper runs it, so
no displacement bound holds. Refused, each with an error naming the key, because the paper does
not define them and option II would then no longer hold: ``momentum`` > 0 (the heavy-ball step
is not eta (g - c_i + c), so (x - y_i) / (I eta) is no longer the mean corrected gradient),
batches that scale their step (``lr_scale``: the word-level language tasks ``ptb`` and
``wikitext2``, whose sequence-length jitter multiplies eta step by step) and a robust
``aggregation`` (``median``, ``trimmed-mean``: a coordinate-wise statistic of the control deltas
breaks c = mean c_i).

A client keeps its new c_i when it replies, whether or not the server then averages the reply:
after a rejected, lost or failed reply, c is no longer the mean of the clients' c_i. The rows
say so from that round on: ``controls-unaccounted``, the replies (over the run so far) whose
control update c does not include (absent while 0). A step whose corrected gradient is not finite is skipped and
counted, as every step here. A resumed run starts c and every c_i at zero again (the clients'
controls live with the clients, and a resumed Flower run is a new run).
"""

from __future__ import annotations

import math
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
    """I local steps corrected by the control variates c - c_i; models and controls averaged."""

    name = "scaffold"
    paper = "Karimireddy et al., ICML 2020, https://arxiv.org/abs/1910.06378"
    shared_defaults = {"clip": math.inf}  # unclipped steps: clip off unless the run sets it
    modes = (Mode.SCAFFOLD,)
    keeps_client_memory = True
    groups = {"control": "trainable"}  # dc_i, shaped as the trainable parameters

    def __init__(self, hyper: Hyper, **kw: Any) -> None:
        super().__init__(hyper, **kw)
        self.control: dict[str, Tensor] = {}  # c; empty: zeros
        self.unaccounted = 0  # replies asked for and not averaged into c (rejected, lost, failed), all rounds

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
        results = yield rnd.exchange(Mode.SCAFFOLD, arrays={"control": [c] * len(rnd.clients)})
        average = rnd.mean(results, "arrays", "control")
        # a client whose reply is not averaged may still have kept its new c_i: from then on c is not the
        # mean of the c_i the clients hold; the rows say so (0 until it happens: rows unchanged otherwise)
        self.unaccounted += max(rnd.expected - average.replies, 0)
        said = {"controls-unaccounted": self.unaccounted} if self.unaccounted else {}
        if average.arrays is None:
            return rnd.finish(None, average, **said)
        share = average.replies / (self.population or rnd.expected)  # |S| / N
        delta = average.arrays["control"]
        self.control = {k: (c[k] if k in c else torch.zeros_like(v)) + share * v for k, v in delta.items()}
        return rnd.finish(average.arrays["arrays"], average, **said)

    @classmethod
    def client(cls, exchange: Exchange, group) -> ClientResults:
        s = exchange.settings
        names, device = group.trainable, group.device
        x = {k: exchange.state[k].to(device) for k in names}
        servers = exchange.arrays.get("control") or [{}] * group.n
        zero = {k: torch.zeros_like(x[k]) for k in names}
        mine = [{k: memory.get(k, zero[k]).to(device) for k in names} for memory in group.memory]
        theirs = [{k: c[k].to(device) if k in c else zero[k] for k in names} for c in servers]
        table = group.train(s, rule=RULE, extra=[[c[k] - ci[k] for k in names] for c, ci in zip(theirs, mine)])
        deltas = []
        for y, c, ci, memory in zip(per_client(group.states()), theirs, mine, group.memory, strict=True):
            new = {k: ci[k] - c[k] + (x[k] - y[k].detach()) / (s.local_steps * s.lr) for k in names}  # option II
            deltas.append({k: new[k] - ci[k] for k in names})
            memory.clear()
            memory.update(new)  # c_i <- c_i+
        return group.results({"arrays": group.states(), "control": deltas}, table)

    def reply_groups(self, mode: Mode) -> tuple[str, ...]:
        return ("arrays", "control")

    def summary(self) -> list[str]:
        return [f"SCAFFOLD ({self.paper}): I = {self.hyper.local_steps} local steps corrected by c - c_i "
                "(option II), eta_g = 1"]


RULE = Rule(_step)
#: the project's tasks whose batches carry an ``lr_scale`` (tasks.language: sequence-length jitter)
LR_SCALED_TASKS = ("ptb", "wikitext2")
