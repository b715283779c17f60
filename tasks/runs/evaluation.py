"""Central evaluation of the global model, one definition for the ServerApp and the engine
(no flwr import): the task's held-out metrics, with ``average-iterates`` the running mean of
the global models after the non-monotone trigger (``strategies.core.iterate_average``), and with
``eval-train`` the whole training set (``train-eval-*``, the authors' CIFAR-10 "train loss":
the averaged model on the training set, beside the clients' running ``train-loss``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from strategies.core.iterate_average import IterateAverage

from .. import validation_set
from ..config import RunConfig

#: The loss that drives the trigger: the validation loss, or the test loss for tasks without
#: a validation set.
TRIGGER_KEYS = ("valid-loss", "test-loss")


class Evaluator:
    """Evaluates global states of one run (keeps the iterate average across evaluations)."""

    def __init__(self, cfg: RunConfig, task: Any, model: nn.Module, device: torch.device) -> None:
        if cfg.eval_train and not callable(getattr(task, "evaluate_train", None)):
            raise ValueError(f"eval-train = true but task {cfg.task!r} has no evaluate_train (tasks/protocol.py)")
        self.task, self.model, self.device = task, model, device
        self.valid = validation_set(cfg)  # valid-fraction > 0: the clients' held-out shares
        self.eval_train = cfg.eval_train
        self.average = IterateAverage(cfg.nonmono) if cfg.average_iterates else None

    def __call__(self, state: Mapping[str, Tensor]) -> dict[str, float | int]:
        """The metrics of one evaluation of the global ``state`` (the row's test/valid keys)."""
        if self.average is not None:
            state = self.average.at_evaluation(state)
        self.model.load_state_dict(state)
        metrics: dict[str, float | int] = dict(self.task.evaluate(self.model, self.device))
        if self.valid is not None:
            held = self.task.evaluate_indices(self.model, self.device, self.valid)
            metrics.update({f"valid-{k.split('-', 1)[1]}": v for k, v in held.items()})
        if self.eval_train:
            metrics.update(self.task.evaluate_train(self.model, self.device))
        if self.average is not None:
            metrics["averaged-iterates"] = self.average.count
            if not self.average.started:
                key = next((k for k in TRIGGER_KEYS if k in metrics), None)
                if key is None:
                    raise ValueError(f"average-iterates needs a {' or '.join(TRIGGER_KEYS)} from the task's evaluation")
                self.average.observe(float(metrics[key]))
        return metrics
