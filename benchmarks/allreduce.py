"""Averaging cost: ONE flat all-reduce versus one collective per parameter tensor.

Claim under test (issue 4): at the end of a round the engine sums its clients' parameters and
one flattened all-reduce produces the average; the paper's code instead does a reduce to rank
0 and a broadcast per parameter tensor. Measured side by side, in one run, on ResNet-56-shaped
tensors (every tensor of the model's state: 0.85M parameters plus BatchNorm statistics, 332
tensors of which 277 floating-point) with K gloo processes on the CPU (default 4, on 127.0.0.1):

* reduce + broadcast per tensor   -- the paper's scheme (2 collectives x 277 tensors);
* all-reduce per tensor           -- 277 collectives;
* one flat all-reduce, fp32       -- flatten, 1 collective, unflatten;
* one flat all-reduce, fp64       -- what the engine sends (float64 sums + metric sums).

    python benchmarks/allreduce.py [--procs 4] [--repeats 20]

Times are the best and the median of --repeats rounds (each after a barrier), as seen by rank 0.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def resnet56_state_shapes() -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of ResNet-56's state dict (3 stages x 9 basic blocks, option A)."""
    try:
        from tasks.resnet import resnet56

        return [(tuple(v.shape), v.dtype) for v in resnet56().state_dict().values()]
    except ImportError:  # the shapes by construction (same list)
        out: list[tuple[tuple[int, ...], torch.dtype]] = []

        def bn(c: int) -> None:
            out.extend([((c,), torch.float32)] * 4 + [((), torch.int64)])

        out.append(((16, 3, 3, 3), torch.float32))
        bn(16)
        cin = 16
        for planes in (16, 32, 64):
            for _ in range(9):
                out.append(((planes, cin, 3, 3), torch.float32))
                bn(planes)
                out.append(((planes, planes, 3, 3), torch.float32))
                bn(planes)
                cin = planes
        out += [((10, 64), torch.float32), ((10,), torch.float32)]
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, size: int, port: int, repeats: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    gen = torch.Generator().manual_seed(rank)
    shapes = resnet56_state_shapes()
    tensors = [torch.randn(s, generator=gen) if d.is_floating_point else torch.full(s, rank, dtype=d)
               for s, d in shapes]
    floats = [t for t in tensors if t.is_floating_point()]

    def reduce_broadcast() -> None:  # the paper's per-tensor scheme
        for t in floats:
            dist.reduce(t, dst=0)
            if rank == 0:
                t.div_(size)
            dist.broadcast(t, src=0)

    def allreduce_each() -> None:
        for t in floats:
            dist.all_reduce(t)
            t.div_(size)

    def flat(dtype: torch.dtype):
        def run() -> None:
            vec = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
            dist.all_reduce(vec)
            vec.div_(size)
            offset = 0
            for t in tensors:
                n = t.numel()
                t.copy_(vec[offset : offset + n].view(t.shape).round() if not t.is_floating_point()
                        else vec[offset : offset + n].view(t.shape))
                offset += n
        return run

    methods = [("reduce + broadcast per tensor (paper)", reduce_broadcast),
               ("all-reduce per tensor", allreduce_each),
               ("one flat all-reduce, fp32", flat(torch.float32)),
               ("one flat all-reduce, fp64 (engine)", flat(torch.float64))]
    times: dict[str, list[float]] = {name: [] for name, _ in methods}
    for rep in range(repeats + 1):
        for name, fn in methods:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if rep:
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        out.put((times, len(tensors), len(floats), sum(t.numel() for t in tensors)))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.procs, port, args.repeats, out)) for r in range(args.procs)]
    for proc in procs:
        proc.start()
    times, n_tensors, n_float, numel = out.get(timeout=600)
    for proc in procs:
        proc.join(timeout=60)
    print(f"# {args.procs} gloo processes on {os.cpu_count()} CPU cores, ResNet-56 state: {n_tensors} tensors "
          f"({n_float} floating), {numel:,} numbers; torch {torch.__version__}")
    base = min(times["reduce + broadcast per tensor (paper)"])
    print(f"{'method':40s} {'best s':>9s} {'median s':>9s} {'speed-up':>9s}")
    for name, ts in times.items():
        print(f"{name:40s} {min(ts):9.4f} {statistics.median(ts):9.4f} {base / min(ts):8.1f}x")


if __name__ == "__main__":
    main()
