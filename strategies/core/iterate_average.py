"""Evaluation with averaged iterates, started by the non-monotone trigger (pure PyTorch).

What the paper's authors do for the language models (AWD-LSTM's NT-ASGD idea applied to
evaluation only): at each evaluation, while averaging has not started, the global model is
evaluated and its validation loss ``L`` recorded; averaging starts once ``L`` is worse than
the best of the losses recorded before the last ``nonmono`` ones (and more than ``nonmono``
are recorded). From the next evaluation on, each evaluated global model enters a running mean
(the k-th one with weight 1/k) and the MEAN is evaluated and reported; training itself goes
on from the global model, never from the mean.

    avg = IterateAverage(nonmono=5)
    state_to_evaluate = avg.at_evaluation(global_state)   # the mean once started
    avg.observe(valid_loss)                                # the trigger (ignored once started)

Floating-point tensors are averaged in float64 and cast back; integer tensors (BatchNorm's
``num_batches_tracked``) are taken from the latest model.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor


class IterateAverage:
    """The running mean of the evaluated global models after the non-monotone trigger."""

    def __init__(self, nonmono: int = 5) -> None:
        if isinstance(nonmono, bool) or not isinstance(nonmono, int) or nonmono < 1:
            raise ValueError(f"nonmono must be an integer >= 1, got {nonmono!r}")
        self.nonmono = nonmono
        self.history: list[float] = []
        self.count = 0  # models in the mean (0: averaging has not started)
        self.started = False
        self._mean: dict[str, Tensor] = {}

    def observe(self, loss: float) -> bool:
        """Record one evaluation's validation loss of the (non-averaged) global model; True
        when this starts the averaging (from the next evaluation on)."""
        if self.started:
            return False
        loss = float(loss)
        if len(self.history) > self.nonmono and loss > min(self.history[: -self.nonmono]):
            self.started = True
        self.history.append(loss)
        return self.started

    def at_evaluation(self, state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """The model to evaluate now: ``state`` before the trigger; afterwards ``state`` joins
        the running mean and the mean is returned."""
        if not self.started:
            return state
        self.count += 1
        for k, v in state.items():
            if v.is_floating_point():
                x = v.detach().double()
                self._mean[k] = x.clone() if self.count == 1 else self._mean[k].add_(x.sub(self._mean[k]).div_(self.count))
        return {k: self._mean[k].to(v.dtype) if v.is_floating_point() else v for k, v in state.items()}
