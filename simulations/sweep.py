"""Sweeps: a grid over run-config keys and a number of seeds, from one experiment file.

An experiment file may carry a ``[sweep]`` table beside its flat run-config keys::

    algorithm = "celgc"
    valid-fraction = 0.1
    run-name = "a0.1-celgc"        # the base of every point's folder name

    [sweep]
    lr = [0.1, 0.3, 1.0]           # any run-config keys, each a non-empty list
    clip = [0.1, 0.3, 1.0]
    seeds = 5                      # seeds 0..4 (or a list of seeds)
    tune-seeds = 2                 # optional: the grid runs on the first 2 seeds; the point best on
                                   # validation then runs on all seeds (default: every point, every seed)
    select = "valid-accuracy"      # optional: the validation metric that selects (default below)
    tune = { num-rounds = 40 }     # optional: a short tuning pass: the grid runs with these keys changed
                                   # (folders <run-name>-tune-...), then the selected point runs every seed

A point's folder is ``<run-name>-<key>=<value>-...-seed=<s>`` (e.g. ``a0.1-celgc-lr=0.3-clip=0.1-seed=2``).
The selection is a pure function of the finished runs (``select``): the grid point whose mean of the
selection metric's last value over the tuning seeds is best (ties: the first point in grid order; a run
that produced no finite value counts as the worst). The runner (``simulations.runner``) runs the
points, records them in ``<results-dir>/<run-name>.sweep.json`` (the manifest) and skips points whose
folder already holds the finished run of the same config, so an interrupted sweep resumes.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strategies.methods import own_keys
from tasks.config import RunConfig, comparable, safe_component, shared_keys
from tasks.overrides import flatten
from tasks.runs.results import read_results
from tasks.runs.safe_files import write_atomic

#: keys of ``[sweep]`` that are not run-config keys
SWEEP_KEYS = ("seeds", "tune-seeds", "select", "tune")
#: run-config keys a sweep may not vary: they name or place the run, or are the sweep's own seeds
FIXED_KEYS = ("seed", "run-name", "results-dir", "resume")
#: selection metrics, best first: (key, "max" | "min")
SELECT_METRICS = {"valid-accuracy": "max", "valid-loss": "min", "valid-perplexity": "min"}


@dataclass(frozen=True)
class Point:
    """One run of a sweep: the grid values, the seed, and the stage (1: tuning, 2: the selected point)."""

    values: tuple[tuple[str, Any], ...]
    seed: int
    stage: int = 1

    tuning_pass: bool = False  # a run of the short tuning pass (``tune``), not of the file's own budget

    def name(self, base: str) -> str:
        parts = [f"{k}={format_value(v)}" for k, v in self.values] + [f"seed={self.seed}"]
        return "-".join([base, *(["tune"] if self.tuning_pass else []), *parts])


@dataclass
class Sweep:
    """A parsed ``[sweep]`` table: the base run keys, the grid, the seeds and the selection rule."""

    file: Path
    base: dict[str, Any]  # run-config keys shared by every point (validated, absolute paths)
    grid: dict[str, list[Any]]
    seeds: list[int]
    tune_seeds: int
    select: str
    tune: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.base["run-name"])

    @property
    def results_dir(self) -> Path:
        return Path(self.base["results-dir"])

    @property
    def manifest(self) -> Path:
        return self.results_dir / f"{self.name}.sweep.json"

    def grid_points(self) -> list[tuple[tuple[str, Any], ...]]:
        return grid_points(self.grid)

    @property
    def points(self) -> list[Point]:
        """The tuning stage's points (``tuning``)."""
        return self.tuning()

    def tuning(self) -> list[Point]:
        """Stage 1: every grid point on the tuning seeds (all seeds unless tune-seeds is set)."""
        return [Point(values, seed, tuning_pass=bool(self.tune))
                for values in self.grid_points() for seed in self.seeds[: self.tune_seeds]]

    def final(self, selected: tuple[tuple[str, Any], ...]) -> list[Point]:
        """Stage 2: the selected point on the seeds that did not run it at the file's budget: the
        remaining seeds, or every seed after a short tuning pass (``tune``)."""
        return [Point(selected, seed, stage=2) for seed in self.seeds[0 if self.tune else self.tune_seeds:]]

    @property
    def second_stage_runs(self) -> int:
        return len(self.seeds) - (0 if self.tune else self.tune_seeds)

    def values_for(self, point: Point) -> dict[str, Any]:
        """The point's run-config keys (validated)."""
        values = {**self.base, **(self.tune if point.tuning_pass else {}), **dict(point.values), "seed": point.seed,
                  "run-name": point.name(self.name)}
        try:
            RunConfig.from_mapping(values)
        except ValueError as exc:
            raise ValueError(f"{self.file}: sweep point {point.name(self.name)!r}: {exc}") from None
        return values


