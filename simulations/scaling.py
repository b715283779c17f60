"""Rounds and local steps to a target against a swept key (I or N), from sweep results, with intervals.

    python -m simulations.scaling runs/isweep --against local-steps --target 0.95 --out docs/figures/isweep
    python -m simulations.scaling runs/nsweep --against num-clients --target 0.98 --out docs/figures/nsweep

Reads the sweeps under the given folders (or manifests) as ``simulations.compare`` does (each sweep's point
selected on validation, its runs over every seed) and writes, per setting (task and split):

* ``<setting>-to-target.png``: communication rounds and local steps per client to ``--target`` (the test
  metric) against the swept key, mean and 95 % Student-t interval over the seeds that reached it, one line
  per algorithm; with the ideal of the paper's claim dashed: against I, naive parallel clipping's rounds / I
  (the same accuracy with I times fewer rounds); against N, the N = 1 run's local steps / N (linear speedup).
  A single-machine sweep (algorithm ``single``) is the N = 1 point of every algorithm: naive parallel clipping
  and CELGC on one client are both clipped SGD on one machine.
* ``<setting>-curves.png``: the test metric and the clients' training loss, mean over seeds with the 95 %
  band, against local steps per client and against communication rounds (bytes are rounds times the
  model's size for the methods compared here: ``simulations.compare`` draws them against MB).
* ``to-target.md`` / ``to-target.json``: the table behind the figures (the numbers the docs quote), with the
  share of the local steps that clipped (the rows' ``clip-fraction``, mean over rounds and seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .compare import Compared, _order, clip_share, distinguish, final_values, load_compared
from .stats import Summary, band, summary
from .summary import rounds_to_target
from .sweep import find_manifests, format_value

AGAINST = {"local-steps": "I (local steps per round)", "num-clients": "N (clients)"}
SHORT = {"local-steps": "I", "num-clients": "N"}


def algorithm(c: Compared) -> str:
    return str(c.runs[0].config.get("algorithm", "celgc"))


def x_value(c: Compared, against: str) -> int:
    return int(c.runs[0].config.get(against) or 1)


def to_target(c: Compared, target: float) -> dict[str, Any]:
    """Rounds and local steps per client to ``target`` over the seeds of ``c`` (those that reached it)."""
    key, better = c.metric
    steps = int(c.runs[0].config.get("local-steps", 1))
    hits = [rounds_to_target(run, target, key, better) for run in c.runs]
    rounds = [h["round"] for h in hits if h is not None]
    finals = summary([v for v in final_values(c) if v is not None])
    return {"method": c.method, "algorithm": algorithm(c), "seeds": len(c.runs), "reached": len(rounds),
            "rounds": summary(rounds), "steps": summary([r * steps for r in rounds]), "final": finals,
            "clip-fraction": clip_share(c.runs),
            "local-steps": steps, "num-clients": int(c.runs[0].config.get("num-clients") or 1),
            "lr": c.runs[0].config.get("lr"), "clip": c.runs[0].config.get("clip")}


def _cell(s: Summary, reached: int, n: int) -> str:
    if s.mean is None:
        return f"not reached (0/{n})"
    text = f"{s.mean:.1f}" + ("" if s.low is None else f" [{s.low:.1f}, {s.high:.1f}]")
    return text + ("" if reached == n else f" ({reached}/{n} reached)")


def table(rows: Sequence[dict[str, Any]], target: float, key: str) -> str:
    pct = 100.0 if key.endswith("accuracy") else 1.0
    lines = ["| setting | method | I | N | η, γ | seeds | final test: mean [95 % interval] | target | rounds to target "
             "| local steps to target | steps clipped |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["final"]
        clipped = "-" if r["clip-fraction"] is None else f"{r['clip-fraction'] * 100:.0f} %"
        final = "-" if f.mean is None else f"{f.mean * pct:.2f}" + (
            "" if f.low is None else f" [{f.low * pct:.2f}, {f.high * pct:.2f}]")
        lines.append(f"| {r['setting']} | {r['method']} | {r['local-steps']} | {r['num-clients']} | "
                     f"{format_value(r['lr'])}, {format_value(r['clip'])} | {r['seeds']} | "
                     f"{final} | {target * pct:.4g} | {_cell(r['rounds'], r['reached'], r['seeds'])} | "
                     f"{_cell(r['steps'], r['reached'], r['seeds'])} | {clipped} |")
    return "\n".join(lines) + "\n"


def series(c: Compared, key: str) -> tuple[list[int], list[list[float]]]:
    """(rounds, values per seed) of row key ``key`` at the rounds every finished seed holds."""
    per_seed = []
    for run, final in zip(c.runs, final_values(c), strict=True):
        if final is None:  # diverged
            continue
        per_seed.append({int(row["round"]): value for row, value in run.series(key)})
    if not per_seed:
        return [], []
    rounds = sorted(set.intersection(*(set(p) for p in per_seed)))
    return rounds, [[p[r] for r in rounds] for p in per_seed]


def figures(group: list[Compared], rows: list[dict[str, Any]], setting: str, against: str, target: float,
            out: Path) -> list[Path]:
    from .plots import _pyplot, _slug

    plt = _pyplot()
    from matplotlib import ticker

    key = group[0].metric[0]
    written = []
    # --- to target against the swept key
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    families: dict[str, list[dict[str, Any]]] = defaultdict(list)
    single = [r for r in rows if r["algorithm"] == "single"]
    for r in rows:
        if r["algorithm"] != "single":
            families[r["algorithm"]].append(r)
    if against == "num-clients":
        for fam in families.values():
            fam.extend(single)
    elif single:
        families["single"] = single
    naive = families.get("naive") if against == "local-steps" else None
    for name, fam in families.items():
        fam = sorted((r for r in fam if r["steps"].mean is not None), key=lambda r: r[against])
        if not fam:
            continue
        label = {"celgc": "CELGC", "naive": "naive parallel clipping", "single": "single machine"}.get(name, name)
        for ax, what in zip(axes, ("rounds", "steps"), strict=True):
            # one machine communicates nothing: its "rounds" only group steps, not drawn against N
            pts = [r for r in fam if what == "steps" or r["algorithm"] != "single" or len(families) == 1]
            xs = [r[against] for r in pts]
            ys = [r[what].mean for r in pts]
            err = [[y - (r[what].low if r[what].low is not None else y) for y, r in zip(ys, pts, strict=True)],
                   [(r[what].high if r[what].high is not None else y) - y for y, r in zip(ys, pts, strict=True)]]
            if naive is not None and name == "naive":  # not a function of I: its level across the axis
                ax.axhline(ys[0], color="k", lw=1, label=f"{label} (1 step a round)")
                ax.axhspan(ys[0] - err[0][0], ys[0] + err[1][0], color="k", alpha=0.1)
                continue
            ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3,
                        label=label + "".join(f" ({r['reached']}/{r['seeds']} reached at {SHORT[against]} = {r[against]})"
                                              for r in fam if r["reached"] < r["seeds"]))
    every = sorted({r[against] for r in rows})
    if naive and naive[0]["rounds"].mean is not None:
        axes[0].plot(every, [naive[0]["rounds"].mean / x for x in every], "k--", lw=1,
                     label="naive's rounds / I (the paper's claim)")
    if against == "num-clients":
        base = [r for r in (single or rows) if r["num-clients"] == 1 and r["steps"].mean is not None]
        if base:
            axes[1].plot(every, [base[0]["steps"].mean / x for x in every], "k--", lw=1,
                         label="N = 1 steps / N (linear speedup)")
    for ax, ylabel in zip(axes, ("communication rounds to target", "local steps per client to target"),
                          strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xticks(every, [str(x) for x in every])
        ax.set_xlabel(AGAINST.get(against, against))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    n = sorted({r["seeds"] for r in rows})
    fig.suptitle(f"{setting}: to {key} {target:g}, mean and 95 % interval over the seeds that reached it "
                 f"({'/'.join(map(str, n))} seeds)", fontsize=9)
    fig.tight_layout()
    path = out / f"{_slug(setting)}-to-target.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    # --- curves: the test metric and the training loss against local steps and rounds
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    cmap = plt.get_cmap("viridis")
    swept = [c for c in group if algorithm(c) != "naive"] if against == "local-steps" else group
    for c in group:
        steps = int(c.runs[0].config.get("local-steps", 1))
        color = "k" if c not in swept else cmap(swept.index(c) / max(1, len(swept) - 1) * 0.9)
        for i, what in enumerate((key, "train-loss")):
            rounds, ys = series(c, what)
            if not ys:
                continue
            mean, low, high = band(ys)
            for j, xs in enumerate(([r * steps for r in rounds], rounds)):
                axes[i][j].plot(xs, mean, color=color, label=c.method if i == j == 0 else None, lw=1)
                axes[i][j].fill_between(xs, low, high, color=color, alpha=0.15, linewidth=0)
    for i, what in enumerate((key, "train-loss")):
        for j, xlabel in enumerate(("local steps per client (rounds × I)", "communication rounds")):
            ax = axes[i][j]
            ax.set_xlabel(xlabel)
            ax.set_ylabel(what + (" (clients' running mean in the round)" if what == "train-loss" else ""))
            ax.grid(alpha=0.3)
            if j == 1:
                ax.set_xscale("log")
            if what == "train-loss":
                ax.set_yscale("log")
            elif math.isfinite(target):
                ax.axhline(target, color="grey", ls=":", lw=1)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{setting}: mean over {'/'.join(map(str, n))} seeds with 95 % band", fontsize=9)
    fig.tight_layout()
    path = out / f"{_slug(setting)}-curves.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written


def scaling(paths: Sequence[str | Path], out: str | Path, against: str, target: float,
            plots: bool = True) -> tuple[str, list[dict[str, Any]]]:
    """The to-target table (and figures) of every sweep under ``paths`` against ``against``."""
    if against not in AGAINST:
        raise ValueError(f"--against must be one of {', '.join(AGAINST)}, got {against!r}")
    manifests = find_manifests(paths)
    if not manifests:
        raise FileNotFoundError(f"no sweep manifest (*.sweep.json) under {', '.join(map(str, paths))}")
    compared = sorted(distinguish([load_compared(m) for m in manifests]), key=lambda c: (c.setting, _order(c.method)))
    settings: dict[str, list[Compared]] = defaultdict(list)
    for c in compared:
        settings[c.setting].append(c)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for setting, group in settings.items():
        mine = [{"setting": setting, **to_target(c, target)} for c in group]
        rows += mine
        if plots:
            figures(group, mine, setting, against, target, out)
    text = table(rows, target, compared[0].metric[0])
    (out / "to-target.md").write_text(text)
    data = [{k: (v.__dict__ if isinstance(v, Summary) else v) for k, v in r.items()} for r in rows]
    (out / "to-target.json").write_text(json.dumps({"against": against, "target": target, "rows": data}, indent=1) + "\n")
    return text, data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results folders holding sweeps (their *.sweep.json), or manifests")
    parser.add_argument("--out", required=True, help="folder for to-target.md/.json and the figures")
    parser.add_argument("--against", required=True, choices=sorted(AGAINST), help="the swept run-config key")
    parser.add_argument("--target", type=float, required=True, help="the level of the test metric to reach")
    parser.add_argument("--no-plots", action="store_true")
    ns = parser.parse_args(argv)
    try:
        text, _ = scaling(ns.results, ns.out, ns.against, ns.target, plots=not ns.no_plots)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
