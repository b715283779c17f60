"""Per-round progress of an engine run (rich), shown by process 0 only."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _fmt(value: Any, spec: str) -> str:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return format(value, spec)
    return "-"


class RoundProgress:
    """A progress bar over rounds with the latest loss, accuracy, lr, clip fraction (and a DP run's epsilon)."""

    def __init__(self, total: int, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._task = None
        self.total = total

    def __enter__(self) -> RoundProgress:
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]engine[/] round"), MofNCompleteColumn(), BarColumn(),
                TextColumn("{task.fields[stats]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                console=self.console, transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("rounds", total=self.total, stats="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def note(self, message: str) -> None:
        """A line above the bar (which execution path was taken, where results go)."""
        if self.enabled:
            (self._progress.console if self._progress else self.console).print(message)

    def update(self, row: dict[str, Any]) -> None:
        if self._progress is None:
            return
        stats = (f"loss {_fmt(row.get('train-loss'), '.4f')}  acc {_fmt(row.get('test-accuracy'), '.4f')}  "
                 f"lr {_fmt(row.get('lr'), '.3g')}  clipped {_fmt(row.get('clip-fraction'), '.2f')}  "
                 f"epoch {_fmt(row.get('global-epoch'), '.2f')}")
        if "dp-epsilon" in row:
            stats += f"  eps {_fmt(row.get('dp-epsilon'), '.3g')}" + ("" if row.get("dp-private") else " (NOT private)")
        self._progress.update(self._task, completed=row.get("round", 0), stats=stats)
