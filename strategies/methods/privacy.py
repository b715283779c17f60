"""Client-level differential privacy from the clipping bound: the mechanism of a round (no flwr).

The mechanism of a DP round (every backend: the Flower strategies and the engine run it
inside ``Round.mean`` of the round's last exchange, ``strategies.methods.round``; the pure parts:
``strategies.core.dp_noise``, the accountant ``strategies.core.dp_accountant``):

1. Each sound client's contribution is its update over the trainable parameters: x_i - x_bar
   for a method whose clients return their state (CELGC, local SGD), its gradient for one
   whose clients return gradients (naive parallel clipping).
2. The sensitivity S is the method's own bound on an honest client (``Algorithm.bound``: for
   CELGC with weight decay lambda = 0 and momentum mu = 0, I gamma times the largest lr scale
   of the task's batches, ``strategies.core.bound``; lambda > 0 adds the terms of ``max_displacement``,
   which depend on the global model's norm -- public, so S stays data-independent; mu > 0 or
   gamma = inf: no bound), or ``dp-clip`` where the user sets one (update clipping as
   DP-FedAvg, McMahan et al. ICLR 2018). A method with neither is refused.
3. A contribution outside the ball of radius S is PROJECTED onto it (scaled to norm S), and
   a reply the server's checks reject (beyond the bound's float tolerance, non-finite,
   mis-shaped) contributes 0: either way every client's contribution lies in the ball, which
   is all the sensitivity needs. Projection (not a drop) keeps an honest client whose float
   rounding lands a hair outside the bound, and is DP-FedAvg's update clipping for dp-clip.
   dp-clip also applies to CELGC (C below I gamma: a tighter sensitivity than the worst case,
   which honest clients' updates rarely reach). The contributions' norms BEFORE projection
   are summarised in the rows (``dp-update-norm-mean``, ``-q90``, ``-max``, ``dp-projected-share``;
   several processes: gathered by slot in the round's one all-reduce), so the distance between
   S and what the clients send is visible.
4. Noise N(0, z^2 S^2) per coordinate is added ONCE to the SUM of the round's contributions
   (on one process: the engine's first), and the sum is divided by the FIXED denominator K,
   the clients sampled for the round -- not by the number of sound replies, which depends on
   the data. The new global model is x_bar + (sum + noise) / K; gradients go to the method's
   server step (post-processing).
5. Buffers are data: BatchNorm running statistics come from the clients' data and have no
   bound. A DP run refuses a model with buffers unless ``dp-buffers = "frozen"``: the global
   buffers then stay at their initial values (the clients' are checked and discarded).

Randomness (``dp-reproducible``): by default the noise comes from the operating system's
CSPRNG (``os.urandom``, Box-Muller in float64) and, when the rounds are accounted with
amplification (K < M), the round's clients are drawn with ``secrets.SystemRandom`` -- not
from the run's public ``seed``. ``dp-reproducible = true`` draws both from the seed (tests,
parity between backends) and marks the run NOT private in its header and rows.

What this does not protect against: floating-point Gaussian samples are not exactly Gaussian
(Mironov, CCS 2012: the low-order bits of a float sample can reveal the unnoised value; no
snapping or discrete Gaussian here), timing side channels, the per-round client metrics in the
results rows (train loss, clip fraction, the count and share of projected contributions, the
contributions' norms: computed from the clients' data and NOT noised -- keep the rows with the
server), a validation split of the
clients' data (``valid-fraction``) evaluated centrally. Trust model: central DP -- the server
sees every client's update in the clear and is trusted; what is private is every model it
releases (and everything computed from them). Secure aggregation is out of scope.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..core.bound import norm
from ..core.client_sampling import participants
from ..core.dp_accountant import Accountant, default_delta
from ..core.dp_noise import DPSettings, norm_statistics, project, secure_normal, secure_participants, seeded_normal
from .reduce import ClientResults, Mean, mean
from .round import GROUP_KINDS


def method_problems(settings: DPSettings, method: Any, hyper: Any, num_clients: int, per_round: int,
                    options: Mapping[str, Any] | None = None) -> list[str]:
    """Why a run cannot be made private as configured (``method``: the Algorithm class, ``options``
    its own settings), or []."""
    if not settings.enabled:
        return []
    out = []
    if num_clients == 1:
        out.append(f"dp-noise-multiplier > 0 needs clients: client-level DP hides one client among several, and "
                   f"algorithm {method.name!r} with num-clients=1 has one (run a federated method with num-clients >= 2)")
    if len(method.modes) != 1 or method.groups or method.keeps_client_memory:
        out.append(f"dp-noise-multiplier > 0 is not supported for algorithm {method.name!r}: its round releases more "
                   "than one aggregate (extra exchanges, control variates or client memory), each of which would need "
                   "its own noise and accounting; use celgc, local-sgd or naive")
    if hyper.aggregation != "uniform":
        out.append(f"dp-noise-multiplier > 0 needs aggregation=\"uniform\" (a fixed denominator; weights by examples "
                   f"or a robust statistic depend on the clients' data), got {hyper.aggregation!r}")
    if not out and not settings.clip:
        algorithm = method(hyper, options=options)  # its own defaults applied (local SGD: clip off)
        hyper = algorithm.hyper
        bound = algorithm.bound(algorithm.round_settings(1, method.modes[-1], hyper.lr, hyper.clip))
        if bound is None or not math.isfinite(bound):
            why = ("momentum > 0 (no per-client bound)" if hyper.momentum > 0 else
                   "clip is off (no per-client bound)" if not hyper.clipping else
                   "its replies carry no per-client bound")
            out.append(f"dp-noise-multiplier > 0 with algorithm {method.name!r} needs dp-clip > 0 (update clipping, as "
                       f"DP-FedAvg): {why}, so the sensitivity must come from an explicit clip")
    return out


# --- the mechanism --------------------------------------------------------------------------
class Privacy:
    """One run's DP mechanism on one backend process.

    ``population`` M and ``per_round`` K; ``state``: the global model (its keys: which are
    buffers); ``trainable``: the trainable parameters' names; ``max_lr_scale``: the task's
    largest lr scale (the bound's); ``adds_noise``: this process adds the round's noise (one
    process of a run); ``broadcast``: on several processes, makes every process hold process
    0's tensor (the secure client sample)."""

    def __init__(self, settings: DPSettings, *, population: int, per_round: int, seed: int,
                 state: Mapping[str, Tensor], trainable: Sequence[str], max_lr_scale: float = 1.0,
                 adds_noise: bool = True, broadcast: Callable[[Tensor], Tensor] | None = None) -> None:
        if not settings.enabled:
            raise ValueError("Privacy needs dp-noise-multiplier > 0")
        if population < 2:
            raise ValueError(f"dp-noise-multiplier > 0 needs clients: client-level DP hides one client among several, "
                             f"and this run has num-clients={population}")
        for problem in settings.problems():
            raise ValueError(problem)
        self.settings = settings
        self.population, self.per_round, self.seed = int(population), int(per_round), int(seed)
        self.trainable = list(trainable)
        others = [k for k in state if k not in set(self.trainable)]
        if others and settings.buffers == "refuse":
            raise ValueError(
                f"set dp-buffers=\"frozen\" (the buffers stay at their initial values) or use a model without buffers "
                f"(GroupNorm or LayerNorm for BatchNorm): the model holds buffers {others[:4]}"
                f"{' ...' if len(others) > 4 else ''} (BatchNorm running statistics), computed from the clients' "
                "data with no bound, which a DP run would release unnoised")
        self.max_lr_scale = float(max_lr_scale)
        self.adds_noise = adds_noise
        self.broadcast = broadcast
        self.delta = settings.delta or default_delta(self.population)
        self.accountant = Accountant(settings.noise_multiplier, self.per_round, self.population, self.delta,
                                     settings.accountant)
        self._samples: dict[int, list[int]] = {}

    @property
    def private(self) -> bool:
        """False in reproducible mode: the noise (and sample) come from the public seed."""
        return not self.settings.reproducible

    # --- the rounds a budget allows ----------------------------------------------------
    def last_round(self, num_rounds: int) -> int:
        """The last round within ``dp-max-epsilon`` (``num_rounds`` without one)."""
        if not self.settings.max_epsilon:
            return num_rounds
        return self.accountant.rounds_within(self.settings.max_epsilon, num_rounds)

    def stop_reason(self, num_rounds: int) -> str | None:
        """Why the run ends before ``num_rounds`` (None: it does not)."""
        last = self.last_round(num_rounds)
        if last >= num_rounds:
            return None
        return (f"stopped after round {last} of {num_rounds}: round {last + 1} would spend epsilon = "
                f"{self.accountant.epsilon(last + 1):.4g} > dp-max-epsilon = {self.settings.max_epsilon:g} "
                f"(delta = {self.delta:.3g})")

    # --- the round's clients -------------------------------------------------------------
    def participants(self, server_round: int) -> list[int]:
        """The round's clients: from the public seed (full participation, or reproducible mode),
        else drawn by the OS CSPRNG (amplification is claimed) once a round and kept."""
        if not self.accountant.amplified or self.settings.reproducible:
            return participants(self.seed, server_round, self.population, self.per_round)
        if server_round not in self._samples:
            chosen = torch.zeros(self.population, dtype=torch.float64)
            if self.adds_noise:
                chosen[secure_participants(self.population, self.per_round)] = 1.0
            if self.broadcast is not None:
                chosen = self.broadcast(chosen)
            self._samples = {server_round: [int(i) for i in torch.nonzero(chosen > 0.5).flatten().tolist()]}
        return list(self._samples[server_round])

    # --- the private mean of a round's last exchange ---------------------------------------
    def radius(self, rnd: Any, exchange: Any) -> float:
        """S of this exchange: dp-clip, or the method's bound on an honest client."""
        if self.settings.clip:
            return float(self.settings.clip)
        x0 = norm(rnd.state, self.trainable)
        bound = rnd.algorithm.bound(exchange.settings, x0, self.max_lr_scale)
        if bound is None or not math.isfinite(bound):
            raise ValueError(f"algorithm {rnd.algorithm.name!r} has no per-client bound in round {rnd.server_round} "
                             f"(max lr scale {self.max_lr_scale:g}): set dp-clip > 0")
        return float(bound)

    def noise(self, n: int, server_round: int) -> Tensor:
        """``n`` standard normal samples for the round (secure, or seeded in reproducible mode)."""
        return seeded_normal(n, self.seed, server_round) if self.settings.reproducible else secure_normal(n)

    def mean(self, rnd: Any, results: ClientResults, groups: Sequence[str], sums: dict[str, float]) -> Mean:
        """The round's released average of ``groups``: projected contributions, one noise draw on
        their sum, the fixed denominator K; buffers kept frozen. Records the DP metrics in ``rnd``."""
        exchange = rnd._last
        kinds = {**GROUP_KINDS, **rnd.algorithm.groups}
        released = [g for g in groups if kinds.get(g, "state") in ("state", "trainable")]
        if len(released) != 1 or any(kinds.get(g, "state") not in ("state", "trainable", "buffers") for g in groups):
            raise ValueError(f"a DP round releases one group of trainable values, got {list(groups)}")
        group = released[0]
        relative = kinds.get(group, "state") == "state"  # a state: the update is x_i - x_bar
        state, keys = rnd.state, self.trainable
        device = results.table.device
        n = len(results)
        radius = self.radius(rnd, exchange)
        shapes = {k: state[k].shape for k in keys}
        if n:
            arrays = results.arrays[group]
            if isinstance(arrays, Mapping):
                columns = [arrays[k].detach().to(device).reshape(n, -1).to(torch.float64) for k in keys]
            else:
                columns = [torch.stack([a[k].detach().to(device).reshape(-1) for a in arrays]).to(torch.float64)
                           for k in keys]
            matrix = torch.cat(columns, 1)
            if relative:
                matrix = matrix - torch.cat([state[k].detach().to(device).reshape(1, -1).to(torch.float64)
                                             for k in keys], 1)
            finite = torch.isfinite(matrix).all(1)
            matrix = torch.where(finite[:, None], matrix, torch.zeros_like(matrix))
            norms = matrix.norm(dim=1)  # before projection: how far the clients really moved
            matrix, outside = project(matrix, radius)
            matrix = torch.where(finite[:, None], matrix, torch.full_like(matrix, math.nan))  # still rejected by mean
            projected = float((outside & finite).sum())
        else:
            matrix = torch.zeros(0, sum(int(np.prod(s)) for s in shapes.values()), dtype=torch.float64, device=device)
            projected = 0.0
            norms = finite = torch.zeros(0, dtype=torch.bool, device=device)
        slots = self._norm_slots(rnd, results.ids, norms, finite)
        update, offset = {}, 0
        for k in keys:
            size = int(np.prod(shapes[k]))
            update[k] = matrix[:, offset:offset + size].reshape(n, *shapes[k])
            offset += size
        contributions = ClientResults(list(results.ids), {"update": update}, results.table, results.weights,
                                      dict(results.scalars))
        like = {"update": {k: torch.zeros(shapes[k], dtype=torch.float64, device=device) for k in keys}}
        z = self.settings.noise_multiplier
        expected = self.per_round  # fixed: clients that fail or are rejected contribute 0
        extra = None
        if self.adds_noise:
            extra = self.noise(offset, rnd.server_round).to(device) * (z * radius / expected)
        m = mean(contributions, like, aggregation="uniform", expected=expected, all_reduce=rnd.all_reduce,
                 sums={**sums, "dp-projected": projected, **slots}, fixed_denominator=True, extra=extra)
        average = m.arrays["update"]
        out: dict[str, dict[str, Tensor]] = {}
        for g in groups:
            kind = kinds.get(g, "state")
            if g == group and kind == "state":
                out[g] = {k: ((v.detach().to(torch.float64) + average[k].to(v.device)).to(v.dtype) if k in average
                              else v.detach().clone()) for k, v in state.items()}
            elif g == group:
                out[g] = {k: average[k].to(state[k].dtype) for k in keys}
            else:  # buffers: frozen at the global model's (its initial values)
                out[g] = {k: v.detach().clone() for k, v in state.items() if k not in set(keys)}
        totals = dict(m.sums)
        gathered = self._gathered_norms(totals, slots, norms, finite)
        rnd.dp_metrics = {
            "dp-epsilon": self.accountant.epsilon(rnd.server_round), "dp-delta": self.delta,
            "dp-sensitivity": radius, "dp-noise-std": z * radius, "dp-projected": int(round(totals.pop("dp-projected"))),
            **norm_statistics(gathered, radius), "dp-private": int(self.private),
        }
        return Mean(out, m.replies, m.metrics, m.scalars, m.ok, totals)

    def _norm_slots(self, rnd: Any, ids: Sequence[int], norms: Tensor, finite: Tensor) -> dict[str, float]:
        """On several processes (``rnd.all_reduce``), this process's clients' norms placed at their
        slots of the round's sample (``participants``), to be summed with the round's other counters
        in its one all-reduce: ``dp-norm:j`` the norm, ``dp-sound:j`` 1 where slot j's contribution
        is finite. One process: nothing (its norms are all of them)."""
        if rnd.all_reduce is None:
            return {}
        sample = self.participants(rnd.server_round)
        where = {pid: j for j, pid in enumerate(sample)}
        out = {f"dp-{kind}:{j}": 0.0 for j in range(len(sample)) for kind in ("norm", "sound")}
        for pid, value, sound in zip(ids, norms.tolist(), finite.tolist(), strict=True):
            if pid not in where:
                raise ValueError(f"client {pid} is not in round {rnd.server_round}'s sample")
            if sound:
                out[f"dp-norm:{where[pid]}"], out[f"dp-sound:{where[pid]}"] = float(value), 1.0
        return out

    @staticmethod
    def _gathered_norms(totals: dict[str, float], slots: Mapping[str, float], norms: Tensor, finite: Tensor) -> Tensor:
        """The sound contributions' norms of every process (the slots' sums taken out of ``totals``)."""
        if not slots:
            return norms[finite] if len(norms) else norms.to(torch.float64)
        values = {key: totals.pop(key) for key in slots}
        count = len(slots) // 2
        return torch.tensor([values[f"dp-norm:{j}"] for j in range(count) if values[f"dp-sound:{j}"] > 0.5],
                            dtype=torch.float64)

    # --- what the results say --------------------------------------------------------------
    def summary(self) -> list[str]:
        s = self.settings
        where = f"dp-clip C = {s.clip:g} (update clipping)" if s.clip else "the method's own bound (no extra clipping)"
        lines = [f"client-level DP: noise multiplier z = {s.noise_multiplier:g}, sensitivity S from {where}; "
                 f"N(0, z^2 S^2) on the sum of the round's contributions, divided by K = {self.per_round}",
                 self.accountant.describe()]
        if s.max_epsilon:
            lines.append(f"budget: dp-max-epsilon = {s.max_epsilon:g}")
        if not self.private:
            lines.append("dp-reproducible = true: noise and client sample from the public seed -- NOT private")
        return lines

    def header(self) -> dict[str, Any]:
        """The results header's ``privacy`` entry."""
        s = self.settings
        return {"private": self.private, "noise-multiplier": s.noise_multiplier, "dp-clip": s.clip or None,
                "delta": self.delta, "max-epsilon": s.max_epsilon or None, "buffers": s.buffers,
                "accountant": s.accountant,
                "relation": "replace-one client", "denominator": self.per_round, "population": self.population,
                "accounting": self.accountant.describe(),
                "randomness": ("seeded from the public seed: NOT private" if s.reproducible else
                               "OS CSPRNG (os.urandom noise; secrets.SystemRandom client sample when K < M)")}
