"""`flwr run` against the engine, side by side in one run: whole process, seconds a round, memory.

For each setting it runs the same run config several ways and prints one table:

* ``flwr run, 1 client a node`` -- a real simulation (private SuperLink, Ray) with
  ``num-supernodes = num-clients``: one ClientApp call per client and exchange;
* ``flwr run, multi-client nodes`` -- the same with Flower's default 2 SuperNodes: each node
  serves every 2nd client with one call of its executor (``client/app.py``);
* ``deployment`` (``--deployment``) -- a real deployment on loopback (TLS, SuperNode
  authentication, ``server/deploy/*.sh``): a SuperLink and 2 SuperNodes serving the clients,
  the run submitted with ``submit.sh``; the ServerApp pulls the round's replies itself
  (``server.faults.WatchedGrid``), not through ``HttpGrid.send_and_receive``, which sleeps 3 s
  between pulls in flwr 1.42;
* ``in process`` -- this project's ServerApp and ClientApp objects on 2 nodes in one process
  (``simulations.loopback``): the same messages, checks and executors, no Flower transport
  (no SuperLink, Ray or polling), so ``flwr run`` minus this is Flower's and Ray's share;
* ``engine`` -- ``python -m simulations.engine``, no Flower.

``whole s``: from the start of the SuperLink (or of the engine's process) to the end of the
run as the user sees it (the run's status finished); ``s/round``: the training clock of the
results rows (``wall-clock``, evaluation excluded), first round to last, over the rounds;
``peak MiB``: the largest sum of the resident memory of the run's processes (SuperLink,
simulation, Ray; or the engine), sampled every 0.25 s. Ratios are to the engine, measured in
the same invocation. Every way's model is compared with the engine's, bit for bit (the last column).

Settings: ``default`` (pyproject: digits, N = 8, I = 8, 20 rounds), ``n32`` (N = 32, 10
rounds), ``cross-device`` (after pfl-research's CIFAR-10 benchmark, arXiv 2404.06430:
1,000 clients x 50 images, 50 a round, batch 10, one local epoch = 5 steps, a 2-conv CNN:
``benchmarks/cross_device.py``; synthetic CIFAR-shaped data unless the CIFAR-10 files are in
``--data-dir``; 5 rounds; ``--cross-device-one-per-node`` adds the 1,000-node federation).

    python benchmarks/flower_speed.py                  # all three settings
    python benchmarks/flower_speed.py --settings default --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from simulations.flower import LocalSuperLink, run_app  # noqa: E402
from simulations.flower.deploy import Deployment  # noqa: E402
from simulations.flower.processes import process_tree  # noqa: E402

SETTINGS = {
    "default": {},
    "n32": {"num-clients": 32, "num-rounds": 10},
    "cross-device": {"task": "benchmarks.cross_device:make_task", "num-clients": 1000, "clients-per-round": 50,
                     "batch-size": 10, "local-steps": 5, "num-rounds": 5, "eval-every": 5, "checkpoint-every": 0},
}


class PeakMemory:
    """The largest sum of VmRSS over a set of processes, sampled in a thread."""

    def __init__(self, pids) -> None:
        self.pids, self.peak, self._stop = pids, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for pid in self.pids():
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) * 1024
                except OSError:
                    continue
            self.peak = max(self.peak, total)
            self._stop.wait(0.25)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def rows_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()][1:]


def per_round(rows: list[dict]) -> float:
    clock = [r["wall-clock"] for r in rows]
    return (clock[-1] - clock[0]) / max(len(clock) - 1, 1)


def flwr(values: dict, nodes: int | None, work: Path, name: str) -> dict:
    t0 = time.monotonic()
    cwd = work / f"superlink-{name}"
    cwd.mkdir()
    with LocalSuperLink(cwd=cwd) as sl:
        roots = lambda: process_tree([sl.process.pid], tag=sl.tag) if sl.process else {}  # noqa: E731
        with PeakMemory(roots) as mem:
            run_app(ROOT, {**values, "run-name": name}, {"num-supernodes": nodes} if nodes else None, timeout=3000,
                    superlink=sl, poll_interval=0.2, fetch_log=False)
        whole = time.monotonic() - t0
    rows = rows_of(Path(values["results-dir"]) / name)
    return {"whole": whole, "round": per_round(rows), "peak": mem.peak, "rows": rows}


def deployment(values: dict, work: Path, name: str, nodes: int = 2) -> dict:
    t0 = time.monotonic()
    with Deployment(work / f"deploy-{name}", num_keys=nodes) as d:
        d.start_superlink()
        for i in range(nodes):
            d.register(i)
            d.start_supernode(i, partition=i, num_partitions=nodes)
        with PeakMemory(lambda: process_tree([p.pid for p in d.procs], tag=d.tag)) as mem:
            code, out, run = d.submit({**values, "run-name": name}, 3000)
        if code != 0:
            raise RuntimeError(out[-3000:])
        whole = time.monotonic() - t0
    rows = rows_of(Path(values["results-dir"]) / name)
    return {"whole": whole, "round": per_round(rows), "peak": mem.peak, "rows": rows}


def in_process(values: dict, name: str, nodes: int = 2) -> dict:
    """This project's ServerApp and ClientApp objects in one process (``simulations.loopback``):
    every message of the round, its checks and the nodes' executors, without Flower's transport."""
    code = ("import json, sys; from simulations.loopback import run_in_process; "
            "run_in_process(json.loads(sys.argv[1]), int(sys.argv[2]))")
    return timed([sys.executable, "-c", code, json.dumps({**values, "run-name": name}), str(nodes)], values, name)


def engine(values: dict, name: str) -> dict:
    overrides = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in {**values, "run-name": name}.items())
    return timed([sys.executable, "-m", "simulations.engine", "--quiet", "--config", "pyproject.toml",
                  "--run-config", overrides], values, name)


def timed(cmd: list[str], values: dict, name: str) -> dict:
    """One process of ``cmd``: whole seconds, s/round from its rows, peak memory."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with PeakMemory(lambda: [proc.pid]) as mem:
        _, err = proc.communicate()
    whole = time.monotonic() - t0
    if proc.returncode:
        raise RuntimeError(err.decode()[-3000:])
    rows = rows_of(Path(values["results-dir"]) / name)
    return {"whole": whole, "round": per_round(rows), "peak": mem.peak, "rows": rows}


