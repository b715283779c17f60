"""Split a training set among federated clients: i.i.d., SCAFFOLD similarity, or Dirichlet.

Every partitioner is a pure function of its arguments: randomness comes only from
``numpy.random.default_rng(seed)`` (never the global NumPy state), so the same call gives
the same split on any host. The returned parts are ``int64`` index arrays into the training
set; they are pairwise disjoint, their union is exactly ``range(len(labels))`` and no part
is empty (which needs ``num_clients <= len(labels)``).

Partitioners (the ``partitioner`` config key):

``homogeneous``
    A seeded permutation dealt into equal parts (sizes differ by at most one).
``similarity``
    The split of SCAFFOLD (Karimireddy et al., 2020) used by Liu et al. (arXiv 2205.05040):
    ``similarity`` percent of every class is dealt evenly to the clients, the rest is
    sorted by label and cut into contiguous chunks. 100 is i.i.d., 0 is fully label-sorted.
``dirichlet``
    Per class, client proportions drawn from ``Dirichlet(dirichlet-alpha)``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

PARTITIONERS = ("homogeneous", "similarity", "dirichlet")

#: Dirichlet draws tried before empty clients are filled by moving single examples.
_DIRICHLET_TRIES = 10
#: Dirichlet draws tried to give every client ``min_size`` examples.
_MIN_SIZE_TRIES = 10_000


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_seed(seed: object) -> None:
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")


def _check_clients(num_clients: object, num_examples: int) -> None:
    if not _is_int(num_clients) or num_clients < 1:
        raise ValueError(f"num-clients must be an integer >= 1, got {num_clients!r}")
    if num_clients > num_examples:
        raise ValueError(
            f"num-clients ({num_clients}) exceeds the number of training examples "
            f"({num_examples}): every client needs at least one example"
        )


def _check_labels(labels: object) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            "labels must be a 1-D integer array of non-negative values, "
            f"got shape {arr.shape} and dtype {arr.dtype}"
        )
    if arr.size and arr.min() < 0:
        raise ValueError(
            f"labels must be a 1-D integer array of non-negative values, got min {arr.min()}"
        )
    return arr.astype(np.int64, copy=False)


def _class_indices(labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices of each present class (ascending label), each in seeded shuffled order."""
    order = np.argsort(labels, kind="stable")
    bounds = np.flatnonzero(np.diff(labels[order])) + 1
    return [rng.permutation(block) for block in np.split(order, bounds)]


