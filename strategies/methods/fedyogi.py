"""FedYogi (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2): Yogi on the
server, v_t = v_{t-1} - (1 - beta_2) Delta_t^2 sign(v_{t-1} - Delta_t^2) (``fedopt.AdaptiveFedOpt``)."""

from __future__ import annotations

from torch import Tensor

from .fedopt import AdaptiveFedOpt


class FedYogi(AdaptiveFedOpt):
    """FedAvg's local steps; the server steps with Yogi on the averaged update."""

    name = "fedyogi"
    paper = "Reddi et al., ICLR 2021, https://arxiv.org/abs/2003.00295 (Algorithm 2, FedYogi)"
    rule = "Yogi, v = v - (1 - beta2) g^2 sign(v - g^2)"

    def second_moment(self, v: Tensor, g2: Tensor) -> Tensor:
        return v - (1 - self.options.beta2) * g2 * (v - g2).sign()