def same_model(folder: Path, a: str, b: str) -> bool:
    x = torch.load(folder / a / "model.pt", weights_only=True)
    y = torch.load(folder / b / "model.pt", weights_only=True)
    return set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="default,n32,cross-device")
    p.add_argument("--rounds", type=int, default=0, help="override num-rounds (0: the setting's)")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--deployment", action="store_true",
                   help="also run a loopback deployment (TLS, 2 SuperNodes; needs openssl) of each setting")
    p.add_argument("--cross-device-one-per-node", action="store_true",
                   help="also run the cross-device setting with 1,000 SuperNodes (slow)")
    args = p.parse_args()
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    print(f"# {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, torch {torch.__version__}, no GPU"
          if not torch.cuda.is_available() else f"# {time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name(0)}")
    for setting in args.settings.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"flower-speed-{setting}-"))
        values = {"device": "cpu", "results-dir": str(work), "data-dir": str(Path(args.data_dir).resolve()),
                  **SETTINGS[setting]}
        if args.rounds:
            values["num-rounds"] = args.rounds
        n = values.get("num-clients", 8)
        results = {}
        if setting != "cross-device" or args.cross_device_one_per_node:
            results["flwr run, 1 client a node"] = ("one", flwr(values, n, work, "one"))
        results["flwr run, multi-client nodes (2)"] = ("multi", flwr(values, None, work, "multi"))
        if args.deployment:
            results["deployment, 2 SuperNodes (TLS)"] = ("deployed", deployment(values, work, "deployed"))
        results["in process, 2 nodes (no transport)"] = ("inprocess", in_process(values, "inprocess"))
        results["engine"] = ("engine", engine(values, "engine"))
        base = results["engine"][1]
        rounds = values.get("num-rounds", 20)
        print(f"\n## {setting}: {n} clients" + (f", {values['clients-per-round']} a round" if "clients-per-round" in
                                                   values else "") + f", {rounds} rounds")
        print(f"{'way':38s} {'whole s':>8s} {'x engine':>9s} {'s/round':>8s} {'x engine':>9s} {'beyond':>8s}"
              f" {'peak MiB':>9s}  final test accuracy  model == engine")
        for label, (name, r) in results.items():
            same = same_model(work, name, "engine")
            acc = r["rows"][-1].get("test-accuracy")
            print(f"{label:38s} {r['whole']:8.1f} {r['whole'] / base['whole']:9.2f} {r['round']:8.3f} "
                  f"{r['round'] / base['round']:9.2f} {r['round'] - base['round']:8.3f} {r['peak'] / 2**20:9.0f}"
                  f"  {acc if acc is None else f'{acc:.4f}':>19}  {same}")
        print("beyond: seconds a round beyond the engine's (Flower's polling floor in 1.42: ~0.2 s)")


if __name__ == "__main__":
    main()
