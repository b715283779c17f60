"""Offline demonstration on a CPU: CELGC at I = 8 and naive parallel clipping, one seed at one
shared (lr, clip) -- the pipeline end to end, not a comparison (that is the tuned, five-seed
sweep of ``simulations/experiments/hetero-digits/``, docs/EXPERIMENTS.md).

    python -m simulations.demo [--target 0.97] [--out figures/demo] [--results-dir results/demo]

Runs the two experiment files of ``simulations/experiments/digits/`` (scikit-learn's
digits, N = 8 clients, batch 32, lr 0.3, clip 0.3, the same 160 local steps each: naive
parallel clipping 160 rounds of one step, CELGC 20 rounds of 8 steps) through this
project's ServerApp and ClientApp on an in-process grid (``simulations.loopback``: the
clients run one after another in this process, no SuperLink), then prints for each method
the rounds, bytes and wall-clock it took to first reach the target test accuracy, the
ratios, and writes the figures (``simulations.plots``). A couple of minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .runner import load_experiment
from .summary import human_bytes, load_run, rounds_to_target

EXPERIMENTS = Path(__file__).resolve().parent / "experiments" / "digits"
FILES = {"naive": EXPERIMENTS / "naive.toml", "celgc": EXPERIMENTS / "celgc-I8.toml"}


def run_demo(results_dir: str | Path, out: str | Path | None, target: float, rounds_scale: float = 1.0,
             quiet: bool = True, threads: int = 1) -> dict:
    """Run both methods, return {method: {"run", "elapsed", "hit", "final"}} and the figure paths.

    ``threads``: torch intra-op threads while the runs last (1: a small model on a busy CPU
    runs best on one; two threads sharing cores with other jobs stall on every op).
    """
    import torch

    before = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        return _run_demo(results_dir, out, target, rounds_scale, quiet)
    finally:
        torch.set_num_threads(before)


def _run_demo(results_dir: str | Path, out: str | Path | None, target: float, rounds_scale: float,
              quiet: bool) -> dict:
    from .loopback import run_in_process

    if quiet:
        logging.getLogger("flwr").setLevel(logging.ERROR)
    report: dict = {}
    for method, path in FILES.items():
        values = load_experiment(path, results_dir=results_dir)
        values["num-rounds"] = max(1, round(values["num-rounds"] * rounds_scale))
        t0 = time.monotonic()
        run_in_process(values)
        elapsed = time.monotonic() - t0
        run = load_run(Path(values["results-dir"]) / values["run-name"])
        final = [v for _, v in run.series("test-accuracy")][-1]
        report[method] = {"run": run, "elapsed": elapsed, "final": final, "hit": rounds_to_target(run, target)}
        naive_final = report.get("naive", {}).get("final")
        report[method]["hit-naive-final"] = rounds_to_target(run, naive_final) if naive_final else None
    figures = []
    if out is not None:
        from .plots import plot_results

        figures = plot_results([report[m]["run"].folder for m in FILES], out, target)
    report["figures"] = figures
    return report


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.1f}x" if a and b else "-"


def print_report(report: dict, target: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    naive_final = report["naive"]["final"]
    table = Table(title=f"digits, N = 8: first round with test accuracy >= {target:g} "
                        f"(and >= naive's final {naive_final:.4f})")
    for col in ("method", "rounds run", "run wall-clock (s)", "final acc.", "rounds to target", "bytes to target",
                "train wall-clock to target (s)", "rounds to naive's final"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for method in FILES:
        r = report[method]
        hit, hit2 = r["hit"], r["hit-naive-final"]
        table.add_row(r["run"].label, str(r["run"].rows[-1]["round"]), f"{r['elapsed']:.1f}", f"{r['final']:.4f}",
                      str(hit["round"]) if hit else "not reached", human_bytes(hit["bytes"]) if hit else "-",
                      f"{hit['wall-clock']:.1f}" if hit else "-", str(hit2["round"]) if hit2 else "not reached")
    console.print(table)
    n, c = report["naive"]["hit"], report["celgc"]["hit"]
    if n and c:
        console.print(f"CELGC I=8 needs {_ratio(n['round'], c['round'])} fewer communication rounds "
                      f"({n['round']} -> {c['round']}) and {_ratio(n['bytes'], c['bytes'])} fewer bytes "
                      f"to reach {target:g}; training wall-clock to target {_ratio(n['wall-clock'], c['wall-clock'])} "
                      "less (clients in one process, so this counts computation, not network).")
    n2, c2 = report["naive"]["hit-naive-final"], report["celgc"]["hit-naive-final"]
    if n2 and c2:
        console.print(f"To naive's final accuracy {naive_final:.4f}: {n2['round']} -> {c2['round']} rounds "
                      f"({_ratio(n2['round'], c2['round'])}).")
    for path in report["figures"]:
        console.print(f"figure: {path}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=float, default=0.97, help="test accuracy to reach (default 0.97)")
    parser.add_argument("--results-dir", default="results/demo")
    parser.add_argument("--out", default="figures/demo", help="folder for the PNG figures")
    parser.add_argument("--rounds-scale", type=float, default=1.0, help="scale both runs' rounds (quick checks)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: a small model on a busy CPU runs best on one)")
    parser.add_argument("--verbose", action="store_true", help="show Flower's per-round log")
    ns = parser.parse_args(argv)
    report = run_demo(ns.results_dir, ns.out, ns.target, ns.rounds_scale, quiet=not ns.verbose, threads=ns.threads)
    print_report(report, ns.target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
