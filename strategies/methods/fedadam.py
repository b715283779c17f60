"""FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2): Adam on the
server, v_t = beta_2 v_{t-1} + (1 - beta_2) Delta_t^2, no bias correction (``fedopt.AdaptiveFedOpt``)."""

from __future__ import annotations

from torch import Tensor

from .fedopt import AdaptiveFedOpt


class FedAdam(AdaptiveFedOpt):
    """FedAvg's local steps; the server steps with Adam on the averaged update."""

    name = "fedadam"
    paper = "Reddi et al., ICLR 2021, https://arxiv.org/abs/2003.00295 (Algorithm 2, FedAdam)"
    rule = "Adam, v = beta2 v + (1 - beta2) g^2"

    def second_moment(self, v: Tensor, g2: Tensor) -> Tensor:
        return self.options.beta2 * v + (1 - self.options.beta2) * g2
