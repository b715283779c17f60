"""The local update of CELGC, as the client API of ``strategies.clientapp`` defines it.

The step (one global gradient norm, x <- x - min(lr, clip/|g|)(g + wd x), skip of
non-finite steps) is ``strategies.clipped_sgd.clipped_sgd_step``; the round's settings,
``local_update`` over a round's batches and the ``RoundStats`` sums are
``strategies.local_update`` -- the same functions any user's ClientApp calls. Their names
stay importable from here for this project's code (engine, benchmarks, tests).
"""

from __future__ import annotations

from strategies.clipped_sgd import StepConfig, clipped_sgd_step, grad_norm, step_size
from strategies.local_update import LossFn, RoundSettings, RoundStats, count_examples, local_update, split_loss

__all__ = ["LossFn", "RoundSettings", "RoundStats", "StepConfig", "clipped_sgd_step", "count_examples", "grad_norm",
           "local_update", "split_loss", "step_size"]