def homogeneous(num_examples: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """Deal a seeded permutation of ``range(num_examples)`` into equal parts.

    Parameters
    ----------
    num_examples : int
        Size of the training set.
    num_clients : int
        Number of parts, ``1 <= num_clients <= num_examples``.
    seed : int
        Seed of ``numpy.random.default_rng``.

    Returns
    -------
    list of numpy.ndarray
        ``num_clients`` int64 index arrays in shuffled order; sizes differ by at most one
        (the first ``num_examples % num_clients`` parts hold the extra example).
    """
    if not _is_int(num_examples) or num_examples < 0:
        raise ValueError(f"num-examples must be an integer >= 0, got {num_examples!r}")
    _check_clients(num_clients, num_examples)
    _check_seed(seed)
    perm = np.random.default_rng(seed).permutation(num_examples).astype(np.int64)
    return list(np.array_split(perm, num_clients))


def similarity(
    labels: np.ndarray, num_clients: int, similarity: float, seed: int
) -> list[np.ndarray]:
    """SCAFFOLD-style split: ``similarity`` percent i.i.d., the rest sorted by label.

    Each class's indices are shuffled with the seeded generator. The first
    ``floor(similarity / 100 * count + 0.5)`` of a class (rounding half up) join the i.i.d.
    pool, the others the sorted remainder. The pool (class by class) is dealt round-robin
    to the clients, so every client gets ``floor`` or ``ceil`` of ``pool_c / num_clients``
    examples of each class ``c``, and client sizes from the pool differ by at most one.
    The remainder, in ascending label order, is cut into contiguous chunks whose sizes
    differ by at most one, sized so that the total client sizes also differ by at most
    one (client ``i`` gets chunk ``i``). Each part is shuffled at the end.

    Parameters
    ----------
    labels : numpy.ndarray
        1-D non-negative integer class labels of the training set.
    num_clients : int
        Number of parts, ``1 <= num_clients <= len(labels)``.
    similarity : float
        Percent of i.i.d. data in ``[0, 100]``: 100 is i.i.d., 0 fully label-sorted.
    seed : int
        Seed of ``numpy.random.default_rng``.

    Returns
    -------
    list of numpy.ndarray
        ``num_clients`` int64 index arrays.
    """
    labels = _check_labels(labels)
    _check_clients(num_clients, labels.size)
    if not _is_real(similarity) or not 0 <= similarity <= 100:
        raise ValueError(f"similarity must be in [0, 100], got {similarity!r}")
    _check_seed(seed)
    rng = np.random.default_rng(seed)
    pool_parts, rest_parts = [], []
    for idx in _class_indices(labels, rng):
        n_pool = math.floor(similarity / 100 * idx.size + 0.5)
        pool_parts.append(idx[:n_pool])
        rest_parts.append(idx[n_pool:])
    pool = np.concatenate(pool_parts)
    rest = np.concatenate(rest_parts)
    shares = [pool[i::num_clients] for i in range(num_clients)]
    total_sizes = [len(a) for a in np.array_split(np.arange(labels.size), num_clients)]
    # Pool shares and totals both put their extra example on the first clients and the
    # pool is no larger than the data set, so no chunk size is negative.
    cuts = np.cumsum([t - len(s) for t, s in zip(total_sizes, shares)])[:-1]
    chunks = np.split(rest, cuts)
    return [
        rng.permutation(np.concatenate([s, c])).astype(np.int64)
        for s, c in zip(shares, chunks)
    ]


_similarity = similarity  # reachable inside partition(), whose keyword shadows the name


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_size: int = 0) -> list[np.ndarray]:
    """Per-class Dirichlet split (Hsu et al., 2019).

    ``min_size`` > 0 (``dirichlet-min-size``) redraws all classes from the same generator until every
    client holds at least ``min_size`` examples (the NIID-Bench convention, Li et al. 2022, which redraws
    until each party has 10), up to ``_MIN_SIZE_TRIES`` draws, else a ValueError; 0 keeps the rule below.

    For each class (ascending label), proportions ``p ~ Dirichlet(alpha * ones(num_clients))``
    are drawn and the class's shuffled indices are cut at ``round(cumsum(p) * count)``.
    If a draw of all classes leaves some client empty, all classes are drawn again from
    the same generator, up to 10 draws in total. If the last draw still leaves clients
    empty, each empty client (in index order) receives the last example of the currently
    largest client (lowest index among ties); this moves at most ``num_clients - 1``
    examples and is deterministic.

    Parameters
    ----------
    labels : numpy.ndarray
        1-D non-negative integer class labels of the training set.
    num_clients : int
        Number of parts, ``1 <= num_clients <= len(labels)``.
    alpha : float
        Concentration, finite and ``> 0``: large is near-uniform, small is skewed.
    seed : int
        Seed of ``numpy.random.default_rng``.

    Returns
    -------
    list of numpy.ndarray
        ``num_clients`` int64 index arrays, each shuffled.
    """
    labels = _check_labels(labels)
    _check_clients(num_clients, labels.size)
    if not _is_real(alpha) or not (0 < alpha < math.inf):
        raise ValueError(f"dirichlet-alpha must be a finite number > 0, got {alpha!r}")
    _check_seed(seed)
    if not _is_int(min_size) or min_size < 0 or min_size * num_clients > labels.size:
        raise ValueError(f"dirichlet-min-size must be an integer in [0, {labels.size // num_clients}] for {labels.size} "
                         f"examples and {num_clients} clients, got {min_size!r}")
    rng = np.random.default_rng(seed)
    classes = _class_indices(labels, rng)
    for _ in range(_MIN_SIZE_TRIES if min_size else _DIRICHLET_TRIES):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in classes:
            p = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = np.rint(np.cumsum(p)[:-1] * idx.size).astype(np.int64)
            for i, piece in enumerate(np.split(idx, np.clip(cuts, 0, idx.size))):
                buckets[i].append(piece)
        parts = [np.concatenate(b).astype(np.int64) for b in buckets]
        if all(p.size >= max(1, min_size) for p in parts):
            break
    if min_size and min(p.size for p in parts) < min_size:
        raise ValueError(f"dirichlet-alpha = {alpha:g}: no draw in {_MIN_SIZE_TRIES} gave every one of {num_clients} clients "
                         f"{min_size} example{'' if min_size == 1 else 's'}; lower dirichlet-min-size or num-clients, "
                         "or raise dirichlet-alpha")
    for i in range(num_clients):
        if parts[i].size == 0:
            donor = int(np.argmax([p.size for p in parts]))
            parts[i], parts[donor] = parts[donor][-1:], parts[donor][:-1]
    return [rng.permutation(p) for p in parts]


