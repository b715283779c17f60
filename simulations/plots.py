"""Figures of the paper from results folders, as PNG files.

    python -m simulations.plots results/ [more results...] --out figures/ [--target 0.9]

Runs are grouped by task and data split (one set of figures per group, e.g.
``cifar10-homogeneous``), one curve per method and I, labelled from each run's header
config. For every group:

``<group>-train-loss.png``
    Training loss against global epochs and against wall-clock seconds (two panels); the
    cross-entropy alone (``train-ce``, without the AR/TAR terms) when every run reports it.
``<group>-<metric>.png``
    Test accuracy (images) or validation perplexity (text) against global epochs and
    against wall-clock seconds.
``<group>-<metric>-communication.png``
    The same metric against communication rounds and against the bytes communicated so
    far (sent + received: both directions, every exchange of a round).
``<group>-clipping.png``
    Fraction of steps that were clipped, per global epoch.
``<group>-rounds-to-target.png``
    Communication rounds each method needed to reach the target (``--target``; default:
    the best value that every run reached), annotated with the bytes sent.

Training loss and clipping are averaged over bins of one global epoch (finer when a run
is shorter than 20 epochs), weighted by the steps behind each round. matplotlib (the
``plots`` extra) is imported on first use, with the Agg backend.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .summary import Run, common_target, find_runs, human_bytes, rounds_to_target

METRIC_TITLES = {"test-accuracy": "test accuracy", "valid-perplexity": "validation perplexity"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install matplotlib (or the 'plots' extra: "
                         "pip install -e '.[plots]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _sort_key(run: Run) -> tuple:
    label = run.label
    steps = int(run.config.get("local-steps", 0) or 0)
    return (0 if label.startswith("naive") else 1 if label.startswith("CELGC") else 2, steps, run.name)


def binned(run: Run, key: str) -> tuple[list[float], list[float], list[float]]:
    """(epoch centre, step-weighted mean of ``key``, mean wall-clock) per global-epoch bin."""
    pts = [(float(r["global-epoch"]), v, float(r.get("num-steps", 1) or 1), float(r.get("wall-clock", 0) or 0))
           for r, v in run.series(key) if r.get("round", 0) and "global-epoch" in r]
    if not pts:
        return [], [], []
    span = max(p[0] for p in pts)
    width = 1.0 if span >= 20 else max(span / 20, 1e-9)
    bins: dict[int, list[tuple[float, float, float, float]]] = defaultdict(list)
    for p in pts:
        bins[int((p[0] - 1e-12) // width)].append(p)
    xs, ys, ts = [], [], []
    for b in sorted(bins):
        group = bins[b]
        weight = sum(p[2] for p in group)
        xs.append((b + 0.5) * width)
        ys.append(sum(p[1] * p[2] for p in group) / weight)
        ts.append(sum(p[3] for p in group) / len(group))
    return xs, ys, ts


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")


def plot_group(group: str, runs: Sequence[Run], out: Path, target: float | None = None) -> list[Path]:
    """The figures of one group of runs; returns the files written."""
    plt = _pyplot()
    runs = sorted(runs, key=_sort_key)
    key, better = runs[0].metric
    metric_title = METRIC_TITLES.get(key, key)
    written = []

    def two_panels(name: str, ylabel: str, curves: list[tuple[str, list, list, list]], log_y: bool = False) -> None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for label, xs, ys, ts in curves:
            axes[0].plot(xs, ys, label=label)
            axes[1].plot(ts, ys, label=label)
        for ax, xlabel in zip(axes, ("global epochs", "wall-clock (s, evaluation excluded)"), strict=True):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if log_y:
                ax.set_yscale("log")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{group}: {ylabel}")
        fig.tight_layout()
        path = out / f"{_slug(group)}-{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    # the language models' cross-entropy without AR/TAR when reported (what the authors plot)
    loss_key = "train-ce" if all(r.series("train-ce") for r in runs) else "train-loss"
    loss = [(r.label, *binned(r, loss_key)) for r in runs]
    two_panels("train-loss", "training cross-entropy" if loss_key == "train-ce" else "training loss", loss, log_y=True)

    metric = []
    for r in runs:
        series = [(row, v) for row, v in r.series(key) if "global-epoch" in row]
        metric.append((r.label, [float(row["global-epoch"]) for row, _ in series], [v for _, v in series],
                       [float(row.get("wall-clock", 0) or 0) for row, _ in series]))
    two_panels(key, metric_title, metric, log_y=key.endswith("perplexity"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in runs:
        rounds, values, traffic, total = [], [], [], 0
        for row in r.rows:
            total += int(row.get("bytes-sent", 0) or 0) + int(row.get("bytes-received", 0) or 0)
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rounds.append(int(row.get("communication-rounds", row.get("round", 0))))
                values.append(float(value))
                traffic.append(total / 1e6)
        axes[0].plot(rounds, values, label=r.label)
        axes[1].plot(traffic, values, label=r.label)
    for ax, xlabel in zip(axes, ("communication rounds", "MB communicated (sent + received)"), strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(metric_title)
        ax.grid(alpha=0.3)
        if key.endswith("perplexity"):
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{group}: {metric_title} per round and per byte")
    fig.tight_layout()
    path = out / f"{_slug(group)}-{key}-communication.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in runs:
        xs, ys, _ = binned(r, "clip-fraction")
        ax.plot(xs, ys, label=r.label)
    ax.set_xlabel("global epochs")
    ax.set_ylabel("fraction of steps clipped")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{group}: clipping frequency")
    fig.tight_layout()
    path = out / f"{_slug(group)}-clipping.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    goal = target if target is not None else common_target(runs)
    if goal is not None:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        labels, counts, notes = [], [], []
        for r in runs:
            hit = rounds_to_target(r, goal, key, better)
            labels.append(r.label)
            counts.append(hit["round"] if hit else 0)
            notes.append(human_bytes(hit["bytes"]) if hit else "not reached")
        bars = ax.bar(range(len(runs)), counts, color="tab:blue")
        for bar, note in zip(bars, notes, strict=True):
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(range(len(runs)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("communication rounds")
        ax.set_title(f"{group}: rounds to {metric_title} {'>=' if better == 'max' else '<='} {goal:.4g}")
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        path = out / f"{_slug(group)}-rounds-to-target.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def plot_results(paths: Sequence[str | Path], out: str | Path, target: float | None = None) -> list[Path]:
    """All figures for the runs found under ``paths``, grouped by task and split."""
    runs = [r for r in find_runs(paths) if r.rows]
    if not runs:
        raise FileNotFoundError(f"no results.jsonl with rows under {', '.join(map(str, paths))}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        groups[r.group].append(r)
    written = []
    for group, members in sorted(groups.items()):
        written += plot_group(group, members, out, target)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.plots", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="run folders or folders holding runs")
    parser.add_argument("--out", default="figures", help="output folder for the PNG files")
    parser.add_argument("--target", type=float, help="target test accuracy / validation perplexity")
    ns = parser.parse_args(argv)
    try:
        for path in plot_results(ns.results, ns.out, ns.target):
            print(path)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
