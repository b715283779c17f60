"""AWD-LSTM word language model (Merity, Keskar and Socher, ICLR 2018).

A 3-layer LSTM (embedding 400, hidden 1150; the last layer's hidden size is 400 so its
output can use the embedding matrix as decoder), regularised by

* weight drop (DropConnect, p=0.5) on each layer's hidden-to-hidden matrix: the raw matrix
  ``weight_hh_raw`` is the only parameter; every forward draws a fresh dropout mask over its
  entries and runs the layer functionally with the dropped matrix (one mask per forward,
  shared by all time steps and sequences, as DropConnect prescribes). Nothing derived is
  registered or written back, so ``torch.func.functional_call`` and state dicts see the raw
  weights only;
* embedding dropout (p=0.1): whole rows (words) of the embedding matrix are zeroed and the
  rest rescaled by 1/(1-p), one mask per forward;
* locked (variational) dropout: one mask per sequence, shared over time, on the embedded
  input (``dropout_i``, 0.4 PTB), between LSTM layers (``dropout_h``, 0.25 PTB / 0.2 WT2)
  and on the last layer's output (``dropout``, 0.4);
* tied weights: the decoder is ``F.linear(h, encoder.weight, decoder_bias)``; the decoder
  weight IS the embedding parameter (``model.decoder_weight is model.encoder.weight``), so
  the state dict holds it once;
* activation regularisation (AR, alpha=2) on the dropped last-layer output and temporal
  activation regularisation (TAR, beta=1) on its raw output: ``ar_tar_loss``.

``forward(tokens [T, B], hidden)`` returns ``(output, new_hidden, raw_outputs,
dropped_outputs)``:

* ``output``: [T, B, V] logits (log-probabilities with ``log_probs=True``);
* ``new_hidden``: a list with one ``(h, c)`` per layer, each [1, B, H_l] (detach it before
  the next truncated-BPTT window: ``detach_hidden``);
* ``raw_outputs``: per layer the LSTM output [T, B, H_l] before any dropout;
* ``dropped_outputs``: per layer the output after its locked dropout (``dropout_h`` for the
  inner layers, ``dropout`` for the last), i.e. what the next layer / the decoder got.

All randomness is ``torch.nn.functional.dropout`` (the global or vmap RNG); in ``eval()``
mode nothing is dropped and the model is deterministic. With a 10,000-word vocabulary
(PTB) the model has 24,221,600 parameters; 33,278 words (WikiText-2): 33,556,078.

Two LSTM kernels: ``impl='fused'`` calls ``torch.lstm`` (cuDNN on a GPU) with the dropped
weights; ``impl='loop'`` is a plain per-time-step cell loop of the same equations (made only
of matmuls and elementwise ops, so it runs under ``torch.func.vmap``, where ``torch.lstm``
has no batching rule). ``impl='auto'`` (default) takes the loop when the input or a weight
is a vmap-batched tensor and the fused kernel otherwise.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "AWDLSTM",
    "Hidden",
    "WeightDropLSTM",
    "ar_tar_loss",
    "awd_lstm",
    "detach_hidden",
    "embedded_dropout",
    "locked_dropout",
]

Hidden = list[tuple[Tensor, Tensor]]
IMPLS = ("auto", "fused", "loop")


def locked_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Variational dropout of ``x`` [T, B, H]: one mask per (batch, feature), shared over T."""
    if not training or p == 0.0:
        return x
    mask = F.dropout(torch.ones_like(x[:1]), p, True)  # [1, B, H], entries 0 or 1/(1-p)
    return x * mask


def embedded_dropout(weight: Tensor, tokens: Tensor, p: float, training: bool) -> Tensor:
    """Embedding lookup with whole rows (words) of ``weight`` dropped with probability ``p``."""
    if training and p > 0.0:
        mask = F.dropout(weight.new_ones(weight.shape[0], 1), p, True)  # [V, 1]
        weight = weight * mask
    return F.embedding(tokens, weight)


