"""Models of the paper's size on every path: seconds a round, MB/s of model bytes, memory, model == engine.

For each setting, in one invocation and side by side:

* ``engine`` -- ``python -m simulations.engine`` (one torch thread: a deployed node's share of
  this machine, so that every path's model can be compared with it bit for bit);
* ``flwr run`` -- the wrapper (``simulations.flower``): a real simulation, Flower's 2 SuperNodes;
* ``deployed`` -- a TLS deployment on loopback with 2 authenticated SuperNodes, this project's
  warm ClientApp runner and packed messages (``server/deploy/*.sh`` defaults);
* ``deployed, Flower's stock isolation`` -- the same with ``--isolation subprocess`` (a new
  ``flwr-clientapp`` process per message);
* ``plain Flower FedAvg`` -- Flower's own FedAvg and a plain ClientApp (``benchmarks/plain_fedavg``)
  with a model of the same size and arrays, deployed alike (stock isolation); each of its 2 nodes
  trains once a round for the local steps of the clients it stands for (the natural plain-Flower
  way to run 2 hosts: 2 models down and 2 up a round);
* ``gRPC + TLS reference`` -- the round's model bytes through grpcio on loopback, no Flower
  (``benchmarks/grpc_reference.py``): the practical limit of this machine.

Columns: ``s/round`` (rounds 2.. of the results rows' training clock; the plain app stamps its
own rounds); ``beyond`` -- seconds a round beyond the engine's; ``MB/s`` -- the round's model
bytes (N clients x model x 2 ways, what a round moves logically) over ``beyond``; for the
deployed ways also ``beyond training`` (the round minus its longest node's training, from time
stamps: the message path alone, whatever parallelism the nodes' training had) and its MB/s; the
peak resident memory of every kind of process (the largest one process reached) and its CPU
seconds; ``model == engine`` (bit for bit). Results go to ``--out`` as JSON (``plot`` draws the
curves of several runs).

    python benchmarks/message_path.py --settings mlp85,awd-lstm --rounds 6
    python benchmarks/message_path.py --settings digits,resnet56,awd-lstm --out docs/figures/message-path
    python benchmarks/message_path.py --nodes 2,4,8,16 --settings resnet56 --ways deployed,plain --netns
    python benchmarks/message_path.py plot docs/figures/message-path

Synthetic data (``benchmarks.paper_size``) unless the data sets are in ``--data-dir``: speed only.
The load before and after and the CPU time other processes took are printed; a measurement that
shared the machine says so loudly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import flower_speed as fs  # noqa: E402
from benchmarks import grpc_reference  # noqa: E402

#: per setting: the run config (one torch thread everywhere), the plain app's model, what it is
SETTINGS: dict[str, dict] = {
    "digits": {"config": {"task": "digits", "num-clients": 8, "local-steps": 2},
               "plain": "digits-cnn", "label": "digits CNN (27k parameters)"},
    "resnet56": {"config": {"task": "benchmarks.paper_size:resnet56", "num-clients": 8, "local-steps": 2,
                            "batch-size": 16, "lr": 0.1, "clip": 1.0, "weight-decay": 5e-4},
                 "plain": "resnet56", "label": "ResNet-56 (0.85M parameters, 3.4 MB)"},
    "awd-lstm": {"config": {"task": "benchmarks.paper_size:awd_lstm", "num-clients": 8, "local-steps": 2,
                            "batch-size": 3, "lr": 30.0, "clip": 7.5, "weight-decay": 1.2e-6},
                 "plain": "awd-lstm", "label": "AWD-LSTM, PTB sizes (24M parameters, 97 MB)"},
    "mlp85": {"config": {"task": "benchmarks.paper_size:mlp85", "num-clients": 2, "local-steps": 2},
              "plain": "mlp85", "label": "a user's MLP 64-4096-4096-1024-10 (21M parameters, 85 MB)"},
}
WAYS = ("engine", "flwr", "deployed", "sums", "bf16", "sums-bf16", "stock", "plain", "grpc")
LABELS = {"engine": "engine", "flwr": "flwr run (2 SuperNodes)", "deployed": "deployed (ours: warm runner, packed)",
          "sums": "deployed, node-aggregation", "bf16": "deployed, transport bfloat16 (lossy)",
          "sums-bf16": "deployed, node-aggregation + bfloat16 (lossy)",
          "stock": "deployed, Flower's stock isolation", "plain": "plain Flower FedAvg, deployed",
          "grpc": "gRPC + TLS reference (no Flower)"}
#: the deployed variants with this project's options (run-config keys)
OPTIONS = {"sums": {"node-aggregation": True}, "bf16": {"transport": "bfloat16"},
           "sums-bf16": {"node-aggregation": True, "transport": "bfloat16"}}


def model_bytes(task: str, data_dir: str) -> tuple[int, int]:
    """(bytes, parameters) of the setting's model in float32 (its state dict)."""
    from tasks import initial_model, load_task
    from tasks.config import RunConfig

    model = initial_model(load_task(RunConfig.from_mapping({"task": task, "data-dir": data_dir})), 0)
    state = model.state_dict()
    return (sum(v.numel() * v.element_size() for v in state.values()),
            sum(p.numel() for p in model.parameters()))


