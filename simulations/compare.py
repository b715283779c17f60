"""Compare tuned methods from sweep results: selection on validation, statistics over seeds, figures with bands.

    python -m simulations.compare runs/hetero --out runs/hetero/compare [--target 0.95] [--network datacenter,mobile]

Reads every sweep manifest (``<run-name>.sweep.json``, written by ``python -m simulations.runner``) under
the given folders. Per sweep (one method in one setting) it takes the grid point selected on validation
(``simulations.sweep.select_point``, recomputed from the runs and checked against the manifest) and its
runs on every seed, and reports the test metric's last value as mean ± sample std with the 95 %
Student-t interval over the seeds, rounds and MB to the target (mean and interval over the seeds that
reached it, and how many did), a DP sweep's ε at δ after its last round (a column only when some sweep
is private), the share of local steps that clipped (``clip_share``), the training time per local step,
and the compute time of the whole
sweep (every grid point and seed, as each run's process measured it); and, under each network link
(``--network``, ``simulations.network``: named links or a TOML file), the modelled time to the target
(the measured compute plus latency and bytes over the link's downlink and uplink), mean and interval over
the seeds that reached it, beside rounds and MB; and every tuning point of every sweep with its
validation score and share of clipped steps (where on its grid a method clips, and what that cost it).
Writes ``comparison.md`` (the tables), ``comparison.json``
and per setting (task and split) ``<setting>-bands.png``: the metric's mean
over seeds with its 95 % band against local steps per client and against MB communicated, and
``by-setting.png``: the final metric with its interval per method and setting.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from strategies.methods import method as method_class

from .network import NETWORK_HELP, Link, parse_links, run_seconds
from .privacy_report import norm_summary, privacy_table
from .stats import Summary, band, summary
from .summary import Run, common_target, load_run, rounds_to_target
from .sweep import find_manifests, format_value, grid_points, last_value, read_manifest, select_point


@dataclass
class Compared:
    """One sweep's selected point and its runs over the seeds."""

    name: str
    setting: str
    method: str
    selected: dict[str, Any]
    runs: list[Run]
    select: str
    valid: Summary
    sweep_runs: int
    compute_seconds: float
    tuning: list[dict[str, Any]]

    @property
    def metric(self) -> tuple[str, str]:
        return self.runs[0].metric


def load_compared(path: Path) -> Compared:
    """The selected point of the sweep in manifest ``path`` and its runs (every seed finished)."""
    manifest = read_manifest(path)
    folder = path.parent
    select = manifest["select"]
    selected = manifest.get("selected")
    if selected is None:
        raise ValueError(f"{path}: the sweep has no selected point yet (its tuning runs did not all finish)")
    tuned_elsewhere = bool(manifest.get("tune"))
    # the selection recomputed from the runs: the manifest must agree with the results
    scores: dict[tuple, list[float | None]] = defaultdict(list)
    clipped: dict[tuple, list[Run]] = defaultdict(list)
    for name, entry in manifest["runs"].items():
        if entry.get("stage") == 1:
            scores[tuple(entry["values"].items())].append(last_value(folder / name, select))
            if (folder / name / "results.jsonl").is_file():
                clipped[tuple(entry["values"].items())].append(load_run(folder / name))
    best = dict(select_point(manifest["grid"], select, scores))
    if best != selected:
        raise ValueError(f"{path}: the manifest's selected point {selected} is not the best on {select} in the "
                         f"results ({best}): rerun the runner to update it")
    finals = [n for n, e in manifest["runs"].items() if e["values"] == selected
              and (e["stage"] == 2 or (e["stage"] == 1 and not tuned_elsewhere))]
    runs = [load_run(folder / n) for n in sorted(finals, key=lambda n: manifest["runs"][n]["seed"])]
    for run in runs:
        done = run.rows and int(run.rows[-1].get("round", -1)) == int(run.config.get("num-rounds", -2))
        if not done and manifest["runs"][run.name].get("status") != "diverged":
            raise ValueError(f"{run.folder}: the run has not finished: rerun the runner (finished runs are skipped)")
    valid = [last_value(r.folder, select) for r in runs]
    compute = sum(float(e.get("elapsed") or 0.0) for e in manifest["runs"].values())
    z = float(runs[0].config.get("dp-noise-multiplier") or 0.0)
    method = runs[0].label + (f" + DP z={z:g}" if z > 0 else "")  # told apart from the method without DP
    tuning = [{"values": dict(point), "scores": scores.get(point, []), "clip-share": clip_share(clipped.get(point, [])),
               "dp-norms": norm_summary(clipped.get(point, [])), "selected": dict(point) == selected}
              for point in (tuple(p) for p in grid_points(manifest["grid"]))]
    return Compared(manifest["run-name"], runs[0].group, method, selected, runs, select,
                    summary([v for v in valid if v is not None]), len(manifest["runs"]), compute, tuning)


