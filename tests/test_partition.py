"""Property tests of the data-set partitioners in ``tasks.partition``."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.partition import (
    PARTITIONERS,
    dirichlet,
    homogeneous,
    label_histogram,
    partition,
    similarity,
)

PROPS = settings(max_examples=50, deadline=None)


@st.composite
def datasets(draw, min_examples=1, max_examples=300, max_clients=30):
    """(labels, num_clients, seed): random sizes, class counts (some labels unused)."""
    n = draw(st.integers(min_examples, max_examples))
    num_classes = draw(st.integers(1, 12))
    stride = draw(st.sampled_from([1, 3]))  # stride 3 leaves label gaps
    labels = np.random.default_rng(draw(st.integers(0, 2**32))).integers(0, num_classes, n)
    num_clients = draw(st.integers(1, min(n, max_clients)))
    seed = draw(st.integers(0, 2**63))
    return labels * stride, num_clients, seed


@st.composite
def configs(draw, **kwargs):
    """(labels, num_clients, seed, kind, options) for any partitioner."""
    labels, num_clients, seed = draw(datasets(**kwargs))
    kind = draw(st.sampled_from(PARTITIONERS))
    options = {
        "similarity": draw(st.floats(0, 100)),
        "alpha": draw(st.floats(1e-3, 1e3)),
    }
    return labels, num_clients, seed, kind, options


def _check_valid(parts, n, num_clients):
    assert len(parts) == num_clients
    assert all(p.dtype == np.int64 and p.ndim == 1 for p in parts)
    assert all(p.size > 0 for p in parts)
    allidx = np.concatenate(parts)
    assert allidx.size == n  # with the next line: disjoint and covering
    np.testing.assert_array_equal(np.sort(allidx), np.arange(n))


@PROPS
@given(configs())
def test_parts_are_disjoint_covering_nonempty_and_deterministic(cfg):
    labels, num_clients, seed, kind, options = cfg
    parts = partition(labels, num_clients, kind, seed, **options)
    _check_valid(parts, labels.size, num_clients)
    again = partition(labels.copy(), num_clients, kind, seed, **options)
    for a, b in zip(parts, again):
        np.testing.assert_array_equal(a, b)


@PROPS
@given(configs(min_examples=20), st.integers(1, 2**32))
def test_different_seed_gives_different_parts(cfg, delta):
    # With >= 20 examples the parts (in order) coincide with probability <= 1 / 20!.
    labels, num_clients, seed, kind, options = cfg
    a = np.concatenate(partition(labels, num_clients, kind, seed, **options))
    b = np.concatenate(partition(labels, num_clients, kind, seed + delta, **options))
    assert not np.array_equal(a, b)


def test_dispatcher_matches_the_partitioners():
    labels = np.random.default_rng(0).integers(0, 10, 500)
    pairs = [
        (partition(labels, 7, "homogeneous", 3), homogeneous(500, 7, 3)),
        (partition(labels, 7, "similarity", 3, similarity=40), similarity(labels, 7, 40, 3)),
        (partition(labels, 7, "dirichlet", 3, alpha=0.3), dirichlet(labels, 7, 0.3, 3)),
    ]
    for got, want in pairs:
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


@PROPS
@given(st.integers(1, 2000), st.integers(1, 50), st.integers(0, 2**32))
def test_homogeneous_sizes_differ_by_at_most_one(n, num_clients, seed):
    num_clients = min(num_clients, n)
    parts = homogeneous(n, num_clients, seed)
    _check_valid(parts, n, num_clients)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1


@PROPS
@given(datasets(), st.floats(0, 100))
def test_similarity_client_sizes_differ_by_at_most_one(data, s):
    labels, num_clients, seed = data
    sizes = [p.size for p in similarity(labels, num_clients, s, seed)]
    assert max(sizes) - min(sizes) <= 1


@PROPS
@given(datasets())
def test_similarity_100_is_iid_per_class(data):
    # The pool is dealt round-robin class by class: every client gets floor or ceil of
    # count_c / num_clients examples of each class c.
    labels, num_clients, seed = data
    hist = label_histogram(labels, similarity(labels, num_clients, 100, seed))
    counts = np.bincount(labels)
    assert (hist >= counts // num_clients).all()
    assert (hist <= -(-counts // num_clients)).all()


@PROPS
@given(datasets(), st.floats(0, 100))
def test_similarity_pool_reaches_every_client(data, s):
    # Each client gets at least floor(pool_c / num_clients) of each class c from the pool.
    labels, num_clients, seed = data
    hist = label_histogram(labels, similarity(labels, num_clients, s, seed))
    pool = np.floor(s / 100 * np.bincount(labels) + 0.5).astype(np.int64)
    assert (hist >= pool // num_clients).all()


def test_similarity_pool_count_rounds_half_up():
    # 25% of 10 is 2.5 -> 3 per class (not 2, as banker's rounding would give). The pool
    # [0, 0, 0, 1, 1, 1] is dealt round-robin (sizes 2, 2, 1, 1), then the sorted rest
    # [0] * 7 + [1] * 7 is cut into chunks of 3, 3, 4, 4 so every client holds 5.
    labels = np.repeat([0, 1], 10)
    hist = label_histogram(labels, similarity(labels, 4, 25, 0))
    np.testing.assert_array_equal(hist, [[4, 1], [4, 1], [2, 3], [0, 5]])


@PROPS
@given(
    st.integers(1, 12),
    st.integers(1, 30),
    st.integers(1, 30),
    st.integers(0, 2**32),
)
def test_similarity_0_is_label_sorted(num_classes, per_class, num_clients, seed):
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))
    num_clients = min(num_clients, labels.size)
    parts = similarity(labels, num_clients, 0, seed)
    _check_valid(parts, labels.size, num_clients)
    distinct = [np.unique(labels[p]) for p in parts]
    assert max(d.size for d in distinct) <= math.ceil(num_classes / num_clients) + 1
    for left, right in itertools.pairwise(distinct):
        assert left.max() <= right.min()


@PROPS
@given(
    st.integers(1, 10),
    st.integers(1, 20),
    st.integers(1, 10),
    st.integers(0, 2**32),
)
def test_dirichlet_huge_alpha_is_near_uniform(num_classes, extra, num_clients, seed):
    per_class = num_clients * extra + seed % num_clients  # >= num_clients: nobody is empty
    labels = np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))
    hist = label_histogram(labels, dirichlet(labels, num_clients, 1e9, seed))
    assert np.abs(hist - per_class / num_clients).max() <= 1.5


@PROPS
@given(datasets(min_examples=2))
def test_dirichlet_tiny_alpha_gives_each_class_to_one_client(data):
    # With alpha = 1e-9 every draw puts a whole class on one client; only the empty-client
    # repair moves examples, at most num_clients - 1 of them.
    labels, num_clients, seed = data
    hist = label_histogram(labels, dirichlet(labels, num_clients, 1e-9, seed))
    off_main = (hist.sum(axis=0) - hist.max(axis=0)).sum()
    assert off_main <= num_clients - 1


def test_dirichlet_alpha_controls_skew():
    labels = np.random.default_rng(1).integers(0, 10, 5000)

    def mean_top_share(alpha):
        hist = label_histogram(labels, dirichlet(labels, 10, alpha, 0))
        return (hist.max(axis=0) / hist.sum(axis=0)).mean()

    tiny, one, huge = mean_top_share(0.01), mean_top_share(1.0), mean_top_share(1e4)
    assert tiny > 0.9 and 0.15 < one < 0.5 and huge < 0.15


def test_dirichlet_repairs_empty_clients_deterministically():
    labels = np.zeros(50, dtype=np.int64)  # one class, tiny alpha: 9 clients start empty
    parts = dirichlet(labels, 10, 1e-9, 5)
    _check_valid(parts, 50, 10)
    assert sorted(p.size for p in parts) == [1] * 9 + [41]
    assert all(np.array_equal(a, b) for a, b in zip(parts, dirichlet(labels, 10, 1e-9, 5)))


@PROPS
@given(configs(), st.integers(0, 5))
def test_label_histogram_sums(cfg, extra_classes):
    labels, num_clients, seed, kind, options = cfg
    parts = partition(labels, num_clients, kind, seed, **options)
    num_classes = int(labels.max()) + 1 + extra_classes
    hist = label_histogram(labels, parts, num_classes)
    assert hist.dtype == np.int64 and hist.shape == (num_clients, num_classes)
    np.testing.assert_array_equal(hist.sum(axis=1), [p.size for p in parts])
    np.testing.assert_array_equal(hist.sum(axis=0), np.bincount(labels, minlength=num_classes))


# --- bad input -----------------------------------------------------------------------------

LABELS = np.arange(10) % 3


def _raises(message):
    return pytest.raises(ValueError, match=re.escape(message))


@pytest.mark.parametrize("kind", PARTITIONERS)
@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_num_clients(kind, bad):
    with _raises(f"num-clients must be an integer >= 1, got {bad!r}"):
        partition(LABELS, bad, kind, 0)


@pytest.mark.parametrize("kind", PARTITIONERS)
def test_more_clients_than_examples(kind):
    message = (
        "num-clients (20) exceeds the number of training examples (10): "
        "every client needs at least one example"
    )
    with _raises(message):
        partition(LABELS, 20, kind, 0)


@pytest.mark.parametrize("bad", [120, -0.5, float("nan"), "50"])
def test_bad_similarity(bad):
    with _raises(f"similarity must be in [0, 100], got {bad!r}"):
        partition(LABELS, 2, "similarity", 0, similarity=bad)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), None])
def test_bad_dirichlet_alpha(bad):
    with _raises(f"dirichlet-alpha must be a finite number > 0, got {bad!r}"):
        partition(LABELS, 2, "dirichlet", 0, alpha=bad)


def test_bad_partitioner():
    with _raises("partitioner must be one of homogeneous, similarity, dirichlet, got 'foo'"):
        partition(LABELS, 2, "foo", 0)


@pytest.mark.parametrize("kind", PARTITIONERS)
@pytest.mark.parametrize("bad", [-1, 1.5, "1", None])
def test_bad_seed(kind, bad):
    with _raises(f"seed must be an integer >= 0, got {bad!r}"):
        partition(LABELS, 2, kind, bad)


@pytest.mark.parametrize("kind", PARTITIONERS)
@pytest.mark.parametrize(
    "bad", [LABELS.reshape(2, 5), LABELS.astype(float), LABELS - 1, np.array(["a", "b"])]
)
def test_bad_labels(kind, bad):
    with _raises("labels must be a 1-D integer array of non-negative values"):
        partition(bad, 2, kind, 0)


def test_bad_num_examples():
    with _raises("num-examples must be an integer >= 0, got -3"):
        homogeneous(-3, 1, 0)


def test_label_histogram_too_few_classes():
    with _raises("num-classes must be an integer >= 3, got 2"):
        label_histogram(LABELS, [np.arange(10)], 2)
