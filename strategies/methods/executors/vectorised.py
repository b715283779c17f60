"""Vectorised clients: n copies of one model stacked along dim 0 and stepped together.

Every parameter and buffer of the model is held as one tensor [n, ...] (client k's copy is
``[k]``). One local step of all n clients is ``torch.func.vmap`` over

    grad(loss)(params_k, buffers_k, batch_k)  ->  the method's step rule (clipped_sgd_step for CELGC)

so each client has its own minibatch, its own gradient norm and clipping decision and its own
BatchNorm running statistics (the forward updates copies of the client's buffers made inside
the transformed function, which are returned), with no Python loop over clients and no host
sync. The update math is the rule itself (``strategies.core.local_update.Rule``), unchanged, under
vmap; a rule's per-client tensors (``extra``, e.g. SCAFFOLD's correction) are stacked and
mapped along with the clients.

Switches (each checked against the fp32 eager path by the tests):

* ``bf16``: the forward runs under ``torch.autocast(bfloat16)`` with BatchNorm layers fed
  fp32 (as mixed-precision training keeps them); parameters, gradients and the update stay
  fp32;
* ``channels_last``: 4-d weights are kept channels-last per client and image batches are
  laid out so that vmap's grouped convolution reads them channels-last;
* ``cuda_graphs``: the whole vmapped step (forward, backward, update, metric sums) is
  captured once into a CUDA graph and replayed; the schedule's lr/clip factor is a device
  tensor, so one capture serves the whole run.

Models vmap cannot take (``nn.LSTM`` has no batching rule, random ops under the default
``randomness="error"``) are detected by ``probe`` and run by ``sequential.py`` instead.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils import _pytree as pytree

from ...core.clipped_sgd import StepConfig
from ...core.local_update import RoundStats, Rule, clipped_rule, default_count

LossFn = Callable[[nn.Module, Any], Tensor]
Count = Callable[[Any], int]


class _LossModule(nn.Module):
    """``loss_fn(model, batch)`` as a module, so ``functional_call`` can swap the weights."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Tensor:
        return self.loss_fn(self.model, batch)


def stack_batches(batches: list[Any]) -> tuple[Any, Tensor | None]:
    """Per-client batches -> one batch with a leading client dim, and the per-client
    ``lr_scale`` (a [n] tensor) when the batches carry one."""
    stacked = pytree.tree_map(lambda *xs: torch.stack(xs), *batches)
    scales = [getattr(b, "lr_scale", None) for b in batches]
    if all(s is None for s in scales):
        return stacked, None
    device = pytree.tree_leaves(stacked)[0].device
    return stacked, torch.tensor([1.0 if s is None else float(s) for s in scales], device=device)