def clip_share(runs: Sequence[Run]) -> float | None:
    """The share of local steps that clipped, over ``runs``: per run the mean of its rows' ``clip-fraction``
    (a round's share of clipped client steps; naive parallel clipping: 1 or 0, its one step a round), then the
    mean over the runs; None when no row reports one (a method that does not clip)."""
    per_run = [[v for _, v in run.series("clip-fraction")] for run in runs]
    per_run = [sum(v) / len(v) for v in per_run if v]
    return sum(per_run) / len(per_run) if per_run else None


def privacy(c: Compared) -> tuple[list[float | None], str]:
    """Each run's epsilon after its last round (None: no DP) and the table's text: epsilon at delta, one value
    when every seed spent the same (equal z, K, M, rounds and delta do), else the range."""
    last = [r.rows[-1] if r.rows else {} for r in c.runs]
    eps = [float(row["dp-epsilon"]) if isinstance(row.get("dp-epsilon"), (int, float)) else None for row in last]
    if all(e is None for e in eps):
        return eps, "no DP"
    found = [e for e in eps if e is not None]
    deltas = sorted({float(row["dp-delta"]) for row in last if isinstance(row.get("dp-delta"), (int, float))})
    text = f"{found[0]:.3g}" if len({f'{e:.3g}' for e in found}) == 1 else f"{min(found):.3g}-{max(found):.3g}"
    text += " (δ " + "/".join(f"{d:.2g}" for d in deltas) + ")"
    if len(found) < len(eps):
        text += f" ({len(eps) - len(found)} without DP)"
    return eps, text + ("" if all(row.get("dp-private") for row in last if "dp-epsilon" in row) else " NOT private")


def final_values(c: Compared) -> list[float | None]:
    key, _ = c.metric
    out = []
    for run in c.runs:
        series = run.series(key)
        done = int(run.rows[-1].get("round", -1)) == int(run.config.get("num-rounds", -2))
        out.append(series[-1][1] if done and series and series[-1][0] is run.rows[-1] else None)  # None: diverged
    return out


def step_time(run: Run) -> float | None:
    """Training seconds per local step of one client (wall-clock, evaluation excluded, / client-steps)."""
    last = run.rows[-1] if run.rows else {}
    cfg = run.config
    clients = int(cfg.get("clients-per-round") or 0) or int(cfg.get("num-clients") or 1)
    steps = int(last.get("round", 0)) * int(cfg.get("local-steps", 1)) * clients
    clock = last.get("wall-clock")
    return float(clock) / steps if steps and isinstance(clock, (int, float)) else None


