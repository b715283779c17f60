"""CELGC: local clipped SGD with periodic parameter averaging (the method, every backend).

Liu, Zhuang, Lei, Liao, "A Communication-Efficient Distributed Gradient Clipping Algorithm
for Training Deep Neural Networks" (NeurIPS 2022, https://arxiv.org/abs/2205.05040),
Algorithm 1. Each round every client runs I local steps of

    x <- x - min(eta, gamma / |g|) (g + lambda x)        (strategies.core.clipped_sgd)

from the global model and returns its parameters; the server averages them (uniformly, as in
the paper, or weighted by examples), BatchNorm statistics included. gamma = inf gives local
SGD (FedAvg with I local steps). An honest client moves at most I gamma in a round (with
lambda = 0 and lr scale 1; ``strategies.core.bound`` for the general bound).
"""

from __future__ import annotations

import math

from ..core.bound import max_displacement
from ..core.settings import Mode, RoundSettings
from .algorithm import Algorithm, Exchange, Round, Server
from .reduce import ClientResults


class CELGC(Algorithm):
    """I local clipped-SGD steps per client, parameters averaged."""

    name = "celgc"
    paper = "Liu, Zhuang, Lei, Liao, NeurIPS 2022, https://arxiv.org/abs/2205.05040"
    modes = (Mode.LOCAL,)
    needs_global = False  # an average of states: replies can be checked against each other
    node_sums = True  # the server averages the states and nothing else

    def server(self, rnd: Round) -> Server:
        results = yield rnd.exchange(Mode.LOCAL)
        average = rnd.mean(results, "arrays")
        return rnd.finish(average.arrays["arrays"] if average.arrays else None, average)

    @classmethod
    def client(cls, exchange: Exchange, group) -> ClientResults:
        table = group.train(exchange.settings)
        return group.results({"arrays": group.states()}, table)

    def bound(self, settings: RoundSettings, x0_norm: float = 0.0, max_lr_scale: float = 1.0) -> float | None:
        limit = max_displacement(settings.local_steps, settings.lr, settings.clip, settings.weight_decay,
                                 settings.momentum, x0_norm, max_lr_scale)
        return limit if math.isfinite(limit) else None

    def summary(self) -> list[str]:
        h = self.hyper
        return [f"CELGC ({self.paper}): I = {h.local_steps} local clipped steps a round, parameters averaged"]
