"""Packed messages against Flower's usual ArrayRecords: objects, bytes and seconds, side by side.

The default setting's two messages of a round -- the server's train message to a node (the
global digits CNN and the round's config) and a node's reply for its 4 clients (4 x 16 arrays
and 4 MetricRecords) -- as Flower 1.42 splits them into objects (each array and each of its
5 MiB chunks is one object, stored and sent with one authenticated request between SuperNode,
SuperLink and ServerApp), plain and packed (``strategies.flower_api.packing``): the number of
objects, their bytes, and the time to pack + unpack on this machine (median of 20).

    python benchmarks/packed_messages.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects  # noqa: E402

from strategies.flower_api.packing import pack, unpack  # noqa: E402
from tasks.digits import DigitsCNN  # noqa: E402


def messages() -> dict[str, RecordDict]:
    gen = torch.Generator().manual_seed(0)
    model = DigitsCNN().state_dict()
    down = RecordDict({"arrays": ArrayRecord(model), "config": ConfigRecord({"lr": 0.3, "clip": 0.3, "clients": [0, 2, 4, 6]})})
    up = RecordDict()
    for pid in (0, 2, 4, 6):
        up[f"arrays.{pid}"] = ArrayRecord({k: v + torch.randn(v.shape, generator=gen) if v.is_floating_point() else v + 1
                                           for k, v in model.items()})
        up[f"metrics.{pid}"] = MetricRecord({"num-examples": 256, "train-loss": 0.1 * pid, "partition-id": pid})
    return {"server -> node (train)": down, "node -> server (4 clients)": up}


def objects(content: RecordDict) -> tuple[int, int]:
    found = get_all_nested_objects(content)
    return len(found), sum(len(o.deflate()) for o in found.values())


def main() -> None:
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}")
    print(f"{'message':28s} {'objects':>8s} {'packed':>7s} {'bytes':>9s} {'packed':>9s} {'pack+unpack ms':>15s}")
    for name, content in messages().items():
        packed = pack(content)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            unpack(pack(content))
            times.append(time.perf_counter() - t0)
        (n, b), (pn, pb) = objects(content), objects(packed)
        print(f"{name:28s} {n:8d} {pn:7d} {b:9d} {pb:9d} {1e3 * statistics.median(times):15.1f}")


if __name__ == "__main__":
    main()