def model_difference(a: Path, b: Path) -> dict[str, float]:
    """How far two runs' final models are apart: the largest absolute difference and float32 ulps."""
    x = torch.load(a / "model.pt", weights_only=True)
    y = torch.load(b / "model.pt", weights_only=True)
    out = {"max abs": 0.0, "max ulps": 0, "entries differing": 0, "entries": 0}
    for k, v in x.items():
        out["entries"] += v.numel()
        if v.dtype == torch.float32:
            ulps = (v.view(torch.int32).long() - y[k].view(torch.int32).long()).abs()
            out["max ulps"] = max(out["max ulps"], int(ulps.max()) if v.numel() else 0)
            out["entries differing"] += int((ulps > 0).sum())
        if v.is_floating_point() and v.numel():
            out["max abs"] = max(out["max abs"], float((v - y[k]).abs().max()))
    return out


def train_seconds(marks: list[dict]) -> float:
    """Mean over rounds 2.. of the longest training of a node (train-start -> train-end stamps); a
    round starts at the server's push (this project's apps) or at the end of the previous round
    (the plain app's round stamps)."""
    starts = [m["t"] for m in marks if m.get("event") == "push"] or \
        [m["t"] for m in marks if "round" in m and "event" not in m]
    longest = []
    for start, end in zip(starts[1:], starts[2:] + [float("inf")], strict=True):
        by_pid: dict[int, list[float]] = {}
        for m in marks:
            if start <= m["t"] < end and m.get("event") in ("train-start", "train-end"):
                by_pid.setdefault(m["pid"], []).append(m["t"])
        spans = [max(ts) - min(ts) for ts in by_pid.values() if len(ts) >= 2]
        if spans:
            longest.append(max(spans))
    return sum(longest) / len(longest) if longest else float("nan")


def run_setting(name: str, args: argparse.Namespace, nodes: int) -> dict:
    setting = SETTINGS[name]
    work = Path(tempfile.mkdtemp(prefix=f"message-path-{name}-"))
    values = {"device": "cpu", "results-dir": str(work), "data-dir": str(Path(args.data_dir).resolve()),
              "num-rounds": args.rounds, "eval-every": 10_000, "checkpoint-every": 0, **setting["config"]}
    if args.clients:
        values["num-clients"] = args.clients
    n = values["num-clients"]
    nbytes, params = model_bytes(values["task"], values["data-dir"])
    per_round = 2 * n * nbytes
    out: dict = {"setting": name, "label": setting["label"], "model-bytes": nbytes, "parameters": params,
                 "num-clients": n, "local-steps": values["local-steps"], "nodes": nodes, "rounds": args.rounds,
                 "bytes-per-round": per_round, "netns": args.netns, "ways": {}}
    ways = [w for w in WAYS if w in args.ways.split(",")]
    results = {}
    if "engine" in ways or len(ways) > 1:
        results["engine"] = fs.engine(values, "engine", threads=1)
    if "flwr" in ways:
        results["flwr"] = fs.flwr(values, nodes, work, "flwr")
    if "deployed" in ways:
        results["deployed"] = fs.deployment(values, work, "deployed", nodes=nodes, netns=args.netns)
    for way, options in OPTIONS.items():
        if way in ways:
            results[way] = fs.deployment({**values, **options}, work, way, nodes=nodes, netns=args.netns)
    if "stock" in ways:
        results["stock"] = fs.deployment(values, work, "stock", nodes=nodes, isolation="subprocess", netns=args.netns)
    if "plain" in ways:
        plain = {"model": setting["plain"], "local-steps": values["local-steps"] * n // nodes,
                 "batch-size": values.get("batch-size", 32), "lr": 0.05}
        results["plain"] = fs.deployment(values, work, "plain", nodes=nodes, isolation="subprocess", netns=args.netns,
                                         app=fs.PLAIN_APP, plain=plain)
    if "grpc" in ways:
        ref = grpc_reference.measure(nbytes, n, repeat=2)
        results["grpc"] = {"round": ref["seconds"], "grpc": True}
    base = results.get("engine")
    for way, r in results.items():
        row: dict = {"label": LABELS[way], "s/round": r["round"]}
        if way == "grpc":
            row.update({"beyond": r["round"], "MB/s": per_round / r["round"] / 1e6})
        elif base is not None:
            beyond = r["round"] - base["round"]
            row.update({"beyond": beyond, "MB/s": per_round / beyond / 1e6 if beyond > 0 else float("inf")})
        if "marks" in r:
            train = train_seconds(r["marks"])
            row.update({"train": train, "beyond training": r["round"] - train,
                        "MB/s beyond training": per_round / (r["round"] - train) / 1e6})
        if "first" in r:
            row["first round"] = r["first"]
        if r.get("parts"):
            row["parts"] = r["parts"]
        if r.get("roles"):
            row["processes"] = r["roles"]
        if way in ("flwr", "deployed", "stock", *OPTIONS) and base is not None:
            row["model == engine"] = fs.same_model(work, way, "engine")
            if not row["model == engine"]:
                row["model difference"] = model_difference(work / way, work / "engine")
        if r.get("rows"):
            row["bytes-sent"] = r["rows"][-1].get("bytes-sent")
        out["ways"][way] = row
    return out