def table(compared: Sequence[Compared], target: dict[str, float | None]) -> tuple[str, list[dict[str, Any]]]:
    """The markdown table and its rows as data."""
    dp = any(e is not None for c in compared for e in privacy(c)[0])  # the ε column only where a run is private
    lines = ["| setting | method | selected | seeds | " + ("ε at δ | " if dp else "") + "validation ("
             + "/".join(sorted({c.select for c in compared}))
             + ") | final test: mean ± std | 95 % interval | steps clipped | target | rounds to target "
               "| MB to target | s per local step | sweep runs | sweep compute (s) |",
             "|---|---|---|---|" + ("---|" if dp else "") + "---|---|---|---|---|---|---|---|---|---|"]
    data = []
    for c in compared:
        key, better = c.metric
        finals = final_values(c)
        diverged = sum(v is None for v in finals)
        s = summary([v for v in finals if v is not None])
        goal = target.get(c.setting)
        hits = [rounds_to_target(r, goal, key, better) if goal is not None else None for r in c.runs]
        reached = [h for h in hits if h is not None]
        rounds = summary([h["round"] for h in reached])
        mbytes = summary([h["bytes"] / 1e6 for h in reached])
        times = [t for t in (step_time(r) for r in c.runs) if t is not None]
        row = {"setting": c.setting, "method": c.method, "selected": c.selected, "seeds": len(c.runs),
               "metric": key, "final": finals, "final-summary": s.__dict__, "diverged": diverged,
               "valid": c.valid.__dict__, "target": goal, "reached": len(reached),
               "rounds-to-target": rounds.__dict__, "mb-to-target": mbytes.__dict__,
               "step-seconds": sum(times) / len(times) if times else None, "clip-share": clip_share(c.runs),
               "sweep-runs": c.sweep_runs, "sweep-compute-seconds": c.compute_seconds}
        epsilons, eps_txt = privacy(c)
        if dp:
            row["dp-epsilon"] = epsilons
        data.append(row)
        pct = 100.0 if key.endswith("accuracy") else 1.0
        vscale = 100.0 if c.select.endswith("accuracy") else 1.0
        sel = _selected(c)
        final_txt = "diverged on every seed" if s.mean is None else f"{s.mean * pct:.2f} ± {(s.std or 0) * pct:.2f}"
        if diverged and s.mean is not None:
            final_txt += f" ({diverged} diverged)"
        ci = "-" if s.low is None else f"[{s.low * pct:.2f}, {s.high * pct:.2f}]"
        lines.append(
            f"| {c.setting} | {c.method} | {sel} | {len(c.runs)} | {eps_txt + ' | ' if dp else ''}"
            f"{_fmt(c.valid, vscale)} | {final_txt} | {ci} | {_share(row['clip-share'])} | "
            f"{'-' if goal is None else f'{goal * pct:.4g}'} | {_interval(rounds, len(reached), len(c.runs), 0)} | "
            f"{_interval(mbytes, len(reached), len(c.runs), 1)} | "
            f"{'-' if not times else f'{sum(times) / len(times) * 1e3:.2f} ms'} | {c.sweep_runs} | {c.compute_seconds:.0f} |")
    return "\n".join(lines) + "\n", data


def _selected(c: Compared) -> str:
    return ", ".join(f"{_greek(k)} {format_value(v)}" for k, v in c.selected.items()) or "-"


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f} %"


def tuning_table(compared: Sequence[Compared]) -> str:
    """Every tuning point of every sweep: its validation score (mean over the tuning seeds; a run that
    diverged or did not finish shows as such) and its share of clipped steps; the selected point marked."""
    dp = any(point.get("dp-norms") for c in compared for point in c.tuning)  # DP: the update norms against S
    lines = ["| setting | method | point | validation | steps clipped | " + ("update norm mean / max, ÷ S | " if dp else "")
             + "selected |", "|---|---|---|---|---|" + ("---|" if dp else "") + "---|"]
    for c in compared:
        vscale = 100.0 if c.select.endswith("accuracy") else 1.0
        for point in c.tuning:
            scores = point["scores"]
            found = [s for s in scores if s is not None]
            if not scores:
                score = "not run"
            elif not found:
                score = "diverged"
            else:
                score = f"{sum(found) / len(found) * vscale:.4g}" + (
                    f" ({len(scores) - len(found)} of {len(scores)} diverged)" if len(found) < len(scores) else "")
            values = ", ".join(f"{_greek(k)} {format_value(v)}" for k, v in point["values"].items()) or "-"
            norms = point.get("dp-norms")
            extra = ("-" if not norms else f"{norms['norm-mean'] / norms['sensitivity']:.2f} / "
                     f"{norms['norm-max'] / norms['sensitivity']:.2f}") + " | " if dp else ""
            lines.append(f"| {c.setting} | {c.method} | {values} | {score} | {_share(point['clip-share'])} | {extra}"
                         f"{'yes' if point['selected'] else ''} |")
    return "\n".join(lines) + "\n"


def _greek(key: str) -> str:
    return {"lr": "η", "clip": "γ", "local-steps": "I", "dp-clip": "C"}.get(key, key)