def _inputs_to_fp32(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _client_channels_last(t: Tensor) -> Tensor:
    """[n, O, I, kh, kw] with every client's slice channels-last."""
    n, o, i, kh, kw = t.shape
    return t.new_empty((n, o, kh, kw, i)).permute(0, 1, 4, 2, 3)


def _grouped_channels_last(x: Tensor) -> Tensor:
    """[n, b, C, H, W] laid out as [b, H, W, n, C] in memory: the channels-last input of the
    grouped convolution vmap turns a batched conv2d into."""
    return x.permute(1, 3, 4, 0, 2).contiguous().permute(3, 0, 4, 1, 2)


class VmapClients:
    """``n`` clients of one model, stacked and stepped together with ``torch.func``.

    ``model`` is the template (on the engine's device) whose structure is used; its own
    weights are never read after ``load``. ``loss_fn(model, batch)`` is the task's training
    loss; ``count(batch)`` the examples of one client's batch.
    """

    path = "vmap"
    vectorised = True

    def __init__(
        self, model: nn.Module, loss_fn: LossFn, n: int, *, count: Count = default_count, bf16: bool = False,
        channels_last: bool = False, cuda_graphs: bool = False, randomness: str = "error",
    ) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1 clients, got {n}")
        self.model = model
        self.n = n
        self.count = count
        self.device = next(iter(model.state_dict().values())).device
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"engine-cuda-graphs needs a CUDA device, the engine runs on {self.device}")
        self.bf16 = bf16
        self.channels_last = channels_last
        self.cuda_graphs = cuda_graphs
        self.randomness = randomness
        self._wrapper = _LossModule(model, loss_fn)
        if bf16:  # normalisation layers in fp32 (also what vmap's batch-norm backward needs)
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._NormBase):
                    module.register_forward_pre_hook(_inputs_to_fp32)
        self.trainable = [k for k, p in model.named_parameters() if p.requires_grad]
        self.others = [k for k, p in model.named_parameters() if not p.requires_grad]
        self.others += [k for k, _ in model.named_buffers()]
        self.keys = list(model.state_dict())
        self.params: dict[str, Tensor] = {}
        self.buffers: dict[str, Tensor] = {}
        self._graph: _GraphedStep | None = None

    # --- state -----------------------------------------------------------------------
    def load(self, state: Mapping[str, Tensor]) -> None:
        """Every client starts from ``state`` (the global model; missing keys: the template's)."""
        template = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        for names, target in ((self.trainable, self.params), (self.others, self.buffers)):
            for k in names:
                src = (state[k] if k in state else template[k]).detach().to(self.device)
                if k not in target:
                    if self.channels_last and src.dim() == 4 and src.is_floating_point():
                        target[k] = _client_channels_last(src.unsqueeze(0).expand(self.n, *src.shape))
                    else:
                        target[k] = torch.empty((self.n, *src.shape), dtype=src.dtype, device=self.device)
                target[k].copy_(src.unsqueeze(0).expand_as(target[k]))

    def stacked_state(self) -> dict[str, Tensor]:
        """The clients' states, state-dict keys -> [n, ...]."""
        both = {**self.params, **self.buffers}
        return {k: both[k] for k in self.keys}

    client_states = stacked_state  # what the end of a round averages

    def subset(self, positions: list[int]) -> VmapClients:
        """All the clients (an exchange of only some of the stacked clients is not supported)."""
        if list(positions) != list(range(self.n)):
            raise ValueError("the vectorised clients run an exchange with all of them; a method that leaves some "
                             "clients out of an exchange runs them one after another (engine-path = sequential)")
        return self

    # --- the functional step ---------------------------------------------------------
    def _loss(self, params: dict[str, Tensor], buffers: dict[str, Tensor], batch: Any):
        buffers = {k: v.clone() for k, v in buffers.items()}  # BatchNorm updates these in place
        weights = {f"model.{k}": v for k, v in (params | buffers).items()}
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False) if self.bf16
                    else contextlib.nullcontext())  # no weight-cast cache: required under CUDA-graph capture
        with autocast:
            loss = functional_call(self._wrapper, weights, (batch,))
        loss = loss.float()
        return loss, (loss.detach(), buffers)

    def _client_step(self, params, buffers, bufs, batch, scale, extra, cfg: StepConfig, lr_scale, rule: Rule):
        grads, (loss, buffers) = grad(self._loss, has_aux=True)(params, buffers, batch)
        names = self.trainable
        scale = lr_scale if scale is None else scale * lr_scale
        new, new_bufs, stats = rule([params[k] for k in names], [grads[k] for k in names], list(bufs) or None, cfg,
                                    scale, list(extra) if extra else None)
        return dict(zip(names, new, strict=True)), buffers, list(new_bufs or []), loss, stats

    def _vstep(self, cfg: StepConfig, lr_scale: float | Tensor, with_scale: bool, rule: Rule = clipped_rule):
        if not rule.vmappable:
            raise ValueError("this step rule cannot run under torch.func.vmap (it reads values on the host): "
                             "run its clients one after another (engine-path = sequential)")
        fn = partial(self._client_step, cfg=cfg, lr_scale=lr_scale, rule=rule)
        return vmap(fn, in_dims=(0, 0, 0, 0, 0 if with_scale else None, 0), randomness=self.randomness)

    def _stack_extra(self, extra: list[list[Tensor]] | None) -> list[Tensor]:
        """Per-client tensors (client -> one per trainable parameter) stacked along the clients."""
        if extra is None:
            return []
        if len(extra) != self.n:
            raise ValueError(f"extra tensors for {len(extra)} clients, {self.n} clients run")
        return [torch.stack([e[j].to(self.device) for e in extra]) for j in range(len(self.trainable))]

    def _prepare(self, batch: Any) -> Any:
        if self.channels_last:
            return pytree.tree_map(lambda t: _grouped_channels_last(t) if t.dim() == 5 and t.is_floating_point()
                                   else t, batch)
        return batch

    # --- a round ---------------------------------------------------------------------
    def run_round(self, iters: list[Iterator[Any]], cfg: StepConfig, lr_scale: float | Tensor = 1.0,
                  rule: Rule = clipped_rule, extra: list[list[Tensor]] | None = None) -> RoundStats:
        """Run every step of one round; ``iters`` are the n clients' batch iterators (one
        batch a step). Returns the round's sums as a ``RoundStats`` of [n] tensors.

        ``lr_scale`` multiplies lr and clip (the schedule's factor). With CUDA graphs the
        step is captured once, with the first round's ``cfg``: pass the run's base
        hyper-parameters as ``cfg`` and the round's factor as ``lr_scale``. ``rule``: the
        method's local step; ``extra``: each client's tensors it reads (one per trainable
        parameter).
        """
        stacked_extra = self._stack_extra(extra)
        zeros = lambda: torch.zeros(self.n, dtype=torch.float64, device=self.device)  # noqa: E731
        totals = RoundStats(zeros(), zeros(), zeros(), zeros())
        if self.device.type == "cuda" and not torch.is_tensor(lr_scale):  # lr, clip on the device: no copy a step
            lr_scale = torch.full((), float(lr_scale), device=self.device)
        bufs = [torch.zeros_like(self.params[k]) for k in self.trainable] if cfg.momentum > 0 and not self.cuda_graphs \
            else []
        for batches in zip(*iters, strict=True):
            batches = list(batches)
            batch, scale = stack_batches(batches)
            examples = self.count(batches[0])
            if self.cuda_graphs:
                if self._graph is None:
                    self._graph = _GraphedStep(self, cfg, self._prepare(batch), scale, rule, stacked_extra)
                self._graph.step(self._prepare(batch), scale, lr_scale, totals, examples, stacked_extra)
                continue
            self.params, self.buffers, bufs, loss, stats = self._vstep(cfg, lr_scale, scale is not None, rule)(
                self.params, self.buffers, bufs, self._prepare(batch), scale, stacked_extra)
            totals.add(loss, stats, examples)
        return totals

    def gradients(self, iters: list[Iterator[Any]], seed: Any = None,
                  ) -> tuple[dict[str, Tensor], Tensor, Tensor | None, Tensor, Tensor | None]:
        """Each client's gradient at its own state on its next batch (naive parallel clipping):
        (grads [n, ...] per trainable parameter, loss [n], lr_scale [n] or None, examples [n],
        None: no separate cross-entropy on this path). The clients' buffers are left as the
        forward pass updated them. ``seed`` is unused (random models take the sequential path)."""
        batches = [next(it) for it in iters]
        batch, scale = stack_batches(batches)
        grads, (loss, buffers) = vmap(grad(self._loss, has_aux=True), randomness=self.randomness)(
            self.params, self.buffers, self._prepare(batch))
        self.buffers = buffers
        examples = torch.tensor([float(self.count(b)) for b in batches], dtype=torch.float64, device=self.device)
        if scale is not None:
            scale = scale.double()
        return grads, loss, scale, examples, None

    def probe(self, batches: list[Any], cfg: StepConfig) -> str | None:
        """Why this model cannot run vectorised (None if it can): one step, results dropped."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                batch, scale = stack_batches(batches)
                bufs = [torch.zeros_like(self.params[k]) for k in self.trainable] if cfg.momentum > 0 else []
                self._vstep(cfg, 1.0, scale is not None)(self.params, self.buffers, bufs, self._prepare(batch), scale,
                                                         [])
            except Exception as exc:  # any failure means: take the per-client path
                return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        slow = [str(w.message) for w in caught if "batching rule" in str(w.message)]
        if slow:
            return f"no vmap batching rule ({slow[0].split('batching rule for ')[-1].split('.')[0]})"
        return None


class _GraphedStep:
    """The vmapped step of ``VmapClients`` captured into one CUDA graph."""

    def __init__(self, clients: VmapClients, cfg: StepConfig, batch: Any, scale: Tensor | None, rule: Rule,
                 extra: list[Tensor]) -> None:
        self.c = clients
        self.batch = pytree.tree_map(lambda t: t.clone(memory_format=torch.preserve_format), batch)
        self.scale = None if scale is None else scale.clone()
        self.extra = [t.clone() for t in extra]
        self.lr_scale = torch.ones((), dtype=torch.float32, device=clients.device)
        zeros = lambda: torch.zeros(clients.n, dtype=torch.float64, device=clients.device)  # noqa: E731
        self.totals = RoundStats(zeros(), zeros(), zeros(), zeros())
        self.bufs = [torch.zeros_like(clients.params[k]) for k in clients.trainable] if cfg.momentum > 0 else []
        self.fn = clients._vstep(cfg, self.lr_scale, scale is not None, rule)
        state = [*clients.params.values(), *clients.buffers.values()]
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream(clients.device)
        side.wait_stream(torch.cuda.current_stream(clients.device))
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up (allocator, cuBLAS/cuDNN plans) before capture
                self._body()
        torch.cuda.current_stream(clients.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()
        torch._foreach_copy_(state, saved)  # warm-up and capture changed the state: undo

    def _body(self) -> None:
        c = self.c
        params, buffers, bufs, loss, stats = self.fn(c.params, c.buffers, self.bufs, self.batch, self.scale, self.extra)
        torch._foreach_copy_(list(c.params.values()), list(params.values()))
        torch._foreach_copy_(list(c.buffers.values()), [buffers[k] for k in c.buffers])
        if bufs:
            torch._foreach_copy_(self.bufs, bufs)
        self.totals.add(loss, stats, 0)

    def step(self, batch: Any, scale: Tensor | None, lr_scale: float | Tensor, totals: RoundStats,
             examples: int, extra: list[Tensor]) -> None:
        if totals.steps == 0:  # a new round: fresh sums and momentum
            for t in (self.totals.loss_sum, self.totals.grad_norm_sum, self.totals.clipped, self.totals.skipped):
                t.zero_()
            for b in self.bufs:
                b.zero_()
            totals.loss_sum, totals.grad_norm_sum = self.totals.loss_sum, self.totals.grad_norm_sum
            totals.clipped, totals.skipped = self.totals.clipped, self.totals.skipped
        pytree.tree_map(lambda dst, src: dst.copy_(src), self.batch, batch)
        if extra:
            torch._foreach_copy_(self.extra, extra)
        if scale is not None:
            self.scale.copy_(scale)
        if torch.is_tensor(lr_scale):
            self.lr_scale.copy_(lr_scale)
        else:
            self.lr_scale.fill_(lr_scale)
        self.graph.replay()
        totals.steps += 1
        totals.examples += examples
