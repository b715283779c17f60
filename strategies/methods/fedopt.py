"""A server optimiser on FedAvg's rounds: the frame of FedOpt (Reddi, Charles, Zaheer, Garrett,
Rush, Konecny, Kumar, McMahan, "Adaptive Federated Optimization", ICLR 2021, Algorithms 1 and 2).

The clients run FedAvg's local steps (CELGC's exchange and client side; clip off unless the run
sets it). The server treats the average's displacement as a gradient,

    g = x_t - mean_k x_k          (the pseudo-gradient; Reddi et al.'s Delta_t is -g)

and takes one step of its own optimiser on every trainable parameter (all floating-point
entries where the backend does not name them): ``update(x, g, slots)``, where ``slots`` is
that parameter's optimiser state (empty before the first step), carried across rounds and
checkpointed with the model (``slots``: slot -> the prefix of its checkpoint entries).
Buffers take the average. A subclass is its update rule and its keys: FedAvgM (heavy ball,
``fedavgm.py``), FedAdam and FedYogi (``AdaptiveFedOpt`` below, ``fedadam.py``, ``fedyogi.py``).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .algorithm import Round, Server, own_key
from .celgc import CELGC


def _decay(v: float) -> bool:
    return 0 <= v < 1


def _positive(v: float) -> bool:
    return math.isfinite(v) and v > 0


class FedOpt(CELGC):
    """FedAvg's clients; the server steps on the pseudo-gradient x_t - mean_k x_k with ``update``."""

    shared_defaults = {"clip": math.inf}  # FedAvg's clients: plain SGD
    needs_global = True  # the server steps from the global model (CELGC's average does not need it)
    #: the optimiser's state per parameter: slot -> the prefix of its entries in ``state_dict``
    slots: ClassVar[dict[str, str]] = {}
    #: the update rule in words, for the summary
    rule: ClassVar[str] = ""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.slot_state: dict[str, dict[str, Tensor]] = {s: {} for s in self.slots}  # slot -> parameter -> tensor

    @abstractmethod
    def update(self, x: Tensor, g: Tensor, slots: dict[str, Tensor]) -> Tensor:
        """One parameter after the server's step from ``x`` along the pseudo-gradient ``g``;
        ``slots``: its optimiser state (empty before the first step), updated in place."""

    def server(self, rnd: Round) -> Server:
        results = yield rnd.exchange(self.modes[0])
        average = rnd.mean(results, "arrays")
        if average.arrays is None:
            return rnd.finish(None, average)
        mean = average.arrays["arrays"]
        names = rnd.trainable if rnd.trainable is not None else [k for k, v in mean.items() if v.is_floating_point()]
        state = dict(mean)
        for k in names:
            slots = {s: held[k] for s, held in self.slot_state.items() if k in held}
            state[k] = self.update(rnd.state[k], rnd.state[k] - mean[k], slots)
            for s, t in slots.items():
                self.slot_state[s][k] = t
        return rnd.finish(state, average)

    def state_dict(self) -> dict[str, Tensor]:
        return {f"{self.slots[s]}{k}": t for s, held in self.slot_state.items() for k, t in held.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        held: dict[str, dict[str, Tensor]] = {s: {} for s in self.slots}
        unknown = []
        for key, value in state.items():
            slot = next((s for s, prefix in self.slots.items() if key.startswith(prefix)), None)
            if slot is None:
                unknown.append(key)
            else:
                held[slot][key.removeprefix(self.slots[slot])] = value
        if unknown:
            kept = ", ".join(f"{s} ({p}*)" for s, p in self.slots.items()) or "nothing"
            raise ValueError(f"{self.name} keeps only its server optimiser's {kept}, the checkpoint holds {sorted(unknown)}")
        self.slot_state = held

    def summary(self) -> list[str]:
        keys = ", ".join(f"{k} = {v}" for k, v in self.options_config().items())
        return [f"{type(self).__name__} ({self.paper}): I = {self.hyper.local_steps} local steps, server step {self.rule}"
                f"{': ' + keys if keys else ''}"]


@dataclass(frozen=True)
class AdaptiveSettings:
    """FedAdam's and FedYogi's keys. beta_1, beta_2: the paper's; server-lr and tau: selected on validation
    on this project's default digits run over server-lr {0.01, 0.03, 0.1} x tau {0.001, 0.01}, 2 seeds
    (docs/ALGORITHMS.md, "A server optimiser"): a starting point, not a tuned value -- tune both per task."""

    server_lr: float = own_key("server-lr", "eta, the server's learning rate", default=0.03, check=_positive,
                               rule="a finite number > 0")
    beta1: float = own_key("beta1", "beta_1, decay of the server's first moment m", default=0.9, check=_decay,
                           rule="in [0, 1)")
    beta2: float = own_key("beta2", "beta_2, decay of the server's second moment v", default=0.99, check=_decay,
                           rule="in [0, 1)")
    tau: float = own_key("tau", "tau, the adaptivity: x -= eta m / (sqrt(v) + tau); v starts at tau^2", default=0.01,
                         check=_positive, rule="a finite number > 0")


class AdaptiveFedOpt(FedOpt):
    """Reddi et al.'s Algorithm 2 (no bias correction, as in the paper): with g = -Delta_t,

        m_t = beta_1 m_{t-1} + (1 - beta_1) g,     v_t = ``second_moment(v_{t-1}, g^2)``,
        x_{t+1} = x_t - eta m_t / (sqrt(v_t) + tau),

    from m_{-1} = 0 and v_{-1} = tau^2 (the paper asks v_{-1} >= tau^2; Flower's FedOpt starts v
    at 0). The sign of m is the paper's flipped with g's, so x moves as there."""

    Settings = AdaptiveSettings
    slots = {"m": "server-m.", "v": "server-v."}

    @abstractmethod
    def second_moment(self, v: Tensor, g2: Tensor) -> Tensor:
        """v_t from v_{t-1} and the squared pseudo-gradient."""

    def update(self, x: Tensor, g: Tensor, slots: dict[str, Tensor]) -> Tensor:
        o = self.options
        if not slots:
            slots.update(m=torch.zeros_like(g), v=torch.full_like(g, o.tau ** 2))
        slots["m"] = o.beta1 * slots["m"] + (1 - o.beta1) * g
        slots["v"] = self.second_moment(slots["v"], g * g)
        return x - o.server_lr * slots["m"] / (slots["v"].sqrt() + o.tau)