def _fmt(s: Summary, scale: float) -> str:
    return "-" if s.mean is None else f"{s.mean * scale:.2f}" if scale != 1.0 else f"{s.mean:.3f}"


def _interval(s: Summary, reached: int, n: int, digits: int) -> str:
    if s.mean is None:
        return f"not reached (0/{n})"
    text = f"{s.mean:.{digits}f}"
    if s.low is not None:
        text += f" [{s.low:.{digits}f}, {s.high:.{digits}f}]"
    return text + ("" if reached == n else f" ({reached}/{n} reached)")


def exchanges(config: dict[str, Any]) -> int:
    """Message exchanges of one round (the method's modes: CELGC one, EPISODE two); 0 for one client,
    which communicates nothing."""
    if int(config.get("num-clients") or 0) == 1:
        return 0
    name = str(config.get("algorithm", "celgc"))
    try:
        return len(method_class(name).modes)
    except (ValueError, TypeError, ImportError) as exc:
        raise ValueError(f"algorithm {name!r} of a run: {exc}") from None


def _clients(config: dict[str, Any]) -> int:
    return int(config.get("clients-per-round") or 0) or int(config.get("num-clients") or 1)


def time_to_target(run: Run, hit: dict[str, Any], link: Link) -> float | None:
    """Modelled seconds of ``run`` on ``link`` up to its round ``hit`` (``rounds_to_target``): the
    run's own measured training time per local step (``step_time``) as its compute."""
    seconds = step_time(run)
    if seconds is None:
        return None
    cfg = run.config
    return run_seconds(run.rows, link, until_round=hit["row"], step_seconds=seconds,
                       local_steps=int(cfg.get("local-steps", 1)), clients=_clients(cfg), exchanges=exchanges(cfg))


def _bytes_to(run: Run, until_row: int) -> tuple[int, int]:
    """(down, up): bytes the server sent and received in rounds 1 .. ``until_row``."""
    rows = [r for r in run.rows if 1 <= int(r.get("round", 0)) <= until_row]
    return (sum(int(r.get("bytes-sent", 0) or 0) for r in rows), sum(int(r.get("bytes-received", 0) or 0) for r in rows))


