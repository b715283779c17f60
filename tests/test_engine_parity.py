"""The engine against the Flower path: the real ServerApp + ClientApp (loopback grid), the same
config and seed, R rounds -> the same global parameters and the same result rows.

* The engine as it runs by default on the CPU (one client after another) reproduces the
  Flower path bit for bit on the default task, for CELGC at two values of I and for naive
  parallel clipping.
* The vectorised path (vmap) computes the same sums in another order, so it agrees to float
  rounding (1e-5) -- on a model without max pooling. Max pooling picks the argmax of each
  window, and the digits images have constant regions, i.e. exact ties in the input: a
  1-ulp difference in a convolution flips which element wins and routes that window's whole
  gradient elsewhere (both are valid subgradients). The vmap parity therefore uses the
  default model with average pooling; the default model itself is covered bit for bit above.
"""

import pytest

pytest.importorskip("flwr")

from tasks import load_task  # noqa: E402
from tasks.config import RunConfig  # noqa: E402

CASES = {
    "celgc-I2": {"local-steps": 2},
    "celgc-I5": {"local-steps": 5, "weight-decay": 1e-3, "momentum": 0.5},
    "naive": {"algorithm": "naive", "local-steps": 1, "num-rounds": 3, "momentum": 0.5, "weight-decay": 1e-3},
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_equals_flower_bit_for_bit(runs, case):
    """The default engine on the CPU (auto: one client after another), the default task."""
    runs.same(runs.flower("flower", **CASES[case]), runs.engine("engine", "auto", **CASES[case]), exact=True)


@pytest.mark.parametrize("case", list(CASES))
def test_vectorised_engine_equals_flower(runs, smooth_digits, case):
    """vmap over the clients: the same global parameters to 1e-5 after R rounds."""
    ref = runs.flower("flower", **CASES[case])
    assert isinstance(load_task(RunConfig()).build_model(), smooth_digits)
    runs.same(ref, runs.engine("vmap", "vmap", **CASES[case]), exact=False)
