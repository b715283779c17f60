"""Naive parallel clipping: the paper's baseline, one clipped step per communication.

Clipped SGD of Zhang et al. (2020) run data-parallel on N workers, as in Liu et al.
(NeurIPS 2022, https://arxiv.org/abs/2205.05040), section 5: every round each client
computes its stochastic gradient g_i at the shared point x on ONE minibatch and sends it
with its buffers (BatchNorm statistics after that forward pass); the server averages them
into g_bar and takes one step

    x <- x - min(lr, clip / |g_bar|) (g_bar + weight_decay x)      (strategies.core.parallel_clip_step)

with the clients' own step. With N clients of batch b this equals single-machine clipped SGD
at batch N b on the union of the same samples (for a mean-reduced loss and a model without
batch statistics). With momentum > 0 the server keeps the heavy-ball buffer across rounds
(checkpointed). Language-model clients report ``lr-scale`` (the AWD-LSTM seq_len / bptt);
the step uses its mean over the replies (all clients draw the same length each round).
Round metrics: ``grad-norm`` is |g_bar|, ``clip-fraction`` 1.0 if the step clipped,
``skipped-steps`` 1 if |g_bar| was not finite, ``client-grad-norm`` the clients' mean norm.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..core.parallel_clip_step import naive_server_step
from ..core.settings import Hyper, Mode
from .algorithm import Algorithm, Exchange, Round, Server
from .reduce import ClientResults

PREFIX = "momentum."


class NaiveParallelClip(Algorithm):
    """One step a round: clients send gradients, the server clips their average."""

    name = "naive"
    paper = "Zhang et al. 2020 clipped SGD run data-parallel, the baseline of arXiv 2205.05040"
    modes = (Mode.GRADIENT,)
    node_sums = True  # the server steps on the gradients' and buffers' averages alone

    def __init__(self, hyper: Hyper, **kw: Any) -> None:
        super().__init__(hyper, **kw)
        self.momentum: dict[str, Tensor] | None = None

    @classmethod
    def problems(cls, hyper: Hyper) -> list[str]:
        if hyper.local_steps != 1:
            return [f"local-steps must be 1 for algorithm 'naive' (one step a round), got {hyper.local_steps}"]
        return []

    def server(self, rnd: Round) -> Server:
        results = yield rnd.exchange(Mode.GRADIENT)
        average = rnd.mean(results, "grads", "buffers")
        metrics = dict(average.metrics)
        if "grad-norm" in metrics:
            metrics["client-grad-norm"] = metrics.pop("grad-norm")
        if average.arrays is None:
            return rnd.finish(None, average, metrics)
        grads, buffers = average.arrays["grads"], average.arrays["buffers"]
        step = self.hyper.step(rnd.lr, rnd.clip)
        params, self.momentum, stats = naive_server_step(rnd.state, grads, self.momentum, step,
                                                         average.scalars.get("lr-scale", 1.0))
        state = dict(rnd.state)
        state.update(params)
        state.update(buffers)
        return rnd.finish(state, average, metrics, **stats)

    @classmethod
    def client(cls, exchange: Exchange, group) -> ClientResults:
        grads, table, scalars = group.gradients(exchange.settings)
        return group.results({"grads": grads, "buffers": group.buffers()}, table, scalars)

    def check_result(self, exchange: Exchange, arrays: Mapping[str, Mapping[str, Tensor]], metrics: Mapping[str, Any],
                     trainable: Any, max_lr_scale: float = 1.0) -> str | None:
        """The reported ``lr-scale`` scales the server's step: it must lie in (0, max_lr_scale]."""
        scale = metrics.get("lr-scale", 1.0)
        if not (0 < float(scale) <= max_lr_scale):
            return f"lr-scale must be in (0, {max_lr_scale:g}], got {scale!r}"
        return None

    def state_dict(self) -> dict[str, Tensor]:
        return {f"{PREFIX}{k}": v for k, v in (self.momentum or {}).items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        unknown = sorted(k for k in state if not k.startswith(PREFIX))
        if unknown:
            raise ValueError(f"naive keeps only its momentum buffer, the checkpoint holds {unknown}")
        momentum = {k.removeprefix(PREFIX): v for k, v in state.items()}
        self.momentum = momentum or None

    @classmethod
    def label(cls, local_steps: int | str) -> str:
        return "naive parallel clipping"

    def summary(self) -> list[str]:
        return ["naive parallel clipping: one step a round, clients send gradients, the server clips their average"
                + (" (its momentum kept by the server)" if self.hyper.momentum > 0 else "")]
