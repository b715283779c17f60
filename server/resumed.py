"""A Flower strategy continued from a checkpoint: its round r seen as round r - done."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy


class ResumedStrategy(Strategy):
    """``inner`` seen from round ``done`` on: its round r is this wrapper's round r - done.

    ``ResumedStrategy(s, k).start(num_rounds=n - k, ...)`` runs rounds k + 1 ... n of ``s``
    in Flower's ``Strategy.start`` loop. Its initial ``evaluate_fn(0, ...)`` call is the
    state already evaluated by the interrupted run: wrap evaluate_fn with ``shift_evaluate``.
    """

    def __init__(self, inner: Strategy, done: int) -> None:
        if done < 0:
            raise ValueError(f"done must be >= 0, got {done}")
        self.inner = inner
        self.done = done

    def summary(self) -> None:
        self.inner.summary()

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self.inner.configure_train(server_round + self.done, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.inner.aggregate_train(server_round + self.done, replies)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self.inner.configure_evaluate(server_round + self.done, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round + self.done, replies)

    def shift_evaluate(self, evaluate_fn):  # noqa: ANN001, ANN201 - Flower's evaluate_fn type
        """evaluate_fn in the inner strategy's round numbers; skips the resumed round itself."""
        def shifted(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if self.done and server_round == 0:
                return None
            return evaluate_fn(server_round + self.done, arrays)
        return shifted
