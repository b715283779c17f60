"""Executors: how a backend runs its clients' local work (pure PyTorch, no flwr).

* ``sequential.py`` -- one ``nn.Module`` per client, one after another (one CUDA stream each);
  any model; what this project's ClientApp runs for its client;
* ``vectorised.py`` -- the clients stacked and stepped together with ``torch.func.vmap``
  (bf16 autocast, channels-last, CUDA graphs as switches);
* ``group.py`` -- ``ClientGroup``: an executor's clients in one exchange, their batches and
  their kept state: what a method's client side works on;
* ``options.py``, ``choose.py`` -- the ``engine-*`` switches and the one choice of the path
  (the engine's processes and a multi-client SuperNode alike).
"""

from .choose import choose_executor
from .group import ClientGroup
from .options import EngineOptions
from .sequential import SequentialClients
from .vectorised import VmapClients

__all__ = ["ClientGroup", "EngineOptions", "SequentialClients", "VmapClients", "choose_executor"]
