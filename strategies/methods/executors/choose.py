"""Which executor runs a backend's clients: the one choice for the engine and a multi-client node.

``engine-path`` (``EngineOptions``): ``sequential`` (one module per client, one CUDA stream
each), ``vmap`` (stacked with ``torch.func.vmap``: bf16, channels-last, CUDA graphs) or
``auto``: sequential on the CPU (measured faster there than vmap's batched kernels, and
bit-identical to one client at a time), for a method whose step cannot be vectorised
(``Algorithm.vectorises``) and for a model class with ``engine_vmap = False``; otherwise one
vmapped step is probed and the model falls back to sequential when vmap cannot take it
(``nn.LSTM``, random layers). The choice comes with a note saying which path and why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...core.clipped_sgd import StepConfig
from ...core.local_update import LossFn
from .options import EngineOptions
from .sequential import SequentialClients
from .vectorised import VmapClients

log = logging.getLogger("strategies.methods.executors")


def choose_executor(build_model: Callable[[], nn.Module], train_loss: LossFn, loss: LossFn, n: int,
                    device: torch.device, options: EngineOptions, *, count: Callable[[Any], int],
                    method: Any, probe: Callable[[], tuple[list[Any], StepConfig, dict]],
                    model: nn.Module | None = None
                    ) -> tuple[SequentialClients | VmapClients, str]:
    """(the executor of ``n`` clients on ``device``, a note on the path and why). ``train_loss``:
    the task's training loss (sequential); ``loss``: its plain loss (vmap); ``method``: the
    method class or object (``vectorises``, ``name``); ``model``: one of the task's models, if at
    hand (its class may say ``engine_vmap = False``; else one is built when vmap is tried); ``probe()``: (one batch per client, a
    step's settings, the global state) for the vmap probe, called only when vmap is tried."""
    o = options
    streams = " on one CUDA stream per client" if device.type == "cuda" and o.streams else ""

    def sequential() -> SequentialClients:
        return SequentialClients(build_model, train_loss, n, device, count=count, streams=o.streams)

    if not method.vectorises:
        if o.path == "vmap":
            raise ValueError(f"engine-path=vmap does not run algorithm {method.name!r} (its local step reads values "
                             "on the host, so its clients run one after another): use engine-path=sequential or auto")
        return sequential(), f"path: sequential{streams} (algorithm {method.name} runs client by client)"
    if o.path == "sequential":
        return sequential(), f"path: sequential{streams} (engine-path=sequential)"
    if o.path == "auto" and model is not None and getattr(model, "engine_vmap", True) is False:
        return sequential(), f"path: sequential{streams} ({type(model).__name__}.engine_vmap is False)"
    if o.path == "auto" and device.type == "cpu":
        return sequential(), ("path: sequential (auto on the CPU: one client after another beats vmap's batched "
                              "kernels there and is bit-identical to the ClientApp; engine-path=vmap vectorises)")
    template = build_model().to(device)
    model = model if model is not None else template
    if o.path == "auto" and getattr(model, "engine_vmap", True) is False:
        return sequential(), f"path: sequential{streams} ({type(model).__name__}.engine_vmap is False)"
    runner = VmapClients(template, loss, n, count=count, bf16=o.bf16, channels_last=o.channels_last,
                         cuda_graphs=o.cuda_graphs, randomness=o.randomness)
    batches, step, state = probe()
    runner.load(state)
    why = runner.probe(batches, step)
    if why is None:
        flags = [flag for flag, on in (("bf16", o.bf16), ("channels-last", o.channels_last),
                                       ("cuda-graphs", o.cuda_graphs)) if on]
        return runner, f"path: vmap over {n} clients" + (f" ({', '.join(flags)})" if flags else "")
    if o.path == "vmap":
        raise RuntimeError(f"engine-path=vmap but this model cannot run under torch.func.vmap: {why}")
    if o.bf16 or o.channels_last or o.cuda_graphs:
        log.warning("engine-bf16/channels-last/cuda-graphs apply to the vmap path only; ignored")
    return sequential(), f"path: sequential{streams} (vmap cannot take {type(model).__name__}: {why})"
