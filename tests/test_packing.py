"""Packed messages (strategies.flower_api.packing): exact round trips, far fewer Flower objects,
every malformed payload a reason (never an exception), and the server reading packed and plain
replies alike."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from strategies.flower_api.packing import MAGIC, PACKED, PAYLOAD, is_packed, pack, unpack
from tasks.digits import DigitsCNN


def node_reply(clients=(0, 2, 4, 6)) -> RecordDict:
    """A multi-client node's reply as this project's ClientApp writes it, unpacked."""
    gen = torch.Generator().manual_seed(0)
    content = RecordDict()
    for pid in clients:
        state = {k: (v + torch.randn(v.shape, generator=gen) if v.is_floating_point() else v + pid)
                 for k, v in DigitsCNN().state_dict().items()}
        content[f"arrays.{pid}"] = ArrayRecord(state)
        content[f"metrics.{pid}"] = MetricRecord({"num-examples": 256, "train-loss": 0.5 + pid})
    return content


def same(a: RecordDict, b: RecordDict) -> None:
    assert list(a.array_records) == list(b.array_records)
    assert list(a.metric_records) == list(b.metric_records) and list(a.config_records) == list(b.config_records)
    for name, record in a.array_records.items():
        x, y = record.to_torch_state_dict(), b[name].to_torch_state_dict()
        assert list(x) == list(y)
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape and torch.equal(x[k], y[k]), (name, k)


def test_round_trip_is_exact_for_every_dtype_and_shape():
    arrays = {"f32": np.arange(6, dtype=np.float32).reshape(2, 3), "f64": np.array([np.pi, -0.0, np.inf]),
              "f16": np.array([1.5], dtype=np.float16), "i64": np.array(2**62, dtype=np.int64),
              "i32": np.array([[-1]], dtype=np.int32), "u8": np.array([0, 255], dtype=np.uint8),
              "b": np.array([True, False]), "empty": np.zeros((0, 4), dtype=np.float32)}
    content = RecordDict({"a": ArrayRecord({k: Array(v) for k, v in arrays.items()}), "b": ArrayRecord({}),
                          "config": ConfigRecord({"x": 1}), "m": MetricRecord({"y": 2.0})})
    packed = pack(content)
    assert is_packed(packed) and list(packed.array_records) == [PACKED] and list(packed[PACKED]) == [PAYLOAD]
    out, why = unpack(packed)
    assert why is None
    assert list(out["a"]) == list(arrays) and list(out["b"]) == []
    for k, v in arrays.items():
        got = out["a"][k].numpy()
        assert got.dtype == v.dtype and got.shape == v.shape and got.tobytes() == v.tobytes(), k
    assert dict(out["config"]) == {"x": 1} and dict(out["m"]) == {"y": 2.0}


def test_a_node_reply_packs_into_a_handful_of_objects_with_the_same_bytes():
    content = node_reply()
    out, why = unpack(pack(content))
    assert why is None
    same(content, out)
    plain, packed = get_all_nested_objects(content), get_all_nested_objects(pack(content))
    # 4 clients x 16 arrays: each array and its chunk its own object, plus the records
    assert len(plain) == 129 and len(packed) == 8
    size = lambda objects: sum(len(o.deflate()) for o in objects.values())  # noqa: E731
    assert size(packed) < size(plain)


def test_a_plain_record_dict_is_read_as_it_is():
    content = node_reply((1,))
    out, why = unpack(content)
    assert out is content and why is None and not is_packed(content)


def _payload(layout, body: bytes = b"") -> RecordDict:
    head = json.dumps(layout).encode() if not isinstance(layout, bytes) else layout
    raw = MAGIC + len(head).to_bytes(8, "little") + head + body
    return RecordDict({PACKED: ArrayRecord({PAYLOAD: Array(np.frombuffer(raw, dtype=np.uint8).copy())})})


F32 = np.arange(3, dtype=np.float32).tobytes()


@pytest.mark.parametrize("content, reason", [
    (_payload([["a", [["w", "float32", [4]]]]], F32), "more bytes than were sent"),
    (_payload([["a", [["w", "float32", [2]]]]], F32), "4 bytes sent beyond the layout"),
    (_payload([["a", [["w", "complex64", [3]]]]], F32), "bad layout entry"),
    (_payload([["a", [["w", "float32", [-3]]]]], F32), "bad layout entry"),
    (_payload([["a", [["w", "float32", [3.0]]]]], F32), "bad layout entry"),
    (_payload([["a", [["w", "float32", [3]], ["w", "float32", [0]]]]], F32), "key 'w' repeats"),
    (_payload([["a", []], ["a", []]]), "record name 'a' repeats"),
    (_payload([["", []]]), "record name '' repeats, clashes or is empty"),
    (_payload({"a": 1}), "must be a list"),
    (_payload(b"{not json"), "packed arrays could not be read"),
    (_payload(b"\xff\xfe"), "packed arrays could not be read"),
    (RecordDict({PACKED: ArrayRecord({PAYLOAD: Array(np.zeros(3, dtype=np.uint8))})}), "packing header"),
    (RecordDict({PACKED: ArrayRecord({PAYLOAD: Array(np.zeros(3, dtype=np.float32))})}), "must be a uint8 vector"),
    (RecordDict({PACKED: ArrayRecord({"other": Array(np.zeros(3, dtype=np.uint8))})}), "must hold exactly"),
])
def test_a_malformed_payload_is_a_reason_never_an_exception(content, reason):
    out, why = unpack(content)
    assert out is content and why is not None and reason in why, why


def test_a_huge_layout_length_is_refused_before_reading_it():
    raw = MAGIC + (2**62).to_bytes(8, "little") + b"[]"
    content = RecordDict({PACKED: ArrayRecord({PAYLOAD: Array(np.frombuffer(raw, dtype=np.uint8).copy())})})
    assert "beyond the payload" in unpack(content)[1]


def test_a_packed_record_beside_other_array_records_is_refused():
    content = pack(node_reply((1,)))
    content["arrays"] = ArrayRecord({"w": Array(np.zeros(2, dtype=np.float32))})
    assert "no other ArrayRecord" in unpack(content)[1]


def test_a_record_that_names_a_plain_record_of_the_message_is_refused():
    content = pack(node_reply((1,)))
    content["arrays.1"] = MetricRecord({"x": 1.0})  # a record the layout also names
    assert "clashes" in unpack(content)[1]
