"""Statistics over seeds: mean, sample standard deviation and Student-t 95 % intervals.

Pure functions (numpy, scipy for the t quantile). An interval over n seeds is
mean ± t_{0.975, n-1} · s / √n with s the sample standard deviation (ddof = 1); one seed has no
interval (None).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Summary:
    """n values: their mean, sample std and the 95 % t-interval (low, high); None where undefined."""

    n: int
    mean: float | None
    std: float | None
    low: float | None
    high: float | None

    @property
    def half_width(self) -> float | None:
        return None if self.low is None or self.high is None else (self.high - self.low) / 2


def t_quantile(df: int, level: float = 0.95) -> float:
    from scipy.stats import t

    return float(t.ppf(0.5 + level / 2, df))


def summary(values: Sequence[float], level: float = 0.95) -> Summary:
    """The mean, std and t-interval of ``values`` (finite numbers)."""
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if len(x) and not np.isfinite(x).all():
        raise ValueError(f"summary of non-finite values {values!r}")
    n = len(x)
    if n == 0:
        return Summary(0, None, None, None, None)
    mean = float(x.mean())
    if n == 1:
        return Summary(1, mean, None, None, None)
    std = float(x.std(ddof=1))
    half = t_quantile(n - 1, level) * std / math.sqrt(n)
    return Summary(n, mean, std, mean - half, mean + half)


def band(curves: Sequence[Sequence[float]], level: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per position, the mean and the t-interval's (low, high) of equally long curves (one per seed);
    with one curve the band is the curve itself."""
    y = np.asarray(curves, dtype=np.float64)
    mean = y.mean(axis=0)
    if len(y) < 2:
        return mean, mean, mean
    half = t_quantile(len(y) - 1, level) * y.std(axis=0, ddof=1) / math.sqrt(len(y))
    return mean, mean - half, mean + half
