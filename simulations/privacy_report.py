"""What a DP sweep's rows say beyond its accuracy: the sensitivity S against the clients' update norms, the
share of contributions projected, and epsilon by both accountants (``simulations.compare``'s privacy table).

A DP run's rows carry, every round, the sensitivity ``dp-sensitivity`` (S: the method's bound or ``dp-clip``)
and the contributions' norms before projection (``dp-update-norm-mean``, ``-q90``, ``-max``,
``dp-projected-share``; ``strategies.methods.privacy``). ``norm_summary`` averages them over the rounds of
each run, then over the runs; ``privacy_table`` writes one line per private sweep (its selected point over
every seed), with the run's epsilon at its delta by RDP and by PLD (``strategies.core.dp_accountant``,
computed from the run's config: the same z, K, M, rounds and delta).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from strategies.core.dp_accountant import Accountant, default_delta

#: the rows' keys averaged by ``norm_summary`` (row key -> summary key)
NORM_KEYS = {"dp-sensitivity": "sensitivity", "dp-update-norm-mean": "norm-mean", "dp-update-norm-q90": "norm-q90",
             "dp-update-norm-max": "norm-max", "dp-projected-share": "projected-share"}


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def norm_summary(runs: Sequence[Any]) -> dict[str, float | None] | None:
    """Per key of ``NORM_KEYS``: each run's mean over its rounds (finite values), then the mean over the
    runs; also ``norm-max-max``, the largest norm any client sent. None when no run has the keys (no DP,
    or rows from before they were recorded)."""
    per_run: dict[str, list[float]] = {v: [] for v in NORM_KEYS.values()}
    largest: list[float] = []
    for run in runs:
        for key, name in NORM_KEYS.items():
            values = [float(r[key]) for r in run.rows if isinstance(r.get(key), (int, float))
                      and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
            if values:
                per_run[name].append(sum(values) / len(values))
                if key == "dp-update-norm-max":
                    largest.append(max(values))
    if not per_run["norm-mean"]:
        return None
    return {**{name: _mean(v) for name, v in per_run.items()}, "norm-max-max": max(largest) if largest else None}


def accounted(config: dict[str, Any]) -> dict[str, float] | None:
    """Epsilon after the run's rounds at its delta by both accountants (None: no DP); the run's own
    ``dp-accountant`` is the one its rows report."""
    z = float(config.get("dp-noise-multiplier") or 0.0)
    if z <= 0:
        return None
    m = int(config.get("num-clients") or 0)
    k = int(config.get("clients-per-round") or 0) or m
    delta = float(config.get("dp-delta") or 0.0) or default_delta(m)
    rounds = int(config.get("num-rounds") or 0)
    return {"delta": delta, **{kind: Accountant(z, k, m, delta, kind).epsilon(rounds) for kind in ("rdp", "pld")}}


def privacy_table(compared: Sequence[Any], selected: Callable[[Any], str]) -> tuple[str, dict[str, dict[str, Any]]]:
    """One line per private sweep (its selected point, written by ``selected``): S, the update norms (mean
    over rounds, then seeds), the share projected, and epsilon at delta by RDP and PLD; and the data per
    sweep name. Empty without DP."""
    lines = ["| setting | method | selected | S (sensitivity) | update norm: mean / q90 / max | largest norm sent "
             "| mean / S | projected | ε RDP | ε PLD | δ |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    data: dict[str, dict[str, Any]] = {}
    for c in compared:
        eps = accounted(c.runs[0].config) if c.runs else None
        if eps is None:
            continue
        norms = norm_summary(c.runs)
        data[c.name] = {"dp-norms": norms, "dp-accounted": eps}
        sel = selected(c)
        if norms is None:
            cells = "- | - | - | - | - |"
        else:
            cells = (f"{norms['sensitivity']:.3g} | {norms['norm-mean']:.3g} / {norms['norm-q90']:.3g} / "
                     f"{norms['norm-max']:.3g} | {norms['norm-max-max']:.3g} | "
                     f"{norms['norm-mean'] / norms['sensitivity']:.2f} | {norms['projected-share'] * 100:.0f} % |")
        lines.append(f"| {c.setting} | {c.method} | {sel} | {cells} {eps['rdp']:.3g} | {eps['pld']:.3g} | "
                     f"{eps['delta']:.2g} |")
    if not data:
        return "", {}
    head = ("Privacy (`simulations/privacy_report.py`): the sensitivity S and the clients' update norms before "
            "projection, each run's mean over its rounds, then the mean over the seeds (rows `dp-update-norm-*`, "
            "computed from the clients' data and not noised); the largest norm any client sent in any round; the "
            "share of contributions projected onto the ball of radius S; epsilon after the run's rounds at its "
            "delta by both accountants (`dp-accountant`; the rows report the run's own).")
    return head + "\n\n" + "\n".join(lines) + "\n", data