def format_value(value: Any) -> str:
    """A grid value as a folder-name part: 0.3, 1e-05, off (clip = inf), true, adam."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return "off" if math.isinf(value) else f"{value:g}"
    return str(value)


def parse_sweep(file: Path, base: dict[str, Any], table: dict[str, Any]) -> Sweep:
    """Check a ``[sweep]`` table against the run-config keys; ``base`` is the file's validated keys.
    A method's own keys are ``<name>.<key>`` here too (``fedavgm.server-lr = [0.5, 1.0]``)."""
    table = {**flatten({k: v for k, v in table.items() if k != "tune"}),
             **({"tune": flatten(table["tune"]) if isinstance(table["tune"], dict) else table["tune"]}
                if "tune" in table else {})}
    known = {*shared_keys(), *own_keys(), *RunConfig.from_mapping(base).to_mapping()}
    unknown = sorted(k for k in table if k not in known and k not in SWEEP_KEYS)
    if unknown:
        raise ValueError(f"{file}: [sweep] keys {unknown} are neither run-config keys nor {', '.join(SWEEP_KEYS)}")
    fixed = sorted(k for k in table if k in FIXED_KEYS)
    if fixed:
        raise ValueError(f"{file}: [sweep] may not vary {fixed} (seeds: use 'seeds = n'; the folder names are the sweep's)")
    grid = {k: v for k, v in table.items() if k not in SWEEP_KEYS}
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"{file}: [sweep] {key} must be a non-empty list of values, got {values!r}")
        if len({format_value(v) for v in values}) != len(values):
            raise ValueError(f"{file}: [sweep] {key} lists a value twice: {values!r}")
    seeds = table.get("seeds", 1)
    if isinstance(seeds, bool) or not (isinstance(seeds, int) and seeds >= 1 or isinstance(seeds, list) and seeds):
        raise ValueError(f"{file}: [sweep] seeds must be a number of seeds >= 1 or a non-empty list, got {seeds!r}")
    seeds = list(range(seeds)) if isinstance(seeds, int) else seeds
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"{file}: [sweep] seeds must be distinct integers >= 0, got {seeds!r}")
    tune = table.get("tune-seeds", len(seeds))
    if isinstance(tune, bool) or not isinstance(tune, int) or not 1 <= tune <= len(seeds):
        raise ValueError(f"{file}: [sweep] tune-seeds must be an integer in [1, {len(seeds)}] (the seeds), got {tune!r}")
    n_points = math.prod(len(v) for v in grid.values())
    default_select = "valid-perplexity" if base.get("task") in ("ptb", "wikitext2") else "valid-accuracy"
    select = table.get("select", default_select)
    if select not in SELECT_METRICS:
        raise ValueError(f"{file}: [sweep] select must be one of {', '.join(SELECT_METRICS)}, got {select!r}")
    tune_keys = table.get("tune", {})
    if not isinstance(tune_keys, dict) or any(k in FIXED_KEYS or k in grid or k not in known for k in tune_keys):
        raise ValueError(f"{file}: [sweep] tune must be a table of run-config keys (not {', '.join(FIXED_KEYS)} and "
                         f"not a grid key) for the short tuning pass, got {tune_keys!r}")
    cfg = RunConfig.from_mapping(base)
    if n_points > 1 and select.startswith("valid-") and cfg.valid_fraction <= 0 and cfg.task not in ("ptb", "wikitext2"):
        raise ValueError(f"{file}: a grid of {n_points} points is selected on {select}, which needs a validation set: "
                         "set valid-fraction (e.g. 0.1) in the file")
    sweep = Sweep(file, base, grid, seeds, tune, select, dict(tune_keys))
    for point in [*sweep.points, *sweep.final(sweep.grid_points()[0])]:  # every name and value valid up front
        if not safe_component(point.name(sweep.name)):
            raise ValueError(f"{file}: sweep folder name {point.name(sweep.name)!r} is not a safe folder name")
        sweep.values_for(point)
    return sweep


