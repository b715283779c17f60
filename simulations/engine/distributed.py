"""Processes of the engine: the process group, which clients a process runs, one all-reduce.

One process per device (``torchrun --nproc-per-node=K``; several hosts through torchrun's
rendezvous). Every process holds the same global model; it runs its own contiguous block of
clients and, at the end of a round, adds one flat float64 vector (its clients' weighted
parameter sums and metric sums) into the others' with ONE ``all_reduce``. Backend: NCCL when
the engine runs on CUDA, gloo on the CPU. Without torchrun's variables the engine is one
process and no process group is created.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class World:
    """Where this process stands: ``rank`` of ``size`` processes, ``local_rank`` on its host."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def env_world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"RANK={rank} and WORLD_SIZE={size} from the environment are inconsistent")
    return rank, size, local


def init_world(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> World:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU), or stay a single process."""
    rank, size, local = env_world()
    if size == 1:
        return World()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", local)
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s), **kwargs)
    return World(rank=rank, size=size, local_rank=local, backend=backend)


def close_world(world: World) -> None:
    """Tear the group down together: a barrier first, so no process destroys its gloo
    context while a peer still uses it (seen as 'terminate called without an active
    exception', SIGABRT, at exit on a loaded 2-core machine)."""
    if world.distributed and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def shard(num_clients: int, world_size: int, rank: int) -> range:
    """The clients (partition ids) of process ``rank``: balanced contiguous blocks.

    Sizes differ by at most one, the first ``num_clients % world_size`` processes taking
    one more (N=8, K=3 -> 3/3/2). More processes than clients is an error: every process
    must run at least one client.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size - 1}], got {rank}")
    if world_size > num_clients:
        raise ValueError(
            f"{world_size} processes but only {num_clients} clients (num-clients={num_clients}): every process needs "
            f"at least one client; start at most {num_clients} processes (torchrun --nproc-per-node) or raise num-clients"
        )
    base, extra = divmod(num_clients, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def all_reduce_sum(flat: Tensor, world: World) -> Tensor:
    """Sum ``flat`` over all processes in place (one collective); a no-op for one process."""
    if world.distributed:
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return flat


def gather_mappings(mapping: dict[str, Tensor], world: World) -> dict[str, Tensor]:
    """The union of every process's ``mapping`` (disjoint keys, on CPU): what process 0 checkpoints of
    the server state each process keeps for its own clients. The identity on one process."""
    if not world.distributed:
        return mapping
    parts: list[Any] = [None] * world.size
    dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in mapping.items()})
    out: dict[str, Tensor] = {}
    for part in parts:
        out.update(part)
    return out