def network_table(compared: Sequence[Compared], target: dict[str, float | None],
                  links: Sequence[Link]) -> tuple[str, dict[str, dict[str, Any]]]:
    """The time-to-target table under each link (markdown) and its data per sweep name."""
    if not links:
        return "", {}
    head = ("| setting | method | target | rounds to target | MB down / up to target | "
            + " | ".join(f"{link.name}: s to target" for link in links) + " |")
    lines = ["Time to the target under a network model (`simulations/network.py`; "
             "docs/experiments/network-model.md): a round costs the run's measured training time per local step × "
             "its local steps, 2 × latency per exchange, and one client's bytes over the downlink and the uplink; "
             "clients in parallel, nothing else modelled. Mean [95 % interval] over the seeds that reached the "
             "target. Links: " + "; ".join(f"{link.name} = {link.describe()}" for link in links) + ".", "",
             head, "|" + "---|" * (5 + len(links))]
    data: dict[str, dict[str, Any]] = {}
    for c in compared:
        key, better = c.metric
        goal = target.get(c.setting)
        hits = [(r, rounds_to_target(r, goal, key, better)) if goal is not None else (r, None) for r in c.runs]
        reached = [(r, h) for r, h in hits if h is not None]
        n = len(c.runs)
        rounds = summary([h["round"] for _, h in reached])
        down_up = [_bytes_to(r, h["row"]) for r, h in reached]
        down, up = summary([d / 1e6 for d, _ in down_up]), summary([u / 1e6 for _, u in down_up])
        cells, times = [], {}
        for link in links:
            secs = [t for t in (time_to_target(r, h, link) for r, h in reached) if t is not None]
            s = summary(secs)
            times[link.name] = {**s.__dict__, "reached": len(reached), "timed": len(secs), "seeds": n}
            cells.append(_seconds(s, len(secs), n))
        data[c.name] = {"time-to-target": times, "mb-down-to-target": down.__dict__, "mb-up-to-target": up.__dict__,
                        "network": {link.name: {"down-bps": link.down_bps, "up-bps": link.up_bps,
                                                "latency-s": link.latency_s} for link in links}}
        mb = "-" if down.mean is None else f"{down.mean:.1f} / {up.mean:.1f}"
        pct = 100.0 if key.endswith("accuracy") else 1.0
        lines.append(f"| {c.setting} | {c.method} | {'-' if goal is None else f'{goal * pct:.4g}'} | "
                     f"{_interval(rounds, len(reached), n, 0)} | {mb} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", data


def _seconds(s: Summary, reached: int, n: int) -> str:
    """'12.3 [10.1, 14.5] (4/5 reached)': seconds, 3 significant digits (whole seconds from 100 s)."""
    if s.mean is None:
        return f"not reached (0/{n})"

    def f(x: float) -> str:
        return f"{x:.0f}" if abs(x) >= 99.95 else f"{x:.3g}"

    text = f(s.mean) + ("" if s.low is None else f" [{f(s.low)}, {f(s.high)}]")
    return text + ("" if reached == n else f" ({reached}/{n} reached)")


def curves(c: Compared) -> tuple[list[float], list[float], list[list[float]]]:
    """(local steps per client, MB communicated, metric per seed) at the evaluated rounds shared by every seed."""
    key, _ = c.metric
    per_seed = []
    for run, final in zip(c.runs, final_values(c), strict=True):
        if final is None:  # diverged: counted in the label, not drawn
            continue
        steps = int(run.config.get("local-steps", 1))
        total, points = 0, {}
        for row in run.rows:
            total += int(row.get("bytes-sent", 0) or 0) + int(row.get("bytes-received", 0) or 0)
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                points[int(row["round"])] = (int(row["round"]) * steps, total / 1e6,
                                             float(value) if math.isfinite(value) else math.nan)
        per_seed.append(points)
    if not per_seed:
        return [], [], []
    rounds = sorted(set.intersection(*(set(p) for p in per_seed)))
    xs = [per_seed[0][r][0] for r in rounds]
    mb = [per_seed[0][r][1] for r in rounds]
    ys = [[p[r][2] for r in rounds] for p in per_seed]
    return xs, mb, ys


def figures(compared: Sequence[Compared], out: Path) -> list[Path]:
    from .plots import _pyplot, _slug

    plt = _pyplot()
    written = []
    settings: dict[str, list[Compared]] = defaultdict(list)
    for c in compared:
        settings[c.setting].append(c)
    for setting, group in settings.items():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        key = group[0].metric[0]
        for c in group:
            xs, mb, ys = curves(c)
            if not ys:
                continue
            mean, low, high = band(ys)
            lost = len(c.runs) - len(ys)
            point = ", ".join(f"{_greek(k)}={format_value(v)}" for k, v in c.selected.items())
            label = (c.method + (f" ({point})" if point else "")  # a sweep without a grid has no point to show
                     + (f", {lost}/{len(c.runs)} diverged" if lost else ""))
            for ax, x in zip(axes, (xs, mb), strict=True):
                line, = ax.plot(x, mean, label=label)
                ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        for ax, xlabel in zip(axes, ("local steps per client (rounds × I)", "MB communicated (sent + received)"),
                              strict=True):
            ax.set_xlabel(xlabel)
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
        axes[1].set_xscale("log")
        axes[0].legend(fontsize=7)
        n = sorted({len(c.runs) for c in group})
        fig.suptitle(f"{setting}: {key}, mean over {'/'.join(map(str, n))} seeds with 95 % interval, each method "
                     "at its point selected on validation", fontsize=9)
        fig.tight_layout()
        path = out / f"{_slug(setting)}-bands.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    methods = list(dict.fromkeys(c.method for c in compared))
    names = list(settings)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.6 * len(names)), 4.2))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        xs, ys, errs = [], [], []
        for j, setting in enumerate(names):
            for c in settings[setting]:
                if c.method == method:
                    s = summary([v for v in final_values(c) if v is not None])
                    if s.mean is not None:
                        xs.append(j + (i - (len(methods) - 1) / 2) * width)
                        ys.append(s.mean)
                        errs.append(s.half_width or 0.0)
        ax.errorbar(xs, ys, yerr=errs, fmt="o", capsize=3, label=method)
    ax.set_xticks(range(len(names)), names, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel(f"final {compared[0].metric[0]}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("final value, mean and 95 % interval over seeds (selected on validation)", fontsize=9)
    fig.tight_layout()
    path = out / "by-setting.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)
    return written


def compare(paths: Sequence[str | Path], out: str | Path, target: float | None = None,
            plots: bool = True, links: Sequence[Link] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """Select, summarise and draw every sweep under ``paths``; returns the markdown tables and their data.
    ``links``: the network links of the time-to-target table (None: ``simulations.network.LINKS``; empty:
    no such table)."""
    manifests = find_manifests(paths)
    if not manifests:
        raise FileNotFoundError(f"no sweep manifest (*.sweep.json) under {', '.join(map(str, paths))}")
    compared = sorted(distinguish([load_compared(m) for m in manifests]), key=lambda c: (c.setting, _order(c.method)))
    goals: dict[str, float | None] = {}
    for c in compared:
        if c.setting not in goals:
            goals[c.setting] = target if target is not None else common_target(
                [r for d in compared if d.setting == c.setting for r in d.runs])
    text, data = table(compared, goals)
    timed, per_sweep = network_table(compared, goals, parse_links(None) if links is None else links)
    if timed:
        text += "\n" + timed
    if any(len(c.tuning) > 1 for c in compared):
        text += f"\nTuning points (validation: {'/'.join(sorted({c.select for c in compared}))}, mean over the tuning " \
                "seeds at the tuning budget; steps clipped over the same runs):\n\n" + tuning_table(compared)
    private, per_private = privacy_table(compared, _selected)
    if private:
        text += "\n" + private
    for c, row in zip(compared, data, strict=True):
        row.update(per_sweep.get(c.name, {}))
        row.update(per_private.get(c.name, {}))
        row["tuning"] = c.tuning
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.md").write_text(text)
    (out / "comparison.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    if plots:
        figures(compared, out)
    return text, data


#: run-config keys that tell apart sweeps of one method in one setting (an N-sweep; one method at two fixed
#: points, such as its selected point and one where it clips), as the label shows them
DISTINGUISH = (("num-clients", "N"), ("batch-size", "b"), ("lr", "η"), ("clip", "γ"), ("transport", "transport"),
               ("node-aggregation", "node-aggregation"))


def distinguish(compared: list[Compared]) -> list[Compared]:
    """Sweeps of one method in one setting that differ in a key of ``DISTINGUISH`` (an N-sweep: 'CELGC I=8'
    at N = 2, 4, ...; EPISODE at γ = 4 and at γ = 1) get it in their method label ('CELGC I=8, N=4',
    'EPISODE I=8, γ=1'), the value of their selected point; others keep theirs."""
    same: dict[tuple[str, str], list[Compared]] = defaultdict(list)
    for c in compared:
        same[(c.setting, c.method)].append(c)
    for group in same.values():
        for key, short in DISTINGUISH if len(group) > 1 else ():
            if len({str(c.runs[0].config.get(key)) for c in group}) > 1:
                for c in group:
                    c.method += f", {short}={format_value(c.runs[0].config.get(key))}"
    return compared


def _order(method: str) -> tuple[int, list[Any]]:
    """Methods in a fixed order of families, then naturally ('I=2' before 'I=16')."""
    prefixes = ("CELGC", "EPISODE", "naive", "local SGD", "SCAFFOLD", "single")
    natural = [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", method)]
    return next((i for i, p in enumerate(prefixes) if method.startswith(p)), len(prefixes)), natural


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m simulations.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results folders holding sweeps (their *.sweep.json)")
    parser.add_argument("--out", required=True, help="folder for comparison.md, comparison.json and the figures")
    parser.add_argument("--target", type=float, help="level for rounds/MB to target (default: the level every run reached)")
    parser.add_argument("--network", metavar="LINKS", help=NETWORK_HELP)
    parser.add_argument("--no-plots", action="store_true")
    ns = parser.parse_args(argv)
    try:
        links = parse_links(ns.network)
        text, _ = compare(ns.results, ns.out, ns.target, plots=not ns.no_plots, links=links)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

