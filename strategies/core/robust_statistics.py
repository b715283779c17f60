"""Byzantine-robust aggregation of client results, coordinate by coordinate (pure, no flwr).

The paper averages (``uniform`` / ``examples``, ``strategies.methods.reduce``). Against clients that
lie *within* the displacement bound (an update sign-flipped at 0.999 I gamma passes every
check) two classical robust statistics replace the mean, per coordinate over the sound
clients' float64 rows [n, P] (Yin, Chen, Ramchandran, Bartlett, ICML 2018):

* ``median``: the coordinate-wise median; for an even n the mean of the two middle values
  (``numpy.median``'s convention, so it equals Flower's ``FedMedian`` -- a reference test).
  It tolerates f < n / 2 lying clients.
* ``trimmed-mean`` with ``trim-fraction`` beta in [0, 0.5): per coordinate the k = floor(beta n)
  largest and k smallest values are dropped and the rest averaged (Flower's ``FedTrimmedAvg``
  and scipy's ``trim_mean``). It tolerates f <= k lying clients; beta = 0 is the plain mean.

Both ignore the averaging weights (a weight is a client's own claim) and compose with the
checks: a reply the bound or the buffer checks reject never reaches them. They run on every
backend through ``strategies.methods.reduce.mean``; across processes the sound rows are gathered by
the same one all-reduce (each process writes its clients' rows at their ids).
"""

from __future__ import annotations

from torch import Tensor

#: the robust aggregations (``aggregation`` values beside ``uniform`` and ``examples``)
ROBUST = ("median", "trimmed-mean")


def trim_count(n: int, trim_fraction: float) -> int:
    """k = floor(beta n): the values dropped at EACH end of a coordinate."""
    return int(trim_fraction * n)


def coordinate_median(rows: Tensor) -> Tensor:
    """The median of each column of ``rows`` [n, P] (n >= 1): the middle value, or for an even
    n the mean of the two middle ones."""
    n = rows.shape[0]
    if n == 0:
        raise ValueError("no client results to aggregate")
    ordered = rows.sort(dim=0).values
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def trimmed_mean(rows: Tensor, trim_fraction: float) -> Tensor:
    """The mean of each column of ``rows`` [n, P] without its k = floor(beta n) largest and k
    smallest values."""
    n = rows.shape[0]
    if n == 0:
        raise ValueError("no client results to aggregate")
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim-fraction must be in [0, 0.5), got {trim_fraction!r}")
    k = trim_count(n, trim_fraction)
    if k == 0:
        return rows.mean(dim=0)
    return rows.sort(dim=0).values[k:n - k].mean(dim=0)


def aggregate(rows: Tensor, aggregation: str, trim_fraction: float = 0.0) -> Tensor:
    """``aggregation`` (one of ``ROBUST``) of the columns of ``rows`` [n, P]."""
    if aggregation == "median":
        return coordinate_median(rows)
    if aggregation == "trimmed-mean":
        return trimmed_mean(rows, trim_fraction)
    raise ValueError(f"not a robust aggregation: {aggregation!r} (one of {', '.join(ROBUST)})")
