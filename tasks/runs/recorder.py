"""A run's bookkeeping after every round, one definition for the ServerApp and the engine.

``RunRecorder.record(round, state, report, ...)`` makes the round's results row from the
method's typed ``RoundReport`` (``strategies.methods.algorithm``): it fails the run when fewer sound
replies came than ``min-replies`` asks for (naming what failed), evaluates the global model
when the round is an evaluation round (``tasks.runs.evaluation``), keeps the training
wall-clock (evaluation excluded), appends the row to ``results.jsonl``, refuses to go on from
a non-finite model, and checkpoints (``tasks.runs.checkpoint``). Without a folder (an engine
run that writes nothing, or a process other than the first) it only builds the rows.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from strategies.methods.algorithm import RoundReport

from ..config import RunConfig
from .checkpoint import Checkpoint, refuse_non_finite, save_checkpoint
from .evaluation import Evaluator
from .results import ResultsWriter, RunClock, check_replies, round_row, save_weights


class RunRecorder:
    """Rows, evaluation, checkpoints of one run (``folder`` None: rows and evaluation only)."""

    def __init__(self, cfg: RunConfig, evaluator: Evaluator | None, folder: Path | None, header: Mapping[str, Any],
                 resumed: Checkpoint | None = None, last_round: int | None = None,
                 stop_reason: str | None = None, resume_resets: str | None = None) -> None:
        self.cfg = cfg
        #: what a resume could not restore (e.g. clients' state living on their hosts), said in the resumed row
        self.resume_resets = resume_resets if resumed is not None else None
        #: the run's last round (before num-rounds when a DP budget ends it: ``stop_reason`` says why)
        self.last_round = cfg.num_rounds if last_round is None else last_round
        self.stop_reason = stop_reason if self.last_round < cfg.num_rounds else None
        self.evaluator = evaluator
        self.folder = folder
        self.done = resumed.round if resumed is not None else 0
        self.writer = (ResultsWriter(folder, cfg.to_mapping(), dict(header), resume_from=self.done if resumed else None)
                       if folder is not None else None)
        self.clock = RunClock(float(resumed.meta.get("wall-clock", 0.0)) if resumed is not None else 0.0)
        self.rows: list[dict[str, Any]] = []

    @property
    def path(self) -> Path | None:
        return self.writer.path if self.writer is not None else None

    def record(self, server_round: int, epoch: float | None, state: Mapping[str, Tensor], report: RoundReport | None,
               *, failures: Sequence[str] = (), failed_nodes: Sequence[Any] = (), rejected: int = 0,
               server_state: Mapping[str, Tensor] | None = None) -> dict[str, Any]:
        """The row of ``server_round`` (0: the initial model, no report) with the global ``state``
        after it; ``failures``: what failed or was rejected (named), ``failed_nodes`` the
        clients that failed, ``rejected``: replies the backend rejected before the method saw
        them; ``server_state``: the method's state to checkpoint."""
        t0 = time.monotonic()
        cfg = self.cfg
        row = round_row(server_round, epoch)
        if server_round > 0:
            if report is None:
                raise ValueError(f"round {server_round} has no report")
            check_replies(server_round, report.replies, cfg.required_replies, list(failures))
            metrics = dict(report.metrics)
            metrics["rejected-replies"] = int(metrics.get("rejected-replies", 0)) + rejected
            row = round_row(server_round, epoch, lr=report.lr, clip=report.clip, failed_nodes=list(failed_nodes),
                            failures=list(failures), metrics=metrics,
                            resumed_from=self.done if self.done and server_round == self.done + 1 else None)
            if self.resume_resets and server_round == self.done + 1:
                row["resume-reset"] = self.resume_resets
        stops = server_round == self.last_round and self.stop_reason is not None
        if stops and server_round > 0:
            row["stopped"] = self.stop_reason
        evaluation: dict[str, float | int] = {}
        if self.evaluator is not None and (cfg.evaluates(server_round) or stops):
            evaluation = self.evaluator(state)
            row.update(evaluation)
        self.clock.exclude(time.monotonic() - t0)
        row["wall-clock"] = self.clock.now()
        self.rows.append(row)
        if self.writer is not None:
            self.writer.row(row)
            if server_round > 0:
                refuse_non_finite(state, server_round)
            if self.checkpoint_due(server_round):
                save_checkpoint(self.folder, Checkpoint(round=server_round, arrays=dict(state),
                                                        strategy_state=dict(server_state or {}), meta={
                    "config": cfg.to_mapping(), "wall-clock": row["wall-clock"], "num-rounds": cfg.num_rounds}))
        self.last_evaluation = evaluation
        return row

    def checkpoint_due(self, server_round: int) -> bool:
        """Whether ``record`` checkpoints after ``server_round`` (every ``checkpoint-every`` rounds, the
        last, and a run stopped early by its DP budget)."""
        stops = server_round == self.last_round and self.stop_reason is not None
        return self.cfg.checkpoints(server_round) or (stops and server_round > 0 and self.cfg.checkpoint_every > 0)

    def finish(self, state: Mapping[str, Tensor]) -> Path | None:
        """The final weights (``model.pt``), written atomically; None without a folder."""
        if self.folder is None:
            return None
        if self.writer is not None:
            self.writer.close()
        return save_weights(dict(state), self.folder / "model.pt")
