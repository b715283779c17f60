"""Robust aggregation on digits: what it costs honest runs, and what it saves under attack.

    python benchmarks/robust.py                 # everything below, 2 processes (about 15 min on 2 cores)
    python benchmarks/robust.py --part honest   # or attack, or speed; --seeds 3 --rounds 20 --jobs 2

* ``honest``: CELGC (I = 8, the default run) with N = 8 clients, homogeneous and Dirichlet
  alpha = 0.1, each aggregation (uniform -- the paper --, median, trimmed mean beta = 0.25) over
  ``--seeds`` seeds, on the engine (which equals the Flower path bit for bit; tests).
* ``attack``: the real ServerApp and ClientApp on the in-process grid, f lying clients
  (``simulations.attacks``: sign-flip at the bound, a same-direction push at the bound,
  BatchNorm running_var 1e30, running_mean 1e6) of N: 1 of 3, 2 of 8, and 10 of 50 with 20
  sampled a round (partial participation, batch 16); homogeneous; trimmed mean with beta = f / N (1/3,
  0.25, 0.25); every round every liar lies. The clean run of the same aggregation beside it.
* ``speed``: one aggregation of n client states on this machine, uniform vs median vs trimmed
  mean, for the digits CNN and a ResNet-56-sized state (853,018 float32 values).

Prints markdown tables (mean +- std over seeds of the final test accuracy, in %) and writes
every run's figures to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SCENARIOS = {  # name -> (num-clients, liars, clients-per-round, trim-fraction, batch-size)
    "1 of 3": (3, 1, 0, 0.34, 32),
    "2 of 8": (8, 2, 0, 0.25, 32),
    "10 of 50, 20 a round": (50, 10, 20, 0.25, 16),  # 28 examples the smallest client
}
ATTACKS = ("sign-flip", "bias-push", "bn-var-huge", "bn-mean-huge")
AGGREGATIONS = ("uniform", "median", "trimmed-mean")


def one_run(spec: dict) -> dict:
    """One run (``spec``: run-config keys, plus ``attack`` / ``liars`` / ``backend``): its final accuracy."""
    logging.disable(logging.WARNING)
    from tasks.config import RunConfig
    from tasks.runs.results import read_results

    spec = dict(spec)
    attack, liars, backend = spec.pop("attack", None), spec.pop("liars", 0), spec.pop("backend", "flower")
    folder = tempfile.mkdtemp(prefix="robust-")
    values = {**RunConfig().to_mapping(), "device": "cpu", "node-wait": 5.0, "results-dir": folder,
              "run-name": "run", **spec}
    values["eval-every"] = values["num-rounds"]
    start = time.perf_counter()
    if backend == "engine":
        from simulations.engine import run_engine
        run_engine(RunConfig.from_mapping(values), show_progress=False)
    else:
        from client.app import app as client_app
        from server.app import app as server_app
        from simulations.attacks import LyingGrid
        from simulations.loopback import LoopbackGrid, run_server_app
        n = values["num-clients"]
        grid = (LyingGrid(client_app, values, n, attack=attack, liars=range(liars)) if attack
                else LoopbackGrid(client_app, values, n))
        run_server_app(server_app, grid)
    _, rows = read_results(Path(folder) / "run" / "results.jsonl")
    return {**spec, "attack": attack, "liars": liars, "backend": backend, "seconds": time.perf_counter() - start,
            "test-accuracy": rows[-1]["test-accuracy"], "rejected": sum(r["rejected-replies"] for r in rows[1:])}


def summary(values: list[float]) -> str:
    mean = 100 * statistics.fmean(values)
    std = 100 * statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.2f} ± {std:.2f}"


def honest_specs(seeds: int, rounds: int) -> list[dict]:
    out = []
    for part in ({"partitioner": "homogeneous"}, {"partitioner": "dirichlet", "dirichlet-alpha": 0.1}):
        for agg in AGGREGATIONS:
            for seed in range(seeds):
                out.append({"backend": "engine", "num-clients": 8, "num-rounds": rounds, "seed": seed,
                            "aggregation": agg, "trim-fraction": 0.25, **part})
    return out


def attack_specs(seeds: int, rounds: int) -> list[dict]:
    out = []
    for name, (n, f, k, beta, batch) in SCENARIOS.items():
        for agg in AGGREGATIONS:
            for attack in (None, *ATTACKS):
                for seed in range(seeds):
                    out.append({"scenario": name, "num-clients": n, "clients-per-round": k, "num-rounds": rounds,
                                "seed": seed, "aggregation": agg, "trim-fraction": beta, "batch-size": batch, "attack": attack,
                                "liars": f if attack else 0})
    return out


def run_all(specs: list[dict], jobs: int) -> list[dict]:
    scenario = [s.pop("scenario", None) for s in specs]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:  # no fork of torch threads
        results = list(pool.map(one_run, specs))
    for r, name in zip(results, scenario, strict=True):
        if name is not None:
            r["scenario"] = name
    return results


def honest_table(results: list[dict]) -> str:
    lines = ["| partition | " + " | ".join(AGGREGATIONS) + " |", "|---|" + "---|" * len(AGGREGATIONS)]
    for part in ("homogeneous", "dirichlet"):
        cells = [summary([r["test-accuracy"] for r in results if r["partitioner"] == part and r["aggregation"] == a])
                 for a in AGGREGATIONS]
        label = "homogeneous" if part == "homogeneous" else "Dirichlet 0.1"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def attack_table(results: list[dict]) -> str:
    lines = ["| liars | attack | " + " | ".join(AGGREGATIONS) + " |", "|---|---|" + "---|" * len(AGGREGATIONS)]
    for name in SCENARIOS:
        for attack in (None, *ATTACKS):
            cells = []
            for a in AGGREGATIONS:
                runs = [r for r in results if r["scenario"] == name and r["attack"] == attack and r["aggregation"] == a]
                rejected = sum(r["rejected"] for r in runs)
                cells.append(summary([r["test-accuracy"] for r in runs]) + (f" ({rejected} rejected)" if rejected else ""))
            lines.append(f"| {name} | {attack or 'none (clean)'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speed_table(repeats: int = 5) -> str:
    import math

    import torch

    from strategies.core.client_metrics import COLUMNS
    from strategies.methods import reduce as R
    from tasks import cached_task, initial_model
    from tasks.config import RunConfig

    digits = initial_model(cached_task(RunConfig()), 0).state_dict()
    resnet = {"w": torch.zeros(853_018)}
    lines = ["| state | clients | uniform | median | trimmed mean | median / uniform |", "|---|---|---|---|---|---|"]
    for label, like in (("digits CNN (30,060 values)", digits), ("ResNet-56 size (853,018)", resnet)):
        for n in (8, 50):
            g = torch.Generator().manual_seed(n)
            states = [{k: (torch.randn(v.shape, generator=g) if v.dtype.is_floating_point else v.clone())
                       for k, v in like.items()} for _ in range(n)]
            results = R.ClientResults(list(range(n)), {"arrays": states},
                                      torch.full((n, len(COLUMNS)), math.nan, dtype=torch.float64),
                                      torch.ones(n, dtype=torch.float64))
            times = {}
            for agg in AGGREGATIONS:
                best = math.inf
                for _ in range(repeats):
                    t = time.perf_counter()
                    R.mean(results, {"arrays": like}, aggregation=agg, expected=n, trim_fraction=0.25)
                    best = min(best, time.perf_counter() - t)
                times[agg] = best
            lines.append(f"| {label} | {n} | {1e3 * times['uniform']:.1f} ms | {1e3 * times['median']:.1f} ms | "
                         f"{1e3 * times['trimmed-mean']:.1f} ms | {times['median'] / times['uniform']:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "honest", "attack", "speed"), default="all")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="robust.json")
    args = parser.parse_args()
    record: dict = {}
    start = time.perf_counter()
    if args.part in ("all", "speed"):
        record["speed"] = speed_table()
        print("## One aggregation (best of 5)\n\n" + record["speed"] + "\n", flush=True)
    if args.part in ("all", "honest"):
        record["honest"] = run_all(honest_specs(args.seeds, args.rounds), args.jobs)
        print(f"## Honest runs: N = 8, CELGC I = 8, {args.rounds} rounds, {args.seeds} seeds (test accuracy %)\n\n"
              + honest_table(record["honest"]) + "\n", flush=True)
    if args.part in ("all", "attack"):
        record["attack"] = run_all(attack_specs(args.seeds, args.rounds), args.jobs)
        print(f"## Under attack: CELGC I = 8, {args.rounds} rounds, {args.seeds} seeds (test accuracy %)\n\n"
              + attack_table(record["attack"]) + "\n", flush=True)
    print(f"total {time.perf_counter() - start:.0f} s")
    Path(args.out).write_text(json.dumps(record, indent=1, default=str))


if __name__ == "__main__":
    main()
