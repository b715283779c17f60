"""Minibatch sampling: deterministic from (seed, partition, round), without replacement in a pass."""

import numpy as np
import pytest

from tasks.sampling import round_batches


def draw(partition, r, seed=0, pid=0, steps=4, b=5):
    return round_batches(partition, seed=seed, partition_id=pid, server_round=r, local_steps=steps, batch_size=b)


def test_deterministic_and_depends_on_seed_partition_round():
    part = np.arange(100, 160)
    assert np.array_equal(draw(part, 3), draw(part, 3))
    assert not np.array_equal(draw(part, 3), draw(part, 4))
    assert not np.array_equal(draw(part, 3), draw(part, 3, seed=1))
    assert not np.array_equal(draw(part, 3), draw(part, 3, pid=1))


def test_a_pass_covers_the_partition_without_replacement():
    part = np.arange(40) * 3
    # 40 examples, batch 5 -> 8 batches a pass; 2 rounds of 4 steps = exactly one pass
    first_pass = np.concatenate([draw(part, 1).ravel(), draw(part, 2).ravel()])
    assert sorted(first_pass) == sorted(part)
    second_pass = np.concatenate([draw(part, 3).ravel(), draw(part, 4).ravel()])
    assert sorted(second_pass) == sorted(part)
    assert not np.array_equal(first_pass, second_pass)


def test_rounds_continue_the_pass_like_a_dataloader():
    part = np.arange(23)  # 4 batches of 5 a pass, 3 examples dropped each pass
    batches = np.concatenate([draw(part, r, steps=3) for r in (1, 2, 3, 4)])  # 12 batches = 3 passes
    for k in range(3):
        chunk = batches[4 * k : 4 * k + 4].ravel()
        assert len(set(chunk)) == 20


def test_indices_come_from_the_partition():
    part = np.array([7, 11, 13, 17, 19, 23])
    assert set(draw(part, 5, b=2, steps=7).ravel()) <= set(part)


def test_batch_larger_than_partition_is_an_error():
    with pytest.raises(ValueError, match="batch-size \\(10\\) exceeds the 6 examples of partition 2"):
        draw(np.arange(6), 1, pid=2, b=10)
    with pytest.raises(ValueError, match="batch-size \\(2\\) exceeds the 1 example of partition 0"):
        draw(np.arange(1), 1, pid=0, b=2)


@pytest.mark.parametrize("kwargs,match", [
    ({"server_round": 0}, "server-round"), ({"local_steps": 0}, "local-steps"), ({"batch_size": 0}, "batch-size"),
])
def test_bad_arguments(kwargs, match):
    args = {"seed": 0, "partition_id": 0, "server_round": 1, "local_steps": 1, "batch_size": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        round_batches(np.arange(10), **args)