# --- finished runs and selection -----------------------------------------------------------
def finished(folder: Path, values: dict[str, Any]) -> bool:
    """Whether ``folder`` holds the finished run of ``values``; a run of ANOTHER config there is an error."""
    results = folder / "results.jsonl"
    if not results.is_file():
        return False
    header, rows = read_results(results)
    want = comparable(RunConfig.from_mapping(values).to_mapping())
    have = comparable(header.get("config", {}))  # a header written before keys were scoped compares too
    ignore = {"resume", "tensorboard"}  # how the run is continued or watched, not what it computes
    diff = sorted(k for k in want if k not in ignore and have.get(k) != want[k])
    if diff:
        raise ValueError(f"{folder} holds a run of another config (differs in {diff}): move it away or change "
                         "the sweep's run-name")
    return bool(rows) and int(rows[-1].get("round", -1)) == int(want["num-rounds"])


def diverged(exc: BaseException | None) -> bool:
    """Whether a run's error is its model diverging (non-finite results or model), an outcome of its point."""
    from tasks.runs.checkpoint import CheckpointError
    from tasks.runs.results import TooFewReplies

    text = str(exc)
    return (isinstance(exc, TooFewReplies) and "non-finite" in text) or (
        isinstance(exc, CheckpointError) and "is not finite" in text)


def last_value(folder: Path, key: str, finished_only: bool = True) -> float | None:
    """The last finite value of ``key`` in a run's rows; None when there is none, or (``finished_only``)
    when the run stopped before its last round (a diverged run scores the worst)."""
    try:
        header, rows = read_results(folder / "results.jsonl")
    except FileNotFoundError:
        return None
    if finished_only and (not rows or int(rows[-1].get("round", -1)) != int(header.get("config", {}).get("num-rounds", -2))):
        return None
    for row in reversed(rows):
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        if key in row:  # evaluated, but not finite: a diverged run
            return None
    return None


def grid_points(grid: dict[str, list[Any]]) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of the grid's values, in grid order (the last key varies fastest)."""
    keys = list(grid)
    return [tuple(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def select_point(grid: dict[str, list[Any]], select: str,
                 scores: dict[tuple[tuple[str, Any], ...], Sequence[float | None]]) -> tuple[tuple[str, Any], ...]:
    """The grid point with the best mean score over its tuning seeds (a missing or non-finite score is the
    worst; ties: the first point in grid order)."""
    better = SELECT_METRICS[select]
    worst = -math.inf if better == "max" else math.inf

    def mean(values: Sequence[float | None]) -> float:
        if not values or any(v is None for v in values):
            return worst
        return sum(values) / len(values)  # type: ignore[arg-type]

    points = grid_points(grid)
    means = [mean(scores.get(p, [])) for p in points]
    best = max(means) if better == "max" else min(means)
    return points[means.index(best)]


def tuning_scores(sweep: Sweep) -> dict[tuple[tuple[str, Any], ...], list[float | None]]:
    scores: dict[tuple[tuple[str, Any], ...], list[float | None]] = {}
    for point in sweep.tuning():
        scores.setdefault(point.values, []).append(last_value(sweep.results_dir / point.name(sweep.name), sweep.select))
    return scores


def write_manifest(sweep: Sweep, elapsed: dict[str, float], selected: tuple[tuple[str, Any], ...] | None,
                   status: dict[str, str] | None = None) -> Path:
    """``<results-dir>/<run-name>.sweep.json``: the grid, seeds, every point's folder and time, the selection."""
    old = read_manifest(sweep.manifest) if sweep.manifest.is_file() else {}
    runs = dict(old.get("runs", {}))
    points = sweep.tuning() + (sweep.final(selected) if selected is not None else [])
    for point in points:
        name = point.name(sweep.name)
        entry = runs.get(name, {})
        runs[name] = {"values": dict(point.values), "seed": point.seed, "stage": point.stage, "tuning-pass": point.tuning_pass,
                      "elapsed": elapsed.get(name, entry.get("elapsed")),
                      "status": (status or {}).get(name, entry.get("status"))}
    data = {"kind": "sweep", "file": str(sweep.file), "run-name": sweep.name, "grid": sweep.grid, "seeds": sweep.seeds,
            "tune-seeds": sweep.tune_seeds, "tune": sweep.tune, "select": sweep.select,
            "selected": dict(selected) if selected is not None else None, "runs": runs}
    sweep.results_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, default=str) + "\n"
    return write_atomic(sweep.manifest, lambda f: f.write(text.encode()))


def read_manifest(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("kind") != "sweep" or not isinstance(data.get("runs"), dict):
        raise ValueError(f"{path} is not a sweep manifest (written by python -m simulations.runner)")
    return data


def find_manifests(paths: Sequence[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"no such results folder or manifest: {p}")
        out += [p] if p.is_file() else sorted(p.rglob("*.sweep.json"))
    return out
