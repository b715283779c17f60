"""Tasks shared by both sides: data sets and models (pure PyTorch, no flwr).

``load_task(cfg)`` returns the task named by the ``task`` config key. Every task offers:
``train_size``, ``labels`` (for partitioners), ``build_model()``, ``round_batches(...)``
(a client's minibatches of one round), ``loss(model, batch)`` and
``evaluate(model, device)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulations.config import RunConfig


def load_task(cfg: RunConfig) -> Any:
    if cfg.task == "digits":
        from .digits import digits_task

        return digits_task()
    raise ValueError(f"task {cfg.task!r} is not available yet")
