"""Single-machine clipped SGD: one client, the paper's single-machine baseline.

Clipped SGD of Zhang et al. (ICLR 2020) on one machine, as Liu et al. (NeurIPS 2022,
https://arxiv.org/abs/2205.05040) run it for comparison: ``num-clients = 1``, nothing to
average; a round only groups I steps (so results rows, evaluation and checkpoints come every
I steps). Its steps are CELGC's, and so is its displacement bound.
"""

from __future__ import annotations

from typing import Any

from .celgc import CELGC


class SingleMachine(CELGC):
    """Clipped SGD on one client; a round groups I steps."""

    name = "single"
    paper = "Zhang, He, Sra, Jadbabaie, ICLR 2020 (clipped SGD), the single-machine baseline of arXiv 2205.05040"

    @classmethod
    def config_problems(cls, cfg: Any) -> list[str]:
        out = []
        if cfg.num_clients not in (0, 1):
            out.append(f"num-clients must be 1 for algorithm 'single' (one machine), got {cfg.num_clients}")
        if cfg.clients_per_round not in (0, 1):
            out.append(f"clients-per-round must be 0 for algorithm 'single', got {cfg.clients_per_round}")
        return out

    @classmethod
    def label(cls, local_steps: int | str) -> str:
        return "single machine"

    def summary(self) -> list[str]:
        return [f"single-machine clipped SGD: one client, a round groups I = {self.hyper.local_steps} steps"]