def partition(
    labels: np.ndarray,
    num_clients: int,
    kind: str,
    seed: int,
    *,
    similarity: float = 0.0,
    alpha: float = 0.5,
    min_size: int = 0,
) -> list[np.ndarray]:
    """Split ``range(len(labels))`` with the partitioner named ``kind``.

    Parameters
    ----------
    labels : numpy.ndarray
        1-D non-negative integer class labels of the training set.
    num_clients : int
        Number of parts.
    kind : str
        One of :data:`PARTITIONERS`.
    seed : int
        Seed of ``numpy.random.default_rng``.
    similarity : float, optional
        Percent i.i.d. for ``kind="similarity"``.
    alpha : float, optional
        Concentration for ``kind="dirichlet"``.
    min_size : int, optional
        Fewest examples per client for ``kind="dirichlet"`` (redraws; 0: any non-empty split).

    Returns
    -------
    list of numpy.ndarray
        ``num_clients`` disjoint, non-empty int64 index arrays covering the data set.
    """
    if kind == "homogeneous":
        labels = _check_labels(labels)
        return homogeneous(labels.size, num_clients, seed)
    if kind == "similarity":
        return _similarity(labels, num_clients, similarity, seed)
    if kind == "dirichlet":
        return dirichlet(labels, num_clients, alpha, seed, min_size)
    raise ValueError(f"partitioner must be one of {', '.join(PARTITIONERS)}, got {kind!r}")


def label_histogram(
    labels: np.ndarray, parts: list[np.ndarray], num_classes: int | None = None
) -> np.ndarray:
    """Count each client's examples per class.

    Parameters
    ----------
    labels : numpy.ndarray
        1-D non-negative integer class labels of the training set.
    parts : list of numpy.ndarray
        Index arrays into ``labels``, one per client.
    num_classes : int, optional
        Number of columns; defaults to ``max(labels) + 1`` (0 for no labels).

    Returns
    -------
    numpy.ndarray
        int64 counts of shape ``[len(parts), num_classes]``.
    """
    labels = _check_labels(labels)
    needed = int(labels.max()) + 1 if labels.size else 0
    if num_classes is None:
        num_classes = needed
    if not _is_int(num_classes) or num_classes < needed:
        raise ValueError(f"num-classes must be an integer >= {needed}, got {num_classes!r}")
    hist = np.zeros((len(parts), num_classes), dtype=np.int64)
    for i, part in enumerate(parts):
        hist[i] = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
    return hist


def hold_out(part: np.ndarray, fraction: float, seed: int, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held) of one client's training indices: ``round(fraction * n)`` of them (at least
    one when ``fraction > 0``, never all) drawn by ``default_rng([seed, partition_id, 0x76616C])``
    for validation, the rest kept in their original order. ``fraction = 0`` keeps everything."""
    part = np.asarray(part)
    if fraction <= 0:
        return part, part[:0]
    n = len(part)
    if n < 2:
        raise ValueError(f"client {partition_id} holds {n} example(s): too few to hold out a validation share")
    m = min(n - 1, max(1, int(round(fraction * n))))
    rng = np.random.default_rng([seed, partition_id, 0x76616C])
    held = np.zeros(n, dtype=bool)
    held[rng.choice(n, size=m, replace=False)] = True
    return part[~held], part[held]

