"""The fast engine: the paper's algorithms without Flower messaging, as close to the hardware
as we can get, on one device, many GPUs or many hosts (``torchrun``).

Files:

* ``run.py`` -- the round loop, results and the CLI (``python -m simulations.engine``);
* ``vectorised.py`` -- clients stacked and stepped together with ``torch.func.vmap``
  (bf16 autocast, channels-last, CUDA-graph capture as switches);
* ``sequential.py`` -- one module per client (models vmap cannot take, e.g. ``nn.LSTM``),
  on one CUDA stream per client;
* ``distributed.py`` -- process group, balanced sharding of clients, the one all-reduce;
* ``aggregate.py`` -- clients' states and metrics -> one flat vector -> the average;
* ``options.py`` -- the ``engine-*`` switches and the ``--run-config`` parser;
* ``progress.py`` -- the per-round progress display (rich).

The math is the Flower path's own (``client.update.clipped_sgd_step``, ``RoundStats``,
``strategies.averaging``, ``strategies.schedule``); nothing here imports flwr.
"""

from .options import EngineOptions
from .run import Engine, EngineResult, run_engine

__all__ = ["Engine", "EngineOptions", "EngineResult", "run_engine"]