def _in_vmap(*tensors: Tensor) -> bool:
    """True inside ``torch.func.vmap`` (also under a ``grad`` nested in it)."""
    try:
        from torch._C._functorch import TransformType  # noqa: PLC0415
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters  # noqa: PLC0415

        return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())
    except (ImportError, AttributeError):  # private API moved: fall back to the tensors
        check = getattr(getattr(torch._C, "_functorch", None), "is_batchedtensor", None)
        return check is not None and any(check(t) for t in tensors)


def _lstm_loop(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor):
    """Reference LSTM (PyTorch gate order i, f, g, o). x [T, B, I]; h, c [B, H]."""
    pre = F.linear(x, w_ih, b_ih + b_hh)  # input part of all gates, all steps at once
    outs = []
    for t in range(x.shape[0]):
        gates = pre[t] + F.linear(h, w_hh)
        i, f, g, o = gates.chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h)
    return torch.stack(outs), h, c


class WeightDropLSTM(nn.Module):
    """One LSTM layer whose hidden-to-hidden matrix gets DropConnect each forward.

    Parameters: ``weight_ih`` [4H, I], ``weight_hh_raw`` [4H, H], ``bias_ih``, ``bias_hh``
    [4H] (gate order i, f, g, o, initialised like ``nn.LSTM``).
    """

    def __init__(self, input_size: int, hidden_size: int, weight_drop: float = 0.5, impl: str = "auto") -> None:
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
        if not 0.0 <= weight_drop < 1.0:
            raise ValueError(f"weight_drop must be in [0, 1), got {weight_drop}")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.weight_drop = weight_drop
        self.impl = impl
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh_raw = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.empty(4 * hidden_size))
        self.bias_hh = nn.Parameter(torch.empty(4 * hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def forward(self, x: Tensor, hidden: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """x [T, B, I], hidden (h, c) each [1, B, H] -> output [T, B, H], (h, c)."""
        w_hh = F.dropout(self.weight_hh_raw, self.weight_drop, self.training)
        h0, c0 = hidden
        weights = [self.weight_ih, w_hh, self.bias_ih, self.bias_hh]
        fused = self.impl == "fused" or (self.impl == "auto" and not _in_vmap(x, h0, c0, *weights))
        if fused:
            out, h, c = torch.lstm(x, (h0, c0), weights, True, 1, 0.0, self.training, False, False)
            return out, (h, c)
        out, h, c = _lstm_loop(x, h0[0], c0[0], self.weight_ih, w_hh, self.bias_ih, self.bias_hh)
        return out, (h.unsqueeze(0), c.unsqueeze(0))

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, weight_drop={self.weight_drop}, impl={self.impl!r}"


class AWDLSTM(nn.Module):
    """AWD-LSTM language model; see the module docstring for the regularisers and outputs.

    Defaults are the PTB setting; for WikiText-2 the paper's setting differs only in
    ``dropout_h=0.2`` (input dropout 0.4 for both, as specified for this project).
    """

    def __init__(
        self,
        vocab_size: int,
        emb_size: int = 400,
        hidden_size: int = 1150,
        num_layers: int = 3,
        dropout: float = 0.4,
        dropout_h: float = 0.25,
        dropout_i: float = 0.4,
        dropout_e: float = 0.1,
        weight_drop: float = 0.5,
        tie_weights: bool = True,
        impl: str = "auto",
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        rates = {"dropout": dropout, "dropout_h": dropout_h, "dropout_i": dropout_i, "dropout_e": dropout_e}
        for name, p in rates.items():
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p}")
        self.vocab_size = vocab_size
        self.emb_size = emb_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.dropout, self.dropout_h, self.dropout_i, self.dropout_e = dropout, dropout_h, dropout_i, dropout_e
        self.tie_weights = tie_weights
        last = emb_size if tie_weights else hidden_size
        self.layer_sizes = [hidden_size] * (num_layers - 1) + [last]
        self.encoder = nn.Embedding(vocab_size, emb_size)
        ins = [emb_size] + self.layer_sizes[:-1]
        self.rnns = nn.ModuleList(
            WeightDropLSTM(i, h, weight_drop, impl) for i, h in zip(ins, self.layer_sizes, strict=True)
        )
        if not tie_weights:
            self.decoder_weight_untied = nn.Parameter(torch.empty(vocab_size, last))
        self.decoder_bias = nn.Parameter(torch.zeros(vocab_size))
        self.reset_parameters()

    @property
    def decoder_weight(self) -> Tensor:
        """The output projection [V, E]: the embedding matrix itself when tied."""
        return self.encoder.weight if self.tie_weights else self.decoder_weight_untied

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        if not self.tie_weights:
            nn.init.uniform_(self.decoder_weight_untied, -0.1, 0.1)
        nn.init.zeros_(self.decoder_bias)
        for rnn in self.rnns:
            rnn.reset_parameters()

    def init_hidden(self, batch_size: int) -> Hidden:
        """Zero ``(h, c)`` per layer, each [1, batch_size, H_l], on the model's device/dtype."""
        w = self.encoder.weight
        return [
            (w.new_zeros(1, batch_size, h), w.new_zeros(1, batch_size, h)) for h in self.layer_sizes
        ]

    def forward(
        self, tokens: Tensor, hidden: Hidden | None = None, log_probs: bool = False
    ) -> tuple[Tensor, Hidden, list[Tensor], list[Tensor]]:
        """tokens [T, B] int64 -> (output [T, B, V], new_hidden, raw_outputs, dropped_outputs)."""
        if hidden is None:
            hidden = self.init_hidden(tokens.shape[1])
        x = embedded_dropout(self.encoder.weight, tokens, self.dropout_e, self.training)
        x = locked_dropout(x, self.dropout_i, self.training)
        new_hidden: Hidden = []
        raw_outputs: list[Tensor] = []
        dropped_outputs: list[Tensor] = []
        for layer, rnn in enumerate(self.rnns):
            out, h = rnn(x, hidden[layer])
            new_hidden.append(h)
            raw_outputs.append(out)
            p = self.dropout if layer == self.num_layers - 1 else self.dropout_h
            x = locked_dropout(out, p, self.training)
            dropped_outputs.append(x)
        logits = F.linear(x, self.decoder_weight, self.decoder_bias)
        output = F.log_softmax(logits, dim=-1) if log_probs else logits
        return output, new_hidden, raw_outputs, dropped_outputs


def ar_tar_loss(
    raw_outputs: list[Tensor], dropped_outputs: list[Tensor], alpha: float = 2.0, beta: float = 1.0
) -> Tensor:
    """AR + TAR of Merity et al.: ``alpha * mean(d^2) + beta * mean((r_t+1 - r_t)^2)`` with
    ``d`` the dropped and ``r`` the raw output [T, B, H] of the last layer. Add to the
    cross-entropy in training only."""
    dropped, raw = dropped_outputs[-1], raw_outputs[-1]
    ar = dropped.pow(2).mean()
    tar = (raw[1:] - raw[:-1]).pow(2).mean() if raw.shape[0] > 1 else raw.new_zeros(())
    return alpha * ar + beta * tar


def detach_hidden(hidden: Hidden) -> Hidden:
    """The hidden state cut from the graph (truncated BPTT across windows)."""
    return [(h.detach(), c.detach()) for h, c in hidden]


def awd_lstm(vocab_size: int, corpus: str = "ptb", **overrides) -> AWDLSTM:
    """AWD-LSTM with the dropout setting of Merity et al. for ``corpus`` ('ptb', 'wikitext2')."""
    presets = {
        "ptb": {"dropout": 0.4, "dropout_h": 0.25, "dropout_i": 0.4, "dropout_e": 0.1, "weight_drop": 0.5},
        "wikitext2": {"dropout": 0.4, "dropout_h": 0.2, "dropout_i": 0.4, "dropout_e": 0.1, "weight_drop": 0.5},
    }
    if corpus not in presets:
        raise ValueError(f"unknown corpus {corpus!r}; known: {', '.join(presets)}")
    return AWDLSTM(vocab_size, **{**presets[corpus], **overrides})