def show(result: dict) -> None:
    mb = result["model-bytes"] / 1e6
    print(f"\n## {result['label']}: {result['num-clients']} clients on {result['nodes']} SuperNodes"
          f"{' (network namespaces)' if result['netns'] else ''}, I = {result['local-steps']}, "
          f"{result['rounds']} rounds; {mb:.1f} MB a model, {result['bytes-per-round'] / 1e6:.0f} MB of model bytes "
          "a round (N x model x 2 ways)")
    print(f"{'way':40s} {'s/round':>8s} {'beyond':>7s} {'MB/s':>6s} {'beyond training':>16s} {'MB/s':>6s}"
          "  model == engine")
    for row in result["ways"].values():
        def f(key: str, fmt: str, row: dict = row) -> str:
            v = row.get(key)
            return "-" if v is None or v != v else format(v, fmt)
        print(f"{row['label']:40s} {f('s/round', '8.2f')} {f('beyond', '7.2f')} {f('MB/s', '6.0f')} "
              f"{f('beyond training', '16.2f')} {f('MB/s beyond training', '6.0f')}  {row.get('model == engine', '-')}"
              + (" (max |difference| {max abs:.2g}, {entries differing} of {entries} entries)".format(**row["model difference"])
                 if row.get("model difference") else ""))
    print("peak resident memory (MiB, the largest process of its kind) and CPU seconds of the whole run:")
    for row in result["ways"].values():
        if row.get("processes"):
            parts = ", ".join(f"{role} {v['peak MiB']:.0f} MiB x{v['processes']} ({v['cpu s']:.0f} s)"
                              for role, v in row["processes"].items() if not role.startswith("other"))
            print(f"  {row['label']}: {parts}")
    for row in result["ways"].values():
        if row.get("parts"):
            print(f"  {row['label']}, mean seconds a round: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in row["parts"].items()))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plot":
        from benchmarks.message_path_plot import plot

        plot(Path(argv[1]) if len(argv) > 1 else ROOT / "docs" / "figures" / "message-path")
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default="mlp85,awd-lstm", help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    p.add_argument("--rounds", type=int, default=6, help="rounds of every run (>= 3: rounds 2.. are timed)")
    p.add_argument("--nodes", default="2", help="SuperNodes (comma-separated for a sweep, e.g. 2,4,8,16)")
    p.add_argument("--clients", type=int, default=0, help="override num-clients (0: the setting's)")
    p.add_argument("--netns", action="store_true", help="deployments across network namespaces (root)")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--out", help="folder for the JSON results (one file per setting and node count)")
    args = p.parse_args(argv)
    bad = [s for s in args.settings.split(",") if s not in SETTINGS] + [w for w in args.ways.split(",") if w not in WAYS]
    if bad:
        p.error(f"unknown setting(s) or way(s) {bad}: settings {list(SETTINGS)}, ways {list(WAYS)}")
    if args.rounds < 3:
        p.error(f"--rounds must be >= 3 (rounds 2.. are timed), got {args.rounds}")
    nodes = [int(x) for x in args.nodes.split(",")]
    if any(k < 1 for k in nodes):
        p.error(f"--nodes must be integers >= 1, got {args.nodes}")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    os.environ["OMP_NUM_THREADS"] = "1"  # one torch thread in every process: the engine's models compare bit for bit
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
          f"{'no GPU' if not torch.cuda.is_available() else torch.cuda.get_device_name(0)}; command: "
          f"python benchmarks/message_path.py {' '.join(argv)}")
    for name in args.settings.split(","):
        for k in nodes:
            with fs.MachineLoad() as load:
                result = run_setting(name, args, k)
            show(result)
            print(load.report())
            result["load"] = load.report()
            if args.out:
                folder = Path(args.out)
                folder.mkdir(parents=True, exist_ok=True)
                result["date"] = time.strftime("%Y-%m-%d %H:%M")
                result["command"] = "python benchmarks/message_path.py " + " ".join(argv)
                (folder / f"{name}-{k}nodes{'-netns' if args.netns else ''}.json").write_text(
                    json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
