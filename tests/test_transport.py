"""Lossy transport (``transport = "bfloat16" | "float16"``): half the bytes, every rounding within
its stated bound, updates (not parameters) rounded on the way back, integers and buffers exact,
and a run that keeps going with no honest reply rejected."""

from __future__ import annotations

import json

import pytest
import torch

from simulations.loopback import run_in_process
from strategies.flower_api.packing import pack_arrays, packed_content, unpack_arrays
from strategies.flower_api.wire import TRANSPORT_ERROR, encode
from tasks.digits import DigitsCNN


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return DigitsCNN().state_dict()


def trainable() -> list[str]:
    return [k for k, p in DigitsCNN().named_parameters() if p.requires_grad]


@pytest.mark.parametrize("transport", ["bfloat16", "float16"])
def test_the_global_model_travels_rounded_within_half_an_ulp(transport):
    model = state()
    sent, restore = encode(model, trainable(), transport)
    payload = pack_arrays({"arrays": sent}, {"arrays": restore})
    exact = pack_arrays({"arrays": model})
    assert len(payload.data) < 0.6 * len(exact.data)  # the trainable parameters are nearly all the bytes
    got, why = unpack_arrays(packed_content(payload))
    assert why is None
    for k, v in model.items():
        g = got["arrays"][k]
        assert g.dtype == v.dtype and g.shape == v.shape
        if k in trainable():  # float16's subnormals (|x| < 6.1e-5) are 2**-24 apart
            tiny = 2.0**-25 if transport == "float16" else 0.0
            assert torch.all((g - v).abs() <= TRANSPORT_ERROR[transport] * v.abs() + tiny), k
        else:  # BatchNorm statistics and counters travel exactly
            assert torch.equal(g, v), k


def test_a_reply_sends_its_update_rounded_and_the_server_adds_it_to_its_own_model():
    received = state()
    x_end = {k: v + 1e-3 * torch.randn_like(v) if v.is_floating_point() else v + 2 for k, v in received.items()}
    sent, restore = encode(x_end, trainable(), "bfloat16", reference=received)
    assert all(restore[k] == ("float32", True) for k in trainable())
    server_model = {k: v.clone() for k, v in received.items()}
    got, why = unpack_arrays(packed_content(pack_arrays({"arrays": sent}, {"arrays": restore})), server_model)
    assert why is None
    for k in trainable():
        update, rounded = x_end[k] - received[k], got["arrays"][k] - server_model[k]
        # the update's rounding, not the parameters': far below the update itself
        assert float((rounded - update).norm()) <= 2**-8 * float(update.norm()) + 1e-6, k
    for k in set(received) - set(trainable()):
        assert torch.equal(got["arrays"][k], x_end[k]), k


def test_a_difference_without_the_global_model_is_a_reason_not_a_crash():
    received = state()
    sent, restore = encode(received, trainable(), "float16", reference=received)
    content = packed_content(pack_arrays({"arrays": sent}, {"arrays": restore}))
    arrays, why = unpack_arrays(content)  # no reference
    assert arrays is None and "difference from a global array" in why
    wrong = {k: v[:1] if v.dim() else v for k, v in received.items()}
    assert "difference from a global array" in unpack_arrays(content, wrong)[1]


def test_a_bad_restore_entry_is_a_reason():
    body = pack_arrays({"a": {"w": torch.zeros(3, dtype=torch.bfloat16)}}, {"a": {"w": ("complex64", False)}})
    arrays, why = unpack_arrays(packed_content(body))
    assert arrays is None and "bad restore" in why


def rows(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()][1:]


@pytest.mark.parametrize("transport", ["bfloat16", "float16"])
def test_a_lossy_run_trains_like_the_exact_one_and_rejects_no_honest_reply(tmp_path, transport):
    base = {"num-clients": 4, "num-rounds": 3, "local-steps": 4, "results-dir": str(tmp_path), "device": "cpu",
            "checkpoint-every": 0}
    run_in_process({**base, "run-name": "exact"}, 2)
    run_in_process({**base, "run-name": "lossy", "transport": transport}, 2)
    exact, lossy = rows(tmp_path / "exact")[1:], rows(tmp_path / "lossy")[1:]  # rounds 1..
    assert all(r["rejected-replies"] == 0 and r["replies"] == 4 for r in lossy)
    assert abs(lossy[-1]["test-accuracy"] - exact[-1]["test-accuracy"]) < 0.05
    a = torch.load(tmp_path / "exact" / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "lossy" / "model.pt", weights_only=True)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # lossy: not the exact model
    drift = max(float((a[k] - b[k]).abs().max()) for k in trainable())
    assert drift < 0.05


def test_the_exact_transport_leaves_every_tensor_as_it_is():
    """float32 (the default): nothing is encoded, the packed message carries the very bytes."""
    model = state()
    sent, restore = encode(model, trainable(), "float32")
    assert restore == {} and all(sent[k] is model[k] for k in model)


def test_config_refuses_an_unknown_transport():
    from tasks.config import RunConfig

    with pytest.raises(ValueError, match="transport"):
        RunConfig.from_mapping({"transport": "int8"})
    assert RunConfig.from_mapping({"transport": "bfloat16"}).transport == "bfloat16"


def test_the_strategy_refuses_a_lossy_transport_without_packing():
    from strategies import CELGC

    with pytest.raises(ValueError, match="packed=True"):
        CELGC(local_steps=2, lr=0.1, transport="bfloat16")
    with pytest.raises(ValueError, match="transport must be one of"):
        CELGC(local_steps=2, lr=0.1, packed=True, transport="float8")
