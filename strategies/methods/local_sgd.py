"""Local SGD without clipping (FedAvg with I local steps): CELGC with gamma = inf.

The baseline of Liu et al. (NeurIPS 2022, https://arxiv.org/abs/2205.05040) that shows what
clipping buys: every client takes I plain SGD steps (``clip = "off"``) and the server
averages the parameters. No displacement bound holds (the steps are not clipped).
"""

from __future__ import annotations

import math

from ..core.settings import Hyper
from .celgc import CELGC


class LocalSGD(CELGC):
    """I local SGD steps per client (no clipping), parameters averaged."""

    name = "local-sgd"
    paper = "FedAvg with I local steps (McMahan et al., AISTATS 2017), the unclipped baseline of arXiv 2205.05040"
    shared_defaults = {"clip": math.inf}  # unclipped steps: clip off unless the run sets it

    @classmethod
    def problems(cls, hyper: Hyper) -> list[str]:
        return [] if not hyper.clipping else [f"clip must be \"off\" for algorithm 'local-sgd', got {hyper.clip}"]

    @classmethod
    def label(cls, local_steps: int | str) -> str:
        return f"local SGD I={local_steps} (no clipping)"

    def summary(self) -> list[str]:
        return [f"local SGD: I = {self.hyper.local_steps} unclipped local steps a round, parameters averaged"]
