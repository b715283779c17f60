"""`flwr run` against the engine, side by side in one run: whole process, seconds a round, memory.

For each setting it runs the same run config several ways and prints one table:

* ``flwr run, 1 client a node`` -- a real simulation (private SuperLink, Ray) with
  ``num-supernodes = num-clients``: one ClientApp call per client and exchange;
* ``flwr run, multi-client nodes`` -- the same with Flower's default 2 SuperNodes: each node
  serves every 2nd client with one call of its executor (``client/app.py``);
* ``deployment`` (``--deployment``) -- a real deployment on loopback (TLS, SuperNode
  authentication, ``server/deploy/*.sh`` with their defaults: SuperLink state in memory,
  SuperNodes with this project's warm ClientApp runner, ``client/warm_runner.py``, and packed
  messages): a SuperLink and 2 SuperNodes serving the clients, the run submitted with
  ``submit.sh``; the same with Flower's stock ``--isolation subprocess`` (a new
  ``flwr-clientapp`` process per message); and **plain Flower FedAvg** deployed alike (Flower's
  own FedAvg strategy and a ~30-line ClientApp on the same CNN and data,
  ``benchmarks/plain_fedavg``: no code of this project in the loop; stock isolation).
  ``--netns`` runs the deployments with the SuperLink and each SuperNode in its own network
  namespace (as root), as on separate hosts. Each round of a deployment of this project is
  split into its parts from time stamps (``tasks.runs.stamps``): the push of the messages,
  the wait until the SuperNode pulled them (Flower 1.42's SuperNode sleeps 3 s after an empty
  pull), the start of the ClientApp, training, the way back of the reply, the server's own
  work between rounds;
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
    python benchmarks/flower_speed.py --settings default --rounds 8 --deployment --only-deployment [--netns]

The load average before and after, and the CPU time other processes took during the
measurement, are printed; a run that shared the machine says so loudly (its figures are not
a result).
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
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.process_monitor import ProcessMonitor  # noqa: E402
from simulations.flower import LocalSuperLink, run_app  # noqa: E402
from simulations.flower.deploy import Deployment, Namespaces  # noqa: E402
from simulations.flower.processes import process_tree  # noqa: E402
from tasks.runs import stamps  # noqa: E402

PLAIN_APP = ROOT / "benchmarks" / "plain_fedavg"
#: every process a measurement starts carries this variable (``MachineLoad``: other work is what lacks it)
BENCH_VAR = "CELGC_BENCHMARK"

SETTINGS = {
    "default": {},
    "n32": {"num-clients": 32, "num-rounds": 10},
    "cross-device": {"task": "benchmarks.cross_device:make_task", "num-clients": 1000, "clients-per-round": 50,
                     "batch-size": 10, "local-steps": 5, "num-rounds": 5, "eval-every": 5, "checkpoint-every": 0},
}


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
        with ProcessMonitor(roots) as mem:
            run_app(ROOT, {**values, "run-name": name}, {"num-supernodes": nodes} if nodes else None, timeout=3000,
                    superlink=sl, poll_interval=0.2, fetch_log=False)
        whole = time.monotonic() - t0
    rows = rows_of(Path(values["results-dir"]) / name)
    return {"whole": whole, "round": per_round(rows), "peak": mem.peak, "rows": rows, "roles": mem.roles()}


def deployment(values: dict, work: Path, name: str, nodes: int = 2, *, isolation: str = "warm",
               netns: bool = False, app: Path = ROOT, plain: dict | None = None) -> dict:
    """A loopback (or ``netns``) deployment with TLS and authenticated SuperNodes, the scripts'
    defaults but ``isolation``; ``app``: this project, or the plain FedAvg app (its own keys, with
    ``plain``'s values: model, local-steps, batch-size, lr)."""
    is_plain = app != ROOT
    stamp_file = work / f"stamps-{name}.jsonl"
    os.environ[stamps.ENV] = str(stamp_file)  # inherited by the SuperLink, SuperNodes, runners, apps
    t0 = time.monotonic()
    hosts = Namespaces(num_clients=nodes) if netns else None
    try:
        if hosts is not None:
            hosts.__enter__()
        with Deployment(work / f"deploy-{name}", num_keys=nodes, state_file=False, netns=hosts) as d:
            d.start_superlink()
            for i in range(nodes):
                d.register(i)
                d.start_supernode(i, partition=i, num_partitions=nodes, options=["--isolation", isolation])
            config = ({"num-server-rounds": values.get("num-rounds", 20), "times-file": str(stamp_file),
                       "min-nodes": nodes, **(plain or {})} if is_plain else {**values, "run-name": name})
            with ProcessMonitor(lambda: process_tree([p.pid for p in d.procs], tag=d.tag)) as mem:
                code, out, run = d.submit(config, 3000, app=app)
            if code != 0:
                raise RuntimeError(out[-3000:])
            whole = time.monotonic() - t0
    finally:
        os.environ.pop(stamps.ENV, None)
        if hosts is not None:
            hosts.__exit__(None, None, None)
    marks = stamps.read(stamp_file)
    if is_plain:  # the ServerApp's stamps: round 0 (before round 1), then the end of every round
        clock = [m["t"] for m in marks if "round" in m and "event" not in m]
        return {"whole": whole, "round": steady(clock), "first": clock[1] - clock[0], "peak": mem.peak, "rows": [],
                "roles": mem.roles(), "marks": marks}
    rows = rows_of(Path(values["results-dir"]) / name)
    clock = [r["wall-clock"] for r in rows]
    return {"whole": whole, "round": steady(clock), "first": clock[1] - clock[0], "peak": mem.peak, "rows": rows,
            "parts": round_parts(marks), "roles": mem.roles(), "marks": marks}


def steady(clock: list[float]) -> float:
    """Seconds a round from the end of round 1 to the end of the last (``clock[0]``: round 0):
    the first round's one-off costs (a worker's fork and the app's import) left out."""
    return (clock[-1] - clock[1]) / max(len(clock) - 2, 1)


PARTS = ("push", "to the SuperNode (Flower's idle pull, <= 3 s)", "ClientApp start", "train",
         "reply back to the server", "server between rounds", "round")


def round_parts(marks: list[dict]) -> dict[str, float]:
    """Mean seconds of each part of a round (rounds 2.. of one train exchange each), from the
    stamps: push -> pushed (the server's push), pushed -> acquired (the SuperNode pulls the
    message; the warm runner's poll adds <= 0.05 s), acquired -> train-start (the task's input
    and message pulled from the SuperNode, the app looked up), train-start -> train-end, train-end
    -> reply at the server (k-th end paired with the k-th reply), last reply -> next push.
    Under Flower's stock isolation there is no ``acquired`` (Flower's SuperNode pull is not
    stamped), so "ClientApp start" runs from ``pushed`` and holds the pull as well."""
    pushes = [m for m in marks if m["event"] == "push"]
    out: dict[str, list[float]] = {k: [] for k in PARTS}
    for r, (push, nxt) in enumerate(zip(pushes, pushes[1:] + [None], strict=True)):
        if r == 0 or nxt is None:
            continue
        window = [m for m in marks if push["t"] <= m["t"] < nxt["t"]]
        by = {e: [m["t"] for m in window if m["event"] == e] for e in
              ("pushed", "acquired", "train-start", "train-end", "reply")}
        if not (by["pushed"] and by["train-start"] and by["reply"]):
            continue
        pushed = by["pushed"][0]
        out["push"].append(pushed - push["t"])
        starts, ends, replies = by["train-start"], by["train-end"], by["reply"]
        if by["acquired"]:
            acq = by["acquired"]
            out["to the SuperNode (Flower's idle pull, <= 3 s)"].append(sum(acq) / len(acq) - pushed)
            out["ClientApp start"].append(sum(s - a for s, a in zip(sorted(starts), sorted(acq))) / len(starts))
        else:
            out["ClientApp start"].append(sum(starts) / len(starts) - pushed)
        out["train"].append(sum(e - s for s, e in zip(sorted(starts), sorted(ends))) / len(ends))
        out["reply back to the server"].append(sum(b - e for e, b in zip(sorted(ends), sorted(replies))) / len(replies))
        out["server between rounds"].append(nxt["t"] - max(replies))
        out["round"].append(nxt["t"] - push["t"])
    return {k: sum(v) / len(v) for k, v in out.items() if v}


class MachineLoad:
    """The load average before and after, and the CPU seconds that other processes took while the
    measurement ran: those already running before it, and those started during it by others (a
    process is the benchmark's own when it carries ``BENCH_VAR`` in its environment, which every
    process the benchmark starts inherits, daemons included); sampled every 2 s, so a process that
    started and ended between two samples is missed. The figure that says whether other work
    competed (the 1-minute load average lags work that just ended)."""

    def __enter__(self) -> MachineLoad:
        self.mark = f"{BENCH_VAR}={uuid.uuid4().hex}"
        os.environ[BENCH_VAR] = self.mark.split("=", 1)[1]
        self.before = os.getloadavg()
        self.t0 = time.monotonic()
        self.first = {p: t for p, (t, _) in self._ticks().items()}
        self.last: dict[int, tuple[int, str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while True:
            for pid, (ticks, cmd) in self._ticks().items():
                if pid in self.last or self._theirs(pid):
                    self.last[pid] = (ticks, cmd)
            if self._stop.wait(2.0):
                return

    def _theirs(self, pid: int) -> bool:
        """Not the benchmark's: no mark in its environment (unreadable: counted as theirs)."""
        if pid == os.getpid():
            return False
        try:
            return self.mark.encode() not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.after, self.elapsed = os.getloadavg(), time.monotonic() - self.t0
        os.environ.pop(BENCH_VAR, None)
        hz = os.sysconf("SC_CLK_TCK")
        self.others = sorted(((t - self.first.get(p, 0)) / hz, cmd, p) for p, (t, cmd) in self.last.items()
                             if t > self.first.get(p, 0))[::-1]

    @staticmethod
    def _ticks() -> dict[int, tuple[int, str]]:
        out = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                    cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80]
                except (OSError, IndexError):
                    continue
                out[int(entry.name)] = (int(fields[11]) + int(fields[12]), cmd)
        return out

    def report(self) -> str:
        cpu = sum(s for s, _, _ in self.others)
        lines = [f"# load average before {self.before[0]:.2f}, after {self.after[0]:.2f} (1 min); other processes "
                 f"took {cpu:.1f} CPU s of the {self.elapsed:.0f} s measured"]
        if cpu > 0.05 * self.elapsed:  # others took > 5 % of a core (the load average lags: a number only)
            lines.append("# " + "!" * 78)
            lines.append("# WARNING: OTHER WORK COMPETED FOR THE CPU DURING THIS MEASUREMENT: THE FIGURES ARE NOT A RESULT")
            lines += [f"#   {s:7.1f} CPU s  pid {p}  {cmd}" for s, cmd, p in self.others[:8]]
            lines.append("# " + "!" * 78)
        else:
            lines.append(f"# the machine was quiet: other processes took {100 * cpu / self.elapsed:.1f} % of one core "
                         "(a warning above 5 %)")
        return "\n".join(lines)


def in_process(values: dict, name: str, nodes: int = 2) -> dict:
    """This project's ServerApp and ClientApp objects in one process (``simulations.loopback``):
    every message of the round, its checks and the nodes' executors, without Flower's transport."""
    code = ("import json, sys; from simulations.loopback import run_in_process; "
            "run_in_process(json.loads(sys.argv[1]), int(sys.argv[2]))")
    return timed([sys.executable, "-c", code, json.dumps({**values, "run-name": name}), str(nodes)], values, name)


def engine(values: dict, name: str, threads: int | None = None) -> dict:
    """``threads``: torch threads of the engine (a deployed ClientApp's share of the host, to
    compare the models bit for bit: results depend on the thread count)."""
    overrides = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in {**values, "run-name": name}.items())
    return timed([sys.executable, "-m", "simulations.engine", "--quiet", "--config", "pyproject.toml",
                  "--run-config", overrides], values, name, {"OMP_NUM_THREADS": str(threads)} if threads else {})


def timed(cmd: list[str], values: dict, name: str, env: dict | None = None) -> dict:
    """One process of ``cmd``: whole seconds, s/round from its rows, peak memory."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with ProcessMonitor(lambda: [proc.pid]) as mem:
        _, err = proc.communicate()
    whole = time.monotonic() - t0
    if proc.returncode:
        raise RuntimeError(err.decode()[-3000:])
    rows = rows_of(Path(values["results-dir"]) / name)
    return {"whole": whole, "round": per_round(rows), "peak": mem.peak, "rows": rows, "roles": mem.roles()}


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
                   help="also run loopback deployments (TLS, 2 SuperNodes; needs openssl): warm + packed (the "
                        "default), Flower's stock isolation, and plain Flower FedAvg")
    p.add_argument("--only-deployment", action="store_true", help="with --deployment: leave out the flwr run and "
                   "in-process ways (the engine stays: the reference)")
    p.add_argument("--netns", action="store_true", help="deployments across network namespaces (root)")
    p.add_argument("--cross-device-one-per-node", action="store_true",
                   help="also run the cross-device setting with 1,000 SuperNodes (slow)")
    args = p.parse_args()
    if args.rounds and args.deployment and args.rounds < 3:
        p.error("--deployment needs --rounds >= 3 (rounds 2.. are the steady state)")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPU cores, torch {torch.__version__}, no GPU"
          if not torch.cuda.is_available() else f"# {time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name(0)}")
    with MachineLoad() as load:
        for setting in args.settings.split(","):
            run_setting(setting, args)
    print(load.report())


def run_setting(setting: str, args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"flower-speed-{setting}-"))
    values = {"device": "cpu", "results-dir": str(work), "data-dir": str(Path(args.data_dir).resolve()),
              **SETTINGS[setting]}
    if args.rounds:
        values["num-rounds"] = args.rounds
    n = values.get("num-clients", 8)
    where = " across network namespaces" if args.netns else ""
    results = {}
    if not args.only_deployment:
        if setting != "cross-device" or args.cross_device_one_per_node:
            results["flwr run, 1 client a node"] = ("one", flwr(values, n, work, "one"))
        results["flwr run, multi-client nodes (2)"] = ("multi", flwr(values, None, work, "multi"))
    if args.deployment:
        results[f"deployed{where}: warm runner + packed"] = ("deployed", deployment(values, work, "deployed",
                                                                                    netns=args.netns))
        results[f"deployed{where}: Flower's subprocess isolation"] = (
            "stock", deployment(values, work, "stock", isolation="subprocess", netns=args.netns))
        if setting == "default":
            results[f"plain Flower FedAvg deployed{where}"] = (
                None, deployment(values, work, "plain", isolation="subprocess", netns=args.netns, app=PLAIN_APP))
    if not args.only_deployment:
        results["in process, 2 nodes (no transport)"] = ("inprocess", in_process(values, "inprocess"))
    # with deployments: the engine at a deployed ClientApp's threads (2 SuperNodes share the host: start_supernode.sh
    # --threads auto), so that the models compare bit for bit
    threads = max(1, (os.cpu_count() or 1) // 2) if args.deployment else None
    results["engine" + (f" ({threads} torch thread{'s' * (threads > 1)})" if threads else "")] = (
        "engine", engine(values, "engine", threads))
    base = next(r for name, r in results.values() if name == "engine")
    rounds = values.get("num-rounds", 20)
    print(f"\n## {setting}: {n} clients" + (f", {values['clients-per-round']} a round" if "clients-per-round" in
                                               values else "") + f", {rounds} rounds")
    steady_note = " (deployments: rounds 2..)" if args.deployment else ""
    print(f"{'way':50s} {'whole s':>8s} {'x engine':>9s} {'s/round':>8s} {'x engine':>9s} {'beyond':>8s}"
          f" {'peak MiB':>9s}  final test accuracy  model == engine")
    for label, (name, r) in results.items():
        same = same_model(work, name, "engine") if name else "n/a"
        acc = r["rows"][-1].get("test-accuracy") if r["rows"] else None
        print(f"{label:50s} {r['whole']:8.1f} {r['whole'] / base['whole']:9.2f} {r['round']:8.3f} "
              f"{r['round'] / base['round']:9.2f} {r['round'] - base['round']:8.3f} {r['peak'] / 2**20:9.0f}"
              f"  {'-' if acc is None else f'{acc:.4f}':>19}  {same}")
    print(f"s/round{steady_note}: the results rows' training clock; beyond: seconds a round beyond the engine's")
    plain = next((r for label, (name, r) in results.items() if name is None), None)
    if plain is not None:
        for label, (name, r) in results.items():
            if name in ("deployed", "stock"):
                print(f"{label}: {r['round'] / plain['round']:.2f} x plain Flower FedAvg's s/round "
                      f"(first round {r['first']:.1f} s; plain's {plain['first']:.1f} s)")
    for label, (_, r) in results.items():
        if r.get("parts"):
            print(f"\n{label}, mean seconds a round (rounds 2..; nodes overlap, so parts need not add up):")
            for part, sec in r["parts"].items():
                print(f"  {part:48s} {sec:7.3f}")


if __name__ == "__main__":
    main()
