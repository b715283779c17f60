"""FedAvgM (Hsu, Qi, Brown 2019, "Measuring the effects of non-identical data distribution for
federated visual classification"): FedAvg with momentum on the server.

A server optimiser (``fedopt.FedOpt``): on the pseudo-gradient Delta = w_t - mean_k w_k the server
steps with heavy-ball momentum, v <- beta v + Delta, w_t+1 = w_t - eta_s v (v starts at Delta).
beta = 0 and eta_s = 1 is FedAvg. v is server state, checkpointed with the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from .algorithm import own_key
from .fedopt import FedOpt


@dataclass(frozen=True)
class FedAvgMSettings:
    server_momentum: float = own_key("server-momentum", "beta, FedAvgM's server momentum on the averaged update",
                                     default=0.9, check=lambda v: 0 <= v < 1, rule="in [0, 1)")
    server_lr: float = own_key("server-lr", "eta_s, FedAvgM's server learning rate", default=1.0,
                               check=lambda v: math.isfinite(v) and v > 0, rule="a finite number > 0")


class FedAvgM(FedOpt):
    """FedAvg's local steps; the server steps on the averaged update with momentum."""

    name = "fedavgm"
    paper = "Hsu, Qi, Brown 2019, https://arxiv.org/abs/1909.06335"
    Settings = FedAvgMSettings
    slots = {"v": "server-momentum."}  # the checkpoint's entries: server-momentum.<parameter>

    def update(self, x: Tensor, g: Tensor, slots: dict[str, Tensor]) -> Tensor:
        slots["v"] = self.options.server_momentum * slots["v"] + g if "v" in slots else g
        return x - self.options.server_lr * slots["v"]

    def summary(self) -> list[str]:
        o = self.options
        return [f"FedAvgM ({self.paper}): I = {self.hyper.local_steps} local steps, server momentum "
                f"beta = {o.server_momentum}, server lr = {o.server_lr}"]
