"""Run a list of experiment files and collect their results into one table.

    python -m simulations.runner simulations/experiments/cifar10/*.toml [--backend flower]
    python -m simulations.runner simulations/experiments/digits/*.toml --backend inprocess
    python -m simulations.runner --summarize results/

An experiment file is a flat TOML file of run-config keys (the same keys as
``[tool.flwr.app.config]``), so it also works as ``flwr run . --run-config FILE.toml``
(flwr 1.42 reads a single ``.toml`` argument as the overrides). For each file the runner:

1. reads and validates it (``RunConfig``; ``--set key=value`` overrides win), makes
   ``data-dir`` absolute (relative paths are relative to where you run the runner) and sets
   ``results-dir`` (``--results-dir``, absolute) and ``run-name`` (the file's, else
   ``<folder>-<file stem>``), so the run's folder is known in advance;
2. runs it on a backend:

   ``flower`` (default)
       The real Flower CLI: a private local SuperLink, ``flwr run`` with the file's keys
       and ``num-supernodes = num-clients`` (plus ``--federation-config``, e.g.
       ``"client-resources-num-gpus=0.125"``), the run's status checked
       (``simulations.flower.run_app``); the run's log is kept as ``flower.log``.
   ``inprocess``
       The same ServerApp and ClientApp objects on an in-process grid
       (``simulations.loopback``): clients one after another, no SuperLink or Ray.
   ``engine``
       The fast engine, ``python -m simulations.engine --run-config ...``.

3. reads the run's ``results.jsonl`` and adds a line to the summary (method, rounds,
   global epochs, final/best test accuracy or validation perplexity, bytes, wall-clock).

A failed run is reported and the next one runs (``--fail-fast`` stops); the table is
printed and written to ``<results-dir>/summary.json``; the exit status is 1 if a run failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomllib

from tasks.config import RunConfig
from tasks.overrides import parse_overrides

from .summary import find_runs, load_run, print_table, summarize

APP_DIR = Path(__file__).resolve().parents[1]  # the Flower app: the folder of pyproject.toml
BACKENDS = ("flower", "inprocess", "engine")


def load_experiment(path: str | Path, overrides: dict[str, Any] | None = None,
                    results_dir: str | Path | None = None) -> dict[str, Any]:
    """The run-config keys of an experiment file, validated, with absolute paths."""
    path = Path(path)
    data = tomllib.loads(path.read_text())
    nested = [k for k, v in data.items() if isinstance(v, dict)]
    if nested:
        raise ValueError(f"{path}: an experiment file is flat run-config keys, found tables {nested}")
    values = {**data, **(overrides or {})}
    try:
        cfg = RunConfig.from_mapping(values)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    values["data-dir"] = str(Path(cfg.data_dir).expanduser().resolve())
    values["results-dir"] = str(Path(results_dir or cfg.results_dir).expanduser().resolve())
    values["run-name"] = cfg.run_name or f"{path.parent.name}-{path.stem}"
    return values


def run_experiment(values: dict[str, Any], backend: str = "flower", federation: dict[str, Any] | None = None,
                   timeout: float = math.inf) -> Path:
    """Run one experiment on ``backend``; returns its results folder (raises on failure)."""
    folder = Path(values["results-dir"]) / values["run-name"]
    if backend == "inprocess":
        from .loopback import run_in_process

        run_in_process(values)
    elif backend == "flower":
        from .flower import run_app

        fed = {"num-supernodes": RunConfig.from_mapping(values).with_clients(None).num_clients, **(federation or {})}
        run = run_app(APP_DIR, run_config=values, federation_config=fed, timeout=timeout)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "flower.log").write_text(run.get("logs", ""))
    elif backend == "engine":
        if importlib.util.find_spec("simulations.engine.__main__") is None:
            raise RuntimeError("the engine backend (python -m simulations.engine) is not available in this checkout")
        from .flower import format_overrides

        cmd = [sys.executable, "-m", "simulations.engine", "--run-config", " ".join(format_overrides(values))]
        subprocess.run(cmd, cwd=APP_DIR, check=True, timeout=None if math.isinf(timeout) else timeout)
    else:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not (folder / "results.jsonl").is_file():
        raise RuntimeError(f"the run finished but wrote no results in {folder}")
    return folder


def run_all(files: Sequence[str | Path], backend: str = "flower", overrides: dict[str, Any] | None = None,
            results_dir: str | Path | None = None, federation: dict[str, Any] | None = None,
            timeout: float = math.inf, fail_fast: bool = False) -> list[dict[str, Any]]:
    """Run every file in turn; the summary lines (with ``status``, ``elapsed``, ``error``)."""
    experiments = [(Path(f), load_experiment(f, overrides, results_dir)) for f in files]  # all valid first
    lines = []
    for path, values in experiments:
        t0 = time.monotonic()
        try:
            folder = run_experiment(values, backend, federation, timeout)
            line = {"status": "ok", **summarize(load_run(folder))}
        except Exception as exc:  # report and go on with the next experiment
            line = {"status": "failed", "run": values["run-name"], "error": f"{type(exc).__name__}: {exc}"[:2000]}
            if fail_fast:
                lines.append({**line, "file": str(path), "elapsed": time.monotonic() - t0})
                break
        lines.append({**line, "file": str(path), "elapsed": time.monotonic() - t0})
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.runner", description=__doc__.split("\n\n")[0])
    parser.add_argument("experiments", nargs="*", help="experiment files (flat TOML run-config keys)")
    parser.add_argument("--backend", choices=BACKENDS, default="flower")
    parser.add_argument("--results-dir", help="where run folders go (default: each file's results-dir, 'results')")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override keys of every file, e.g. --set num-rounds=3 --set device=cpu")
    parser.add_argument("--federation-config", action="append", default=[],
                        help="Flower simulation settings, e.g. 'client-resources-num-gpus=0.125'")
    parser.add_argument("--timeout", type=float, default=0.0, help="seconds per run (0: no limit)")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failed run")
    parser.add_argument("--summarize", nargs="+", metavar="RESULTS", help="only print the table of existing results")
    ns = parser.parse_args(argv)
    if ns.summarize:
        print_table([summarize(r) for r in find_runs(ns.summarize)], title="Results")
        return 0
    if not ns.experiments:
        parser.error("give experiment files (or --summarize RESULTS)")
    try:
        lines = run_all(ns.experiments, ns.backend, parse_overrides(ns.set), ns.results_dir,
                        parse_overrides(ns.federation_config), ns.timeout or math.inf, ns.fail_fast)
    except (ValueError, FileNotFoundError, tomllib.TOMLDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_table(lines, title=f"Experiments ({ns.backend})")
    out = Path(load_experiment(ns.experiments[0], parse_overrides(ns.set), ns.results_dir)["results-dir"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(lines, indent=1, default=str) + "\n")
    return 1 if any(line["status"] != "ok" for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
