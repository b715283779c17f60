"""Fingerprints of short runs of every method, to show a refactor leaves results bit-identical.

For every registered method (and robust aggregation) a short digits run goes through the engine
(sequential, and vmap where the method allows it) and through the real ServerApp + ClientApp on the
in-process grid (``simulations.loopback``: one node a client, and one node holding every
client); each run prints one line: a sha256 of the final model's tensors (names, dtypes, shapes,
bytes) and one of the results rows with the wall-clock fields left out. Run it before and after a
change and compare the outputs (``diff``): equal lines, equal runs.

    python -m benchmarks.fingerprint > before.txt   # ... change ...
    python -m benchmarks.fingerprint > after.txt && diff before.txt after.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

#: name -> run-config overrides of a short run (few rounds, few clients)
CASES: dict[str, dict] = {
    "celgc": {"algorithm": "celgc"},
    "local-sgd": {"algorithm": "local-sgd", "clip": "off"},
    "naive": {"algorithm": "naive", "local-steps": 1, "momentum": 0.5, "weight-decay": 1e-3},
    "episode": {"algorithm": "episode"},
    "scaffold": {"algorithm": "scaffold", "clip": "off"},
    "single": {"algorithm": "single", "num-clients": 1},
    "celgc-median": {"algorithm": "celgc", "aggregation": "median"},
    "fedprox": {"algorithm": "fedprox", "fedprox.proximal-mu": 0.1},
    "fedavgm": {"algorithm": "fedavgm", "fedavgm.server-momentum": 0.7},
    "fedadam": {"algorithm": "fedadam"},
    "fedyogi": {"algorithm": "fedyogi"},
}
BASE = {"num-clients": 3, "num-rounds": 2, "local-steps": 2, "batch-size": 16, "device": "cpu", "node-wait": 2.0}
#: the engine's paths, and the ServerApp + ClientApp with one node a client or one node holding all clients
BACKENDS = ("sequential", "vmap", "flower", "flower-1-node")
#: row keys that measure time, not results
TIMED = ("wall-clock",)


def state_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rows_digest(rows: Sequence[dict]) -> str:
    kept = [{k: v for k, v in row.items() if k not in TIMED} for row in rows]
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=repr).encode()).hexdigest()


def _read(folder: Path) -> tuple[str, str]:
    from tasks.runs.results import load_weights, read_results

    _, rows = read_results(folder / "results.jsonl")
    return state_digest(load_weights(folder / "model.pt")), rows_digest(rows)


def fingerprint(case: str, backend: str, root: Path) -> str:
    from tasks.config import RunConfig

    name = f"{case}-{backend}"
    values = {**RunConfig().to_mapping(), **BASE, **CASES[case], "results-dir": str(root), "run-name": name}
    try:
        if backend in ("flower", "flower-1-node"):
            from client.app import app as client_app
            from server.app import app as server_app
            from simulations.loopback import LoopbackGrid, run_server_app

            nodes = 1 if backend == "flower-1-node" else values["num-clients"]
            run_server_app(server_app, LoopbackGrid(client_app, values, nodes))
        else:
            from simulations.engine import EngineOptions, run_engine

            run_engine(RunConfig.from_mapping(values), EngineOptions(path=backend), show_progress=False)
    except Exception as exc:  # a refusal is part of the fingerprint (vmap where a method does not allow it)
        return f"{name:24s} refused: {type(exc).__name__}: {exc}"
    model, rows = _read(root / name)
    return f"{name:24s} model {model} rows {rows}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fingerprint", description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--backends", nargs="*", default=list(BACKENDS), choices=list(BACKENDS))
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            for backend in args.backends:
                print(fingerprint(case, backend, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
