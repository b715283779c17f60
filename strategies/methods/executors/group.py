"""A backend's clients in one exchange: an executor, their batches, their kept state (pure).

``ClientGroup`` is what a method's client side (``Algorithm.client``) works on. It wraps an
executor (``SequentialClients`` or ``VmapClients``) holding ``n`` clients placed at the
global model, and knows how to draw each client's minibatches (``draw``, given by the
backend: a pure function of (seed, partition id, round), ``tasks.sampling``), the state a
task keeps per client (the language models' hidden state; ``None``: stateless), the state
the method keeps per client (``memory``: e.g. SCAFFOLD's control variate), and the seeds of
random layers (from (seed, round, partition id, step)). The ClientApp builds one for its one
client, the engine one for the clients of its process: the same code runs on both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...core.client_metrics import COLUMNS
from ...core.clipped_sgd import grad_norm
from ...core.local_update import Rule, clipped_rule
from ...core.settings import Hyper, RoundSettings
from ..reduce import ClientArrays, ClientResults, is_stacked

#: ``draw(partition_id, state, *, seed, server_round, local_steps, batch_size) -> batches``
Draw = Callable[..., Iterable[Any]]

#: the seed tag of the random layers' per-step seeds (dropout)
_RANDOM_TAG = 0xE9


class ClientGroup:
    """``executor``'s clients ``ids`` (partition ids) in one exchange; ``seed``: the run's seed
    (the training stream; a method may draw from another, e.g. EPISODE's resample); ``base``:
    the run's hyper-parameters (a CUDA graph is captured once, at the run's base values)."""

    def __init__(self, executor: Any, ids: list[int], draw: Draw, *, seed: int,
                 task_states: list[dict[str, Tensor] | None] | None = None,
                 memory: list[dict[str, Tensor]] | None = None, base: Hyper | None = None) -> None:
        if executor.n != len(ids):
            raise ValueError(f"the executor holds {executor.n} clients, the group names {len(ids)}")
        self.executor = executor
        self.ids = list(ids)
        self.draw = draw
        self.seed = seed
        self.task_states = task_states if task_states is not None else [None] * len(ids)
        self.memory = memory if memory is not None else [{} for _ in ids]
        self.base = base

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def device(self) -> torch.device:
        return self.executor.device

    @property
    def trainable(self) -> list[str]:
        return list(self.executor.trainable)

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Every client starts the exchange from ``state`` (the global model)."""
        self.executor.load(state)

    # --- the client primitives -----------------------------------------------------------
    def _seeds(self, server_round: int) -> Callable[[int, int], int]:
        def seed(i: int, step: int) -> int:
            entropy = [self.seed, server_round, self.ids[i], step, _RANDOM_TAG]
            return int(np.random.SeedSequence(entropy).generate_state(1)[0])
        return seed

    def _batches(self, settings: RoundSettings, steps: int, seed: int, stateless: bool) -> list[Any]:
        return [iter(self.draw(pid, None if stateless else state, seed=seed, server_round=settings.server_round,
                               local_steps=steps, batch_size=settings.batch_size))
                for pid, state in zip(self.ids, self.task_states, strict=True)]

    def train(self, settings: RoundSettings, rule: Rule = clipped_rule,
              extra: list[list[Tensor]] | None = None) -> Tensor:
        """``settings.local_steps`` steps of ``rule`` for every client (``extra``: each client's
        tensors the rule reads, one per trainable parameter); the clients' metrics table."""
        iters = self._batches(settings, settings.local_steps, self.seed, stateless=False)
        if self.executor.vectorised:
            base = self.base
            if getattr(self.executor, "cuda_graphs", False) and base is not None:
                # one capture for the run: the run's base values, the schedule as a factor
                stats = self.executor.run_round(iters, base.step(), lr_scale=settings.lr / base.lr, rule=rule,
                                                extra=extra)
            else:
                stats = self.executor.run_round(iters, settings.step, rule=rule, extra=extra)
            return stats.table()
        stats = self.executor.run_round(iters, settings.step, seed=self._seeds(settings.server_round), rule=rule,
                                        extra=extra)
        return torch.cat([s.table() for s in stats]) if stats else _empty(self.device)

    def gradients(self, settings: RoundSettings, seed: int | None = None, stateless: bool = False,
                  ) -> tuple[ClientArrays, Tensor, dict[str, Tensor]]:
        """Every client's gradient at its point on ONE minibatch (``seed``: another sampling
        stream than the training one; ``stateless``: without the task's client state):
        (the gradients by trainable parameter, the metrics table, per-client scalars --
        ``lr-scale`` where the batches carry one)."""
        iters = self._batches(settings, 1, self.seed if seed is None else seed, stateless)
        grads, loss, scale, examples, ce = self.executor.gradients(iters, seed=self._seeds(settings.server_round))
        if is_stacked(grads):
            norms = torch.func.vmap(grad_norm)([grads[k] for k in self.trainable])
        else:
            norms = torch.stack([grad_norm(list(g.values())) for g in grads])
        table = torch.full((self.n, len(COLUMNS)), float("nan"), dtype=torch.float64, device=self.device)
        table[:, COLUMNS.index("train-loss")] = loss.double()
        table[:, COLUMNS.index("grad-norm")] = norms.double()
        table[:, COLUMNS.index("num-examples")] = examples
        table[:, COLUMNS.index("num-steps")] = 1.0
        table[:, COLUMNS.index("skipped-steps")] = 0.0
        if ce is not None:
            table[:, COLUMNS.index("train-ce")] = ce.double()
        return grads, table, ({} if scale is None else {"lr-scale": scale.double()})

    def states(self) -> ClientArrays:
        """The clients' whole states (parameters and buffers)."""
        return self.executor.client_states()

    def buffers(self) -> ClientArrays:
        """The clients' states without the trainable parameters (BatchNorm statistics, ...)."""
        names = set(self.trainable)
        states = self.states()
        if is_stacked(states):
            return {k: v for k, v in states.items() if k not in names}
        return [{k: v for k, v in s.items() if k not in names} for s in states]

    def results(self, arrays: dict[str, ClientArrays], table: Tensor, scalars: dict[str, Tensor] | None = None,
                ) -> ClientResults:
        """The exchange's results (averaging weights: the examples each client processed)."""
        return ClientResults(self.ids, arrays, table, table[:, COLUMNS.index("num-examples")], dict(scalars or {}))


def _empty(device: torch.device) -> Tensor:
    return torch.zeros((0, len(COLUMNS)), dtype=torch.float64, device=device)
