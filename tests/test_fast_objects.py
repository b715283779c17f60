"""strategies.flower_api.fast_objects: the same bytes and object ids as Flower 1.42's own object
code, for arrays of every size (empty, one chunk, chunk boundaries, repeated chunks), and
messages that inflate to the same arrays."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.app.message.arraychunk import ArrayChunk
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE as CHUNK
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

from strategies.flower_api import fast_objects


@pytest.fixture
def flower_only():
    """Flower's own functions for the test, the previous state after it."""
    was = fast_objects.installed()
    fast_objects.uninstall()
    yield
    if was:
        fast_objects.install()


def arrays() -> dict[str, np.ndarray]:
    gen = np.random.default_rng(0)
    return {"empty": np.zeros((0, 3), dtype=np.float32), "one": np.array([1.5], dtype=np.float32),
            "below": gen.integers(0, 255, CHUNK - 1, dtype=np.uint8), "exact": gen.integers(0, 255, CHUNK, dtype=np.uint8),
            "above": gen.integers(0, 255, CHUNK + 1, dtype=np.uint8),
            "zeros": np.zeros(3 * CHUNK // 4 + 7, dtype=np.float32),  # 3 chunks, two of them equal
            "f64": gen.standard_normal((513, 1031))}


def message() -> RecordDict:
    """A message's content (building a Message needs a running app's run id)."""
    return RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays().items()}),
                       "config": ConfigRecord({"lr": 0.1})})


def objects(msg: RecordDict) -> dict[str, bytes]:
    return {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}


def test_the_same_bytes_and_ids_as_flower(flower_only):
    expected = objects(message())
    fast_objects.install()
    try:
        got = objects(message())
        with no_object_id_recompute():
            again = objects(message())
    finally:
        fast_objects.uninstall()
    assert list(got) == list(expected) and got == expected and again == expected
    assert len(expected) > 10  # chunks of every array, the records, the message


def test_inflated_messages_hold_the_same_arrays_and_ids(flower_only):
    sent = message()
    contents = objects(sent)
    root = sent.object_id
    reference = inflate_object_from_contents(root, dict(contents), keep_object_contents=True)
    fast_objects.install()
    try:
        fast = inflate_object_from_contents(root, dict(contents), keep_object_contents=True)
        assert fast.object_id == reference.object_id == root
        chunk = next(o for o in get_all_nested_objects(fast).values() if isinstance(o, ArrayChunk))
        assert isinstance(chunk.data, memoryview) and chunk.data.readonly
    finally:
        fast_objects.uninstall()
    for key, value in arrays().items():
        a, b = fast["arrays"][key], reference["arrays"][key]
        assert a.data == b.data and a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a.numpy(), value)


def test_a_chunk_is_hashed_once_but_again_when_its_buffer_can_change(flower_only, monkeypatch):
    fast_objects.install()
    try:
        calls = []
        real = fast_objects.get_object_id
        monkeypatch.setattr(fast_objects, "get_object_id", lambda b: calls.append(1) or real(b))
        frozen = ArrayChunk(memoryview(b"abc" * 100))
        assert frozen.object_id == frozen.object_id and len(calls) == 1
        buffer = bytearray(b"abc" * 100)
        mutable = ArrayChunk(memoryview(buffer))
        first = mutable.object_id
        buffer[0] = ord("x")
        assert mutable.object_id != first  # a writable buffer may change: hashed on every access
        mutable.data = memoryview(b"xyz")
        assert mutable.object_id == ArrayChunk(memoryview(b"xyz")).object_id
    finally:
        fast_objects.uninstall()


def test_a_changed_flower_is_refused(flower_only, monkeypatch):
    monkeypatch.setattr(fast_objects.flwr, "__version__", "1.43.0")
    with pytest.raises(RuntimeError, match="Flower 1.43.0"):
        fast_objects.install()
    assert not fast_objects.installed()


def test_install_is_idempotent_and_reversible(flower_only):
    fast_objects.install()
    fast_objects.install()
    assert fast_objects.installed()
    fast_objects.uninstall()
    assert not fast_objects.installed() and "object_id" not in vars(ArrayChunk)
