"""Reading results folders: one run's curves, its label, rounds to a target, a summary table.

A run folder holds ``results.jsonl`` (written by the ServerApp or the engine, ``tasks.runs.results``): a
header line with the whole config and the versions, then one row per round (round 0 is the
initial model). Used by the runner, the plots and the demo; pure Python (rich only to print).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strategies.methods import METHODS
from tasks.config import task_label
from tasks.runs.results import read_results

RESULTS_FILE = "results.jsonl"


@dataclass
class Run:
    """One run: its folder, header (config, versions, train-size) and round rows."""

    folder: Path
    header: dict[str, Any]
    rows: list[dict[str, Any]]

    @property
    def config(self) -> dict[str, Any]:
        return self.header.get("config", {})

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def label(self) -> str:
        return method_label(self.config)

    @property
    def group(self) -> str:
        """Runs that belong on one figure: same task and data split."""
        return f"{task_label(str(self.config.get('task', '?')))}-{split_label(self.config)}"

    @property
    def metric(self) -> tuple[str, str]:
        return primary_metric(self.config)

    def series(self, key: str) -> list[tuple[dict[str, Any], float]]:
        """(row, value) for the rows that hold a finite ``key``."""
        out = []
        for row in self.rows:
            value = _number(row.get(key))
            if value is not None:
                out.append((row, value))
        return out


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def load_run(folder: str | Path) -> Run:
    """The run in ``folder`` (or the folder of a results.jsonl path)."""
    path = Path(folder)
    if path.is_dir():
        path = path / RESULTS_FILE
    header, rows = read_results(path)
    return Run(path.parent, header, rows)


def find_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Every run under ``paths`` (run folders, results files, or folders holding runs)."""
    runs, seen = [], set()
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise FileNotFoundError(f"no such results folder or file: {p}")
        files = [p] if p.is_file() else sorted(p.rglob(RESULTS_FILE))
        for f in files:
            key = f.resolve()
            if key not in seen:
                seen.add(key)
                runs.append(load_run(f))
    return runs


def method_label(config: dict[str, Any]) -> str:
    """'CELGC I=8', 'EPISODE I=8', 'SCAFFOLD I=8', 'naive parallel clipping', 'local SGD I=8 (no clipping)',
    'single machine'."""
    alg = config.get("algorithm", "celgc")
    steps = config.get("local-steps", "?")
    if alg == "celgc" and int(config.get("num-clients", 0) or 0) == 1:  # results written before 'single'
        return "single machine" + (" (no clipping)" if config.get("clip") == "off" else "")
    if alg == "celgc" and config.get("clip") == "off":
        alg = "local-sgd"
    return METHODS[alg].label(steps) if alg in METHODS else f"{alg} I={steps}"


def split_label(config: dict[str, Any]) -> str:
    if config.get("task") == "shakespeare":  # the data's own split: one client per role
        per_round = int(config.get("clients-per-round", 0) or 0)
        return f"roles-K{per_round}" if per_round else "roles"
    part = config.get("partitioner", "homogeneous")
    if part == "similarity":
        return f"similarity{float(config.get('similarity', 0)):g}"
    if part == "dirichlet":
        return f"dirichlet{float(config.get('dirichlet-alpha', 0)):g}"
    return part


def primary_metric(config: dict[str, Any]) -> tuple[str, str]:
    """(row key, 'max' or 'min'): test accuracy for images, validation perplexity for text."""
    if config.get("task") in ("ptb", "wikitext2"):
        return "valid-perplexity", "min"
    return "test-accuracy", "max"


def reached(value: float, target: float, better: str) -> bool:
    return value >= target if better == "max" else value <= target


def rounds_to_target(run: Run, target: float, key: str | None = None, better: str | None = None) -> dict[str, Any] | None:
    """The first evaluated round at which ``key`` reaches ``target``: its round (communications), its
    row's ``round`` (``row``), global epoch, wall-clock and bytes communicated so far; None if never reached."""
    default_key, default_better = run.metric
    key, better = key or default_key, better or default_better
    sent = 0
    for row in run.rows:
        sent += int(row.get("bytes-sent", 0) or 0) + int(row.get("bytes-received", 0) or 0)
        value = _number(row.get(key))
        if value is not None and reached(value, target, better):
            return {"round": int(row.get("communication-rounds", row.get("round", 0))), "row": int(row["round"]),
                    "global-epoch": row.get("global-epoch"), "wall-clock": row.get("wall-clock"), "bytes": sent}
    return None


def common_target(runs: Sequence[Run]) -> float | None:
    """The level every run reaches: the worst of the runs' best values of their metric."""
    bests = []
    for run in runs:
        key, better = run.metric
        values = [v for _, v in run.series(key)]
        if values:
            bests.append(max(values) if better == "max" else min(values))
    if not bests:
        return None
    return min(bests) if runs[0].metric[1] == "max" else max(bests)


def summarize(run: Run) -> dict[str, Any]:
    """One line of the summary table."""
    key, better = run.metric
    values = [v for _, v in run.series(key)]
    last = run.rows[-1] if run.rows else {}
    total_bytes = sum(int(r.get("bytes-sent", 0) or 0) + int(r.get("bytes-received", 0) or 0) for r in run.rows)
    return {
        "run": run.name, "method": run.label, "task": run.config.get("task"), "split": split_label(run.config),
        "clients": run.config.get("num-clients"), "rounds": int(last.get("communication-rounds", 0) or 0),
        "global-epoch": last.get("global-epoch"), "metric": key,
        "final": values[-1] if values else None,
        "best": (max(values) if better == "max" else min(values)) if values else None,
        "train-loss": last.get("train-loss"), "bytes": total_bytes, "wall-clock": last.get("wall-clock"),
        "epsilon": _epsilon(last),
    }


def _epsilon(row: dict[str, Any]) -> str | None:
    """A DP run's epsilon at delta after its last round (None: no DP)."""
    if "dp-epsilon" not in row:
        return None
    eps = _number(row.get("dp-epsilon"))
    text = f"{eps:.3g} (d={_number(row.get('dp-delta')) or 0:.2g})" if eps is not None else str(row.get("dp-epsilon"))
    return text if row.get("dp-private") else f"{text} NOT private"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def print_table(lines: Sequence[dict[str, Any]], title: str = "Runs", console: Any = None) -> None:
    """The summary lines as a rich table (status and error columns when present)."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=200)
    table = Table(title=title)
    columns = ["run", "method", "clients", "rounds", "global-epoch", "metric", "final", "best", "train-loss",
               "bytes", "wall-clock"]
    if any(line.get("epsilon") for line in lines):
        columns.append("epsilon")
    if any("status" in line for line in lines):
        columns = ["status"] + columns
    for c in columns:
        left = c in ("run", "method", "metric", "status")
        table.add_column(c, justify="left" if left else "right", overflow="fold")
    for line in lines:
        cells = []
        for c in columns:
            v = line.get(c)
            cells.append(human_bytes(v) if c == "bytes" and isinstance(v, (int, float)) else _fmt(v))
        table.add_row(*cells)
    console.print(table)
    for line in lines:
        if line.get("error"):
            console.print(f"[red]{line.get('run')}[/red]: {line['error']}", markup=True, highlight=False)
