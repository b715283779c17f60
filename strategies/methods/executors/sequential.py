"""Clients one model each, stepped one after another: the executor for any model.

Each client has its own ``nn.Module`` and takes its steps with autograd and the method's
step rule (``strategies.core.local_update.take_step``, the one step every client path takes).
It is what this project's ClientApp runs (one client) and the engine's path for models
``torch.func.vmap`` cannot take (``nn.LSTM`` has no vmap batching rule, random layers cannot
be drawn per client under vmap's default ``randomness="error"``). On CUDA every client runs
on its own stream, the steps interleaved client by client, so independent clients overlap on
the GPU; nothing reads back to the host inside the round.

Random layers draw from the device's default generator, reseeded before every step of every
client from (seed, round, partition id, step) inside ``torch.random.fork_rng`` (tasks that
seed their own dropout, like the language task, override it), so dropout masks depend on
none of: the order of clients, the streams, the number of processes, the backend.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ...core.clipped_sgd import StepConfig
from ...core.local_update import LossFn, RoundStats, Rule, clipped_rule, default_count, gradient_at, take_step, trainable

Seed = Callable[[int, int], int]  # (client index, step) -> seed of that step's random ops
Count = Callable[[Any], int]


class SequentialClients:
    """``n`` clients, one ``nn.Module`` each (built by ``build_model``) on ``device``."""

    path = "sequential"
    vectorised = False

    def __init__(self, build_model: Callable[[], nn.Module], loss_fn: LossFn, n: int, device: torch.device, *,
                 count: Count = default_count, streams: bool = True) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1 clients, got {n}")
        self.models = [build_model().to(device) for _ in range(n)]
        self.loss_fn = loss_fn
        self.count = count
        self.device = device
        self.keys = list(self.models[0].state_dict())
        self.trainable = [k for k, p in self.models[0].named_parameters() if p.requires_grad]
        cuda = device.type == "cuda"
        index = device.index if device.index is not None else (torch.cuda.current_device() if cuda else 0)
        self._generator = torch.cuda.default_generators[index] if cuda else torch.default_generator
        use_streams = streams and cuda and n > 1
        self.streams = [torch.cuda.Stream(device) for _ in range(n)] if use_streams else None

    @property
    def n(self) -> int:
        return len(self.models)

    def load(self, state: Mapping[str, Tensor]) -> None:
        for model in self.models:
            model.load_state_dict(state)

    def subset(self, positions: list[int]) -> SequentialClients:
        """The clients at ``positions`` (sharing their modules): an exchange some clients left."""
        if list(positions) == list(range(self.n)):
            return self
        view = copy.copy(self)
        view.models = [self.models[i] for i in positions]
        view.streams = None if self.streams is None else [self.streams[i] for i in positions]
        return view

    def client_states(self) -> list[dict[str, Tensor]]:
        """Each client's state (the modules' own tensors, not copies)."""
        return [m.state_dict() for m in self.models]

    def stacked_state(self) -> dict[str, Tensor]:
        states = self.client_states()
        return {k: torch.stack([s[k].detach() for s in states]) for k in self.keys}

    @contextlib.contextmanager
    def _round(self):
        """Fork the RNG (reseeded per step) and, on CUDA, fan out to / join the streams."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if self.streams is None:
                yield
                return
            main = torch.cuda.current_stream(self.device)
            for s in self.streams:
                s.wait_stream(main)
            yield
            for s in self.streams:
                main.wait_stream(s)

    def _on(self, i: int):
        return torch.cuda.stream(self.streams[i]) if self.streams is not None else contextlib.nullcontext()

    def run_round(self, iters: list[Iterator[Any]], cfg: StepConfig, seed: Seed | None = None,
                  rule: Rule = clipped_rule, extra: list[list[Tensor]] | None = None) -> list[RoundStats]:
        """All local steps of one round (step-major: every client's step s, then s + 1).

        ``rule``: the method's local step; ``extra``: each client's tensors it reads (one per
        trainable parameter), e.g. EPISODE's correction."""
        if len(iters) != self.n:
            raise ValueError(f"{len(iters)} batch streams for {self.n} clients")
        params = [trainable(m) for m in self.models]
        if extra is not None:
            extra = [[t.to(self.device) for t in e] for e in extra]
        bufs: list[list[Tensor] | None] = [
            [torch.zeros_like(p) for p in ps] if cfg.momentum > 0 else None for ps in params]
        totals = [RoundStats.zeros(self.device) for _ in self.models]
        one = torch.ones((), device=self.device) if self.device.type == "cuda" else None
        with self._round():
            for m in self.models:
                m.train()
            step = 0
            live = True
            while live:
                for i, model in enumerate(self.models):
                    with self._on(i):
                        batch = next(iters[i], None)
                        if batch is None:
                            live = False
                            continue
                        if seed is not None:
                            self._generator.manual_seed(seed(i, step))
                        bufs[i] = take_step(model, params[i], bufs[i], batch, self.loss_fn, rule, cfg, totals[i],
                                            self.count(batch), None if extra is None else extra[i], one)
                step += 1
            for ps in params:
                for p in ps:
                    p.grad = None
        return totals

    def gradients(self, iters: list[Iterator[Any]], seed: Seed | None = None,
                  ) -> tuple[list[dict[str, Tensor]], Tensor, Tensor | None, Tensor, Tensor | None]:
        """Each client's gradient on its next batch: (one dict of gradients per client, loss
        [n], per-client lr_scale or None, examples [n], cross-entropy [n] or None); the models
        keep the buffers their forward pass updated."""
        grads, losses, scales, examples, ces = [], [], [], [], []
        with self._round():
            for i, model in enumerate(self.models):
                with self._on(i):
                    batch = next(iters[i])
                    if seed is not None:
                        self._generator.manual_seed(seed(i, 0))
                    g, loss, ce = gradient_at(model, batch, self.loss_fn)
                    grads.append(g)
                    if ce is not None:
                        ces.append(ce.float())
                    losses.append(loss.float())
                    scales.append(getattr(batch, "lr_scale", None))
                    examples.append(float(self.count(batch)))
        ce = torch.stack(ces) if len(ces) == len(losses) else None
        scale = None if all(s is None for s in scales) else torch.tensor(  # float64: as the ClientApp reports it
            [1.0 if s is None else float(s) for s in scales], dtype=torch.float64, device=self.device)
        return grads, torch.stack(losses), scale, torch.tensor(examples, dtype=torch.float64, device=self.device), ce
