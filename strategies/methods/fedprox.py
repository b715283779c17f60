"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, MLSys 2020): local steps with a proximal term.

Each client approximately minimises h_k(w) = F_k(w) + mu/2 |w - w_t|^2 around the round's global
model w_t with I steps of the run's step on the proximal gradient g + mu (w - w_t); the server
averages the parameters (FedAvg's server, CELGC's here: the same exchange kind ``Mode.LOCAL``,
its own client side). ``proximal-mu`` = 0 is local SGD. The paper's steps are not clipped: clip
is off unless the run sets it (then the proximal gradient is clipped, and CELGC's bound holds).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..core.clipped_sgd import clipped_sgd_step, grad_norm
from ..core.local_update import Rule
from .algorithm import Exchange, own_key
from .celgc import CELGC
from .reduce import ClientResults


@dataclass(frozen=True)
class FedProxSettings:
    proximal_mu: float = own_key("proximal-mu", "mu, weight of FedProx's proximal term mu/2 |w - w_global|^2",
                                 default=0.0, check=lambda v: math.isfinite(v) and v >= 0, rule="a finite number >= 0")


def _step(mu, params, grads, bufs, cfg, lr_scale, extra):
    """The step on the proximal gradient g + mu (w - w_t) (``extra``: w_t); ``grad-norm``: |g|."""
    prox = [g + mu * (p - x) for g, p, x in zip(grads, params, extra, strict=True)]
    new, bufs, stats = clipped_sgd_step(params, prox, bufs, cfg, lr_scale=lr_scale)
    return new, bufs, {**stats, "grad-norm": grad_norm(grads)}


class FedProx(CELGC):
    """I local steps on the proximal objective F_k(w) + mu/2 |w - w_t|^2, parameters averaged."""

    name = "fedprox"
    paper = "Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, MLSys 2020, https://arxiv.org/abs/1812.06127"
    Settings = FedProxSettings
    shared_defaults = {"clip": math.inf}  # the paper's local solver: plain SGD

    @classmethod
    def client(cls, exchange: Exchange, group) -> ClientResults:
        mu = cls.options_of(exchange.settings).proximal_mu
        start = [exchange.state[k].to(group.device) for k in group.trainable]
        table = group.train(exchange.settings, rule=Rule(functools.partial(_step, mu)), extra=[start] * group.n)
        return group.results({"arrays": group.states()}, table)

    @classmethod
    def label(cls, local_steps: int | str) -> str:
        return f"FedProx I={local_steps}"

    def summary(self) -> list[str]:
        return [f"FedProx ({self.paper}): I = {self.hyper.local_steps} local steps with proximal term "
                f"mu = {self.options.proximal_mu}, parameters averaged"]
