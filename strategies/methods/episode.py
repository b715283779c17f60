"""EPISODE: episodic gradient clipping with periodic resampled corrections (every backend).

Crawshaw, Bao, Liu (ICLR 2023, https://arxiv.org/abs/2302.07155), Algorithm 1; the math
is ``strategies.core.episode_corrections``. A round has two exchanges with the sampled clients:

1. ``episode-resample``: every client sends G_r^i, its gradient at the global point x_r on
   a fresh minibatch (drawn like the local steps' ones but from its own sampling stream,
   ``strategies.core.episode_corrections.resample_seed``, without the task's client state); the server
   averages them into G_r (uniformly, or by examples) and builds each client's correction
   c_i = G_r - G_r^i. A client whose resample failed or was unsound is left out of the round
   (``resample-failures``).
2. ``episode``: each client receives c_i and |G_r| and runs I local steps with the corrected
   direction d = g + lambda x (+ momentum) + c_i, the whole round clipping iff
   |G_r| > gamma / eta: x <- x - (gamma / |d|) d in a clipping round, x <- x - eta d
   otherwise; the server averages the parameters.

The bound on an honest reply: a clipping round's steps have length gamma (times the batch's
lr scale) each, so I gamma; a round that does not clip takes eta-steps along directions no
one bounds (the correction and the local gradients away from x_r are unbounded): no bound,
and no honest reply is rejected for its displacement. The step reads |d| on the host, so the
clients run one after another (no vmap).
"""

from __future__ import annotations

from ..core.clipped_sgd import grad_norm
from ..core.episode_corrections import clipping_round, episode_step, resample_seed
from ..core.local_update import Rule
from ..core.settings import Mode, RoundSettings
from .algorithm import Algorithm, Exchange, Round, Server
from .reduce import ClientResults, per_client


def _rule(global_norm: float) -> Rule:
    def fn(params, grads, bufs, cfg, lr_scale, extra):
        return episode_step(params, grads, extra, bufs, cfg, clipping_round(global_norm, cfg, lr_scale), lr_scale)
    return Rule(fn, vmappable=False, tensor_scale=False)


class EPISODE(Algorithm):
    """Resampled gradients at the global point, corrections, I corrected local steps."""

    name = "episode"
    paper = "Crawshaw, Bao, Liu, ICLR 2023, https://arxiv.org/abs/2302.07155"
    modes = (Mode.RESAMPLE, Mode.EPISODE)
    vectorises = False

    @classmethod
    def config_problems(cls, cfg) -> list[str]:
        if cfg.task in ("ptb", "wikitext2") and cfg.client_state != "reset":
            return [f"algorithm 'episode' resamples gradients from stateless minibatches: with task {cfg.task!r} set "
                    "client-state = \"reset\""]
        return []

    def server(self, rnd: Round) -> Server:
        results = yield rnd.exchange(Mode.RESAMPLE)
        g = rnd.mean(results, "grads")  # G_r over the sound resamples
        failures = rnd.expected - g.replies
        if g.arrays is None:
            return rnd.unchanged(**{"resample-failures": failures})
        g_r = g.arrays["grads"]
        norm = float(grad_norm(list(g_r.values())))
        kept = [i for i, ok in enumerate(g.ok.tolist()) if ok]
        mine = per_client(results.arrays["grads"])
        corrections = [{k: g_r[k] - mine[i][k].to(g_r[k].device) for k in g_r} for i in kept]
        results = yield rnd.exchange(Mode.EPISODE, clients=[results.ids[i] for i in kept],
                                     arrays={"correction": corrections}, expected=g.replies, global_grad_norm=norm)
        average = rnd.mean(results, "arrays")
        return rnd.finish(average.arrays["arrays"] if average.arrays else None, average,
                          **{"resample-failures": failures, "global-grad-norm": norm})

    @classmethod
    def client(cls, exchange: Exchange, group) -> ClientResults:
        s = exchange.settings
        if s.mode is Mode.RESAMPLE:  # G_r^i: a fresh minibatch, the running client state untouched
            grads, table, _ = group.gradients(s, seed=resample_seed(group.seed), stateless=True)
            return group.results({"grads": grads, "buffers": group.buffers()}, table)
        names = group.trainable
        corrections = exchange.arrays["correction"]
        for c in corrections:
            if set(c) != set(names):
                raise ValueError(f"the correction must hold every trainable parameter: missing "
                                 f"{sorted(set(names) - set(c))}, unexpected {sorted(set(c) - set(names))}")
        table = group.train(s, rule=_rule(float(s.global_grad_norm)), extra=[[c[k] for k in names] for c in corrections])
        return group.results({"arrays": group.states()}, table)

    def bound(self, settings: RoundSettings, x0_norm: float = 0.0, max_lr_scale: float = 1.0) -> float | None:
        if settings.mode is Mode.EPISODE and settings.global_grad_norm is not None \
                and clipping_round(settings.global_grad_norm, settings.step):
            return settings.local_steps * settings.clip * max_lr_scale  # each normalised step: gamma (x lr scale)
        return None

    def summary(self) -> list[str]:
        return [f"EPISODE ({self.paper}): resampled gradients at the global point -> corrections c_i and one "
                f"clip decision; I = {self.hyper.local_steps} corrected local steps a round"]
