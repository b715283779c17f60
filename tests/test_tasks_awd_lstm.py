"""AWD-LSTM: size, shapes, weight drop (DropConnect), tied weights, AR/TAR, torch.func."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call, stack_module_state, vmap

from tasks.awd_lstm import AWDLSTM, WeightDropLSTM, ar_tar_loss, awd_lstm, detach_hidden

V, E, H = 37, 8, 12


def _tiny(**kw) -> AWDLSTM:
    torch.manual_seed(0)
    return AWDLSTM(V, emb_size=E, hidden_size=H, **kw)


def _tokens(t: int = 9, b: int = 3) -> torch.Tensor:
    return torch.randint(0, V, (t, b), generator=torch.Generator().manual_seed(5))


def test_parameter_count_ptb_vocabulary() -> None:
    with torch.device("meta"):  # no memory, no forward
        model = AWDLSTM(10_000)
    n = sum(p.numel() for p in model.parameters())
    emb = 10_000 * 400
    lstm = (4 * 1150 * (400 + 1150 + 2)) + (4 * 1150 * (1150 + 1150 + 2)) + (4 * 400 * (1150 + 400 + 2))
    assert n == emb + lstm + 10_000 == 24_221_600
    assert [r.hidden_size for r in model.rnns] == [1150, 1150, 400]
    # the state dict holds each tensor once (the tied decoder weight is the embedding)
    assert sum(v.numel() for v in model.state_dict().values()) == n


def test_forward_shapes_and_hidden() -> None:
    model = _tiny().train()
    x = _tokens()
    hidden = model.init_hidden(3)
    assert [tuple(h.shape) for h, _ in hidden] == [(1, 3, H), (1, 3, H), (1, 3, E)]
    out, new_hidden, raw, dropped = model(x, hidden)
    assert out.shape == (9, 3, V)
    assert [tuple(h.shape) for h, _ in new_hidden] == [(1, 3, H), (1, 3, H), (1, 3, E)]
    assert [tuple(r.shape) for r in raw] == [(9, 3, H), (9, 3, H), (9, 3, E)]
    assert [tuple(d.shape) for d in dropped] == [tuple(r.shape) for r in raw]
    assert all(not h.requires_grad for h, _ in detach_hidden(new_hidden))
    model.eval()
    logp, *_ = model(x, log_probs=True)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(9, 3))
    # the returned hidden state continues the sequence exactly
    full, *_ = model(x)
    first, h1, *_ = model(x[:4])
    second, *_ = model(x[4:], h1)
    torch.testing.assert_close(torch.cat([first, second]), full, rtol=1e-5, atol=1e-6)


def test_only_raw_hidden_weight_is_a_parameter() -> None:
    model = _tiny()
    for rnn in model.rnns:
        names = {n for n, _ in rnn.named_parameters()}
        assert names == {"weight_ih", "weight_hh_raw", "bias_ih", "bias_hh"}
        assert not list(rnn.buffers())
        assert not hasattr(rnn, "weight_hh")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model(_tokens())
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # forward mutates nothing


def test_eval_is_deterministic_and_train_is_not() -> None:
    model = _tiny()
    x = _tokens()
    model.eval()
    torch.manual_seed(1)
    a = model(x)[0]
    torch.manual_seed(2)
    b = model(x)[0]
    assert torch.equal(a, b)
    model.train()
    torch.manual_seed(1)
    c = model(x)[0]
    torch.manual_seed(2)
    d = model(x)[0]
    assert not torch.equal(c, d)
    torch.manual_seed(1)
    assert torch.equal(model(x)[0], c)  # same seed, same masks


def test_weight_drop_alone_is_active_in_training() -> None:
    no_drop = dict(dropout=0.0, dropout_h=0.0, dropout_i=0.0, dropout_e=0.0)
    x = _tokens()
    plain = _tiny(weight_drop=0.0, **no_drop)
    torch.testing.assert_close(plain.train()(x)[0], plain.eval()(x)[0])
    wd = _tiny(weight_drop=0.5, **no_drop)
    assert not torch.allclose(wd.train()(x)[0], wd.eval()(x)[0])
    # it is DropConnect: the layer output equals a plain LSTM run with a dropped matrix
    layer = WeightDropLSTM(E, H, weight_drop=0.5).train()
    inp = torch.randn(5, 2, E)
    h0 = (torch.zeros(1, 2, H), torch.zeros(1, 2, H))
    torch.manual_seed(3)
    out, _ = layer(inp, h0)
    torch.manual_seed(3)
    dropped = torch.nn.functional.dropout(layer.weight_hh_raw, 0.5, True)
    assert 0.3 < float((dropped == 0).float().mean()) < 0.7
    ref = torch.nn.LSTM(E, H)
    with torch.no_grad():
        ref.weight_ih_l0.copy_(layer.weight_ih)
        ref.weight_hh_l0.copy_(dropped)
        ref.bias_ih_l0.copy_(layer.bias_ih)
        ref.bias_hh_l0.copy_(layer.bias_hh)
    torch.testing.assert_close(out, ref(inp, h0)[0], rtol=1e-5, atol=1e-6)


def test_gradients_reach_raw_weights_and_tied_embedding() -> None:
    model = _tiny().train()
    x = _tokens()
    out, _, raw, dropped = model(x)
    loss = torch.nn.functional.cross_entropy(out.reshape(-1, V), x.roll(-1, 0).reshape(-1))
    (loss + ar_tar_loss(raw, dropped)).backward()
    for rnn in model.rnns:
        g = rnn.weight_hh_raw.grad
        assert g is not None and g.abs().sum() > 0
        assert ((g == 0).float().mean() > 0.2)  # the dropped entries get no gradient
    # tied: the decoder uses the embedding parameter itself, so words never fed in still get
    # a gradient (through the softmax) on the shared matrix
    assert model.decoder_weight is model.encoder.weight
    assert model.decoder_weight.data_ptr() == model.encoder.weight.data_ptr()
    unused = sorted(set(range(V)) - set(x.flatten().tolist()))
    assert unused and model.encoder.weight.grad[unused].abs().sum() > 0
    assert "decoder_bias" in dict(model.named_parameters())
    assert not any("decoder" in k and "bias" not in k for k in model.state_dict())


def test_untied_variant() -> None:
    model = _tiny(tie_weights=False)
    assert model.decoder_weight is not model.encoder.weight
    assert model.rnns[-1].hidden_size == H
    assert model(_tokens())[0].shape == (9, 3, V)


def test_ar_tar_loss_value() -> None:
    raw = [torch.randn(6, 2, 4), torch.randn(6, 2, 3)]
    dropped = [torch.randn(6, 2, 4), torch.randn(6, 2, 3)]
    expected = 2.0 * dropped[-1].pow(2).mean() + 1.0 * (raw[-1][1:] - raw[-1][:-1]).pow(2).mean()
    torch.testing.assert_close(ar_tar_loss(raw, dropped), expected)
    torch.testing.assert_close(ar_tar_loss(raw, dropped, alpha=0.0, beta=0.0), torch.tensor(0.0))


def test_fused_and_loop_kernels_agree() -> None:
    fused = _tiny(impl="fused")
    loop = copy.deepcopy(fused)
    for r in loop.rnns:
        r.impl = "loop"
    x = _tokens()
    for mode in ("eval", "train"):
        getattr(fused, mode)()
        getattr(loop, mode)()
        torch.manual_seed(4)
        a = fused(x)[0]
        torch.manual_seed(4)
        b = loop(x)[0]
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_vmap_over_stacked_copies_matches_separate_runs() -> None:
    models = [_tiny().eval(), AWDLSTM(V, emb_size=E, hidden_size=H).eval()]
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = _tokens()
    out = vmap(lambda p, xb: functional_call(base, p, (xb,))[0], in_dims=(0, None))(params, x)
    torch.testing.assert_close(out, torch.stack([m(x)[0] for m in models]), rtol=1e-5, atol=1e-6)
    base.train()  # training mode draws per-copy masks
    out = vmap(lambda p, xb: functional_call(base, p, (xb,))[0], in_dims=(0, None), randomness="different")(params, x)
    assert out.shape == (2, 9, 3, V)


def test_presets() -> None:
    with torch.device("meta"):
        ptb, wt2 = awd_lstm(10, "ptb"), awd_lstm(10, "wikitext2")
    assert (ptb.dropout_h, ptb.dropout_i) == (0.25, 0.4)
    assert (wt2.dropout_h, wt2.dropout_i) == (0.2, 0.4)
    with pytest.raises(ValueError):
        awd_lstm(10, "enwik8")
    with pytest.raises(ValueError):
        WeightDropLSTM(4, 4, impl="cudnn")
