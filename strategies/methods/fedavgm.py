"""FedAvgM (Hsu, Qi, Brown 2019, "Measuring the effects of non-identical data distribution for
federated visual classification"): FedAvg with momentum on the server.

The clients run FedAvg's local steps (CELGC's exchange and client side; clip off unless the run
sets it); the server treats the average's displacement as a gradient, Delta = w_t - mean_k w_k,
and steps with heavy-ball momentum: v <- beta v + Delta, w_t+1 = w_t - eta_s v, on the trainable
parameters (all floating-point entries where the backend does not name them); buffers take the
average. beta = 0 and eta_s = 1 is FedAvg. v is server state, checkpointed with the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor

from .algorithm import Round, Server, own_key
from .celgc import CELGC

PREFIX = "server-momentum."


@dataclass(frozen=True)
class FedAvgMSettings:
    server_momentum: float = own_key("server-momentum", "beta, FedAvgM's server momentum on the averaged update",
                                     default=0.9, check=lambda v: 0 <= v < 1, rule="in [0, 1)")
    server_lr: float = own_key("server-lr", "eta_s, FedAvgM's server learning rate", default=1.0,
                               check=lambda v: math.isfinite(v) and v > 0, rule="a finite number > 0")


class FedAvgM(CELGC):
    """FedAvg's local steps; the server steps on the averaged update with momentum."""

    name = "fedavgm"
    paper = "Hsu, Qi, Brown 2019, https://arxiv.org/abs/1909.06335"
    Settings = FedAvgMSettings
    shared_defaults = {"clip": math.inf}  # FedAvg's clients: plain SGD
    needs_global = True  # the server steps from the global model

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.velocity: dict[str, Tensor] = {}  # v; empty: zeros

    def server(self, rnd: Round) -> Server:
        results = yield rnd.exchange(self.modes[0])
        average = rnd.mean(results, "arrays")
        if average.arrays is None:
            return rnd.finish(None, average)
        mean = average.arrays["arrays"]
        beta, eta = self.options.server_momentum, self.options.server_lr
        names = rnd.trainable if rnd.trainable is not None else [k for k, v in mean.items() if v.is_floating_point()]
        state = dict(mean)
        for k in names:
            delta = rnd.state[k] - mean[k]
            v = beta * self.velocity[k] + delta if k in self.velocity else delta
            self.velocity[k] = v
            state[k] = rnd.state[k] - eta * v
        return rnd.finish(state, average)

    def state_dict(self) -> dict[str, Tensor]:
        return {f"{PREFIX}{k}": v for k, v in self.velocity.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        unknown = sorted(k for k in state if not k.startswith(PREFIX))
        if unknown:
            raise ValueError(f"fedavgm keeps only its server momentum, the checkpoint holds {unknown}")
        self.velocity = {k.removeprefix(PREFIX): v for k, v in state.items()}

    @classmethod
    def label(cls, local_steps: int | str) -> str:
        return f"FedAvgM I={local_steps}"

    def summary(self) -> list[str]:
        o = self.options
        return [f"FedAvgM ({self.paper}): I = {self.hyper.local_steps} local steps, server momentum "
                f"beta = {o.server_momentum}, server lr = {o.server_lr}"]
