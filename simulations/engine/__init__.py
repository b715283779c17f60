"""The fast engine: the paper's methods without Flower messaging, as close to the hardware
as we can get, on one device, many GPUs or many hosts (``torchrun``).

A driver of the algorithm layer, not a second implementation of any method: each round it
runs the method's server side (``strategies.methods.algorithm``: a generator of exchanges) and hands
every exchange to the method's client side on its executors (``strategies.methods.executors``:
clients one after another, or stacked with ``torch.func.vmap``); the averages are ONE flat
all-reduce per exchange across processes (``strategies.methods.reduce``). Its code names no method.

Files:

* ``run.py`` -- the round loop, results (``tasks.runs``) and the CLI (``python -m simulations.engine``);
* ``distributed.py`` -- process group, balanced sharding of clients, the one all-reduce;
* ``progress.py`` -- the per-round progress display (rich).

Nothing here imports flwr, ``server`` or ``client`` (an import contract checks it).
"""

from strategies.methods.executors.options import EngineOptions

from .run import Engine, EngineResult, run_engine

__all__ = ["Engine", "EngineOptions", "EngineResult", "run_engine"]
