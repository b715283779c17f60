"""Engine speed: seconds per round of N clients, every method measured side by side in one run.

Claim under test (targets from issue 4, one H200, ResNet-56, 8 clients x batch 64): the
local step of all clients with the engine (vmap + CUDA graph) within 2x of ONE model at batch
8 x 64 under the same precision and graphs, >= 8x faster than clients one after another in
plain eager PyTorch, and per-round overhead (averaging, bookkeeping) < 5% of compute at I = 8.
On the CPU: the engine no slower than the plain loop.

Methods (rounds interleaved method by method; after one warm-up round, the best of --repeats
rounds is reported, with the median beside it; on the CPU the clock is this process's CPU
time by default, which other work on a shared machine disturbs far less than wall time):

* plain loop   -- what a user would write: per client load_state_dict, SGD + clip_grad_norm_
                  (= the clipped step for weight decay 0), then a key-by-key mean;
* engine seq   -- the engine's per-client path (one module per client; CUDA streams on GPU);
* engine vmap  -- the engine's vectorised path (fp32; +bf16, +CUDA graphs, +channels-last on GPU);
* one model    -- ONE model at batch N*b, the same I steps (same FLOPs: the practical limit).

Settings: ``digits`` (the default task, real data), ``cifar10`` (ResNet-56 on synthetic
CIFAR-shaped uint8 images with the real normalisation and crop/flip augmentation; seconds per
global epoch use the real 50,000 training images), ``ptb`` (AWD-LSTM at PTB size on a synthetic
929,589-token stream, 10,000 words; bptt 70).

    python benchmarks/engine_speed.py --setting digits --threads 1
    python benchmarks/engine_speed.py --setting cifar10 --local-steps 8      # on a GPU
    python benchmarks/engine_speed.py --setting ptb --local-steps 2 --repeats 1
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulations.engine import Engine, EngineOptions  # noqa: E402
from simulations.engine.distributed import World  # noqa: E402
from strategies.core.clipped_sgd import StepConfig, clipped_sgd_step  # noqa: E402
from strategies.core.settings import Mode  # noqa: E402
from strategies.methods import build  # noqa: E402
from strategies.methods.algorithm import Exchange  # noqa: E402
from tasks import initial_model  # noqa: E402
from tasks.config import RunConfig  # noqa: E402
from tasks.partition import partition  # noqa: E402

CIFAR_TRAIN = 50_000
PTB_TOKENS = 929_589


# --------------------------------------------------------------------------- settings
def digits_setting(args):
    from tasks.digits import digits_task

    return digits_task(), "digits", None


def cifar_setting(args):
    from tasks.cifar import normalize
    from tasks.cifar_task import augment
    from tasks.classification import ClassificationTask
    from tasks.resnet import cifar_resnet

    n = max(args.clients * args.batch * 4, 1024)  # enough for every client's partition; timing only
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (n,), generator=g)
    task = ClassificationTask(name="synthetic-cifar10", train_x=images, train_y=labels, test_x=images[:512],
                              test_y=labels[:512], num_classes=10, build_model=lambda: cifar_resnet(args.depth, 10),
                              augment=augment, transform=normalize, eval_batch_size=500)
    return task, "cifar10", CIFAR_TRAIN


def ptb_setting(args):
    from tasks.language import DROPOUTS, MODEL_SIZES, LanguageModelTask
    from tasks.text import Corpus, Vocab

    g = torch.Generator().manual_seed(0)
    vocab = Vocab([f"w{i}" for i in range(9_999)] + ["<eos>"])
    stream = torch.randint(0, len(vocab), (PTB_TOKENS,), generator=g)
    corpus = Corpus(stream, stream[:10_000], stream[:10_000], vocab)
    task = LanguageModelTask(name="ptb", corpus=corpus, model_kwargs={**MODEL_SIZES["ptb"], **DROPOUTS["ptb"]})
    return task, "ptb", task.train_size


SETTINGS = {"digits": digits_setting, "cifar10": cifar_setting, "ptb": ptb_setting}


def client_parts(task, cfg):
    if hasattr(task, "client_partitions"):
        return list(task.client_partitions(cfg))
    return partition(task.labels, cfg.num_clients, "homogeneous", cfg.seed)


# --------------------------------------------------------------------------- methods
def round_hparams(cfg: RunConfig, r: int, train_size: int) -> tuple[float, float]:
    """(lr, clip) of round ``r``: the method's schedule (every backend's)."""
    return build(cfg.algorithm, cfg.hyper, train_size=train_size, per_round=cfg.per_round).round_hparams(r)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PlainLoop:
    """Clients one after another, in the plain PyTorch a user would write."""

    name = "plain loop (eager, one client after another)"

    def __init__(self, task, parts, cfg, device):
        self.task, self.parts, self.cfg, self.device = task, parts, cfg, device
        self.model = initial_model(task, cfg.seed).to(device)
        self.state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.count = getattr(task, "count_examples", None)

    def round(self, r: int) -> None:
        lr, clip = round_hparams(self.cfg, r, self.task.train_size)
        states = []
        for pid, part in enumerate(self.parts):
            self.model.load_state_dict(self.state)
            self.model.train()
            opt = torch.optim.SGD(self.model.parameters(), lr=lr)
            for batch in self.task.round_batches(part, seed=self.cfg.seed, partition_id=pid, server_round=r,
                                                 local_steps=self.cfg.local_steps, batch_size=self.cfg.batch_size,
                                                 device=self.device):
                opt.zero_grad(set_to_none=True)
                self.task.loss(self.model, batch).backward()
                if math.isfinite(clip):
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip / lr)
                opt.step()
            states.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        self.state = {k: (torch.stack([s[k].double() for s in states]).mean(0)).to(v.dtype)
                      if v.is_floating_point() else torch.stack([s[k].double() for s in states]).mean(0).round().to(v.dtype)
                      for k, v in states[0].items()}


class EngineMethod:
    def __init__(self, name, task, parts, cfg, options):
        self.name = name
        self.engine = Engine(cfg, options, World(), task=task, parts=parts)
        self.steps_time: list[float] = []

    def round(self, r: int) -> None:
        self.engine.train_round(r)

    def steps_only(self, r: int, clock=time.perf_counter) -> float:
        """The clients' I local steps of round ``r`` alone (the method's client side, no averaging)."""
        e = self.engine
        e.round_clients = e._participants(r)
        lr, clip = e.algorithm.round_hparams(r)
        exchange = Exchange(e.algorithm.round_settings(r, Mode.LOCAL, lr, clip), list(e.round_clients), e.state)
        sync(e.device)
        t0 = clock()
        e.run_exchange(exchange)
        sync(e.device)
        return clock() - t0


class OneModel:
    """ONE model at batch N*b: I clipped steps (same FLOPs as one local step of all clients)."""

    def __init__(self, task, cfg, device, bf16=False, graphs=False):
        self.name = "one model at batch N*b" + (" + bf16" if bf16 else "") + (" + CUDA graph" if graphs else "")
        self.task, self.cfg, self.device, self.bf16 = task, cfg, device, bf16
        self.model = initial_model(task, cfg.seed).to(device).train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        n = len(task.train_y) if hasattr(task, "train_y") else None
        self.part = np.arange(n) if n is not None else torch.cat(client_parts(task, cfg))
        self.graph = None
        self.graphs = graphs
        self.one = torch.ones((), device=device)

    def _step(self, batch, lr):
        ctx = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else torch.autocast(
            self.device.type, enabled=False)
        with ctx:
            loss = self.task.loss(self.model, batch)
        grads = torch.autograd.grad(loss.float(), self.params)
        with torch.no_grad():  # lr, clip as device tensors (a CUDA graph cannot copy from the host)
            new, _, _ = clipped_sgd_step(self.params, list(grads), None, StepConfig(lr=lr, clip=self.cfg.clip),
                                         lr_scale=self.one)
            torch._foreach_copy_(self.params, new)

    def round(self, r: int) -> None:
        lr, _ = round_hparams(self.cfg, r, self.task.train_size)
        batches = self.task.round_batches(self.part, seed=self.cfg.seed, partition_id=0, server_round=r,
                                          local_steps=self.cfg.local_steps,
                                          batch_size=self.cfg.batch_size * self.cfg.num_clients, device=self.device)
        for batch in batches:
            if not self.graphs:
                self._step(batch, lr)
                continue
            if self.graph is None:
                self.static = [t.clone() for t in batch]
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        self._step(self.static, lr)
                torch.cuda.current_stream().wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    self._step(self.static, lr)
            for dst, src in zip(self.static, batch, strict=True):
                dst.copy_(src)
            self.graph.replay()


# --------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=sorted(SETTINGS), default="digits")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--batch", type=int, default=None, help="default: 32 digits, 64 cifar10, 3 ptb")
    p.add_argument("--local-steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="measured rounds per method (after a warm-up round)")
    p.add_argument("--depth", type=int, default=56, help="ResNet depth for cifar10 (56 = the paper)")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="wall time, or this process's CPU time (robust on a shared CPU; auto: cpu on the CPU, "
                        "wall on a GPU)")
    p.add_argument("--methods", default="all", help="comma list of: plain,seq,vmap,vmap-bf16,graphs,graphs-bf16,"
                   "graphs-bf16-cl,one,one-graphs,one-graphs-bf16")
    args = p.parse_args()
    batch = args.batch = args.batch or {"digits": 32, "cifar10": 64, "ptb": 3}[args.setting]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    task, task_key, nominal_train = SETTINGS[args.setting](args)
    cfg = RunConfig.from_mapping({"task": task_key, "num-clients": args.clients, "batch-size": batch,
                                  "local-steps": args.local_steps, "device": args.device, "num-rounds": 1000,
                                  "clip": 7.5 if task_key == "ptb" else 1.0, "lr": 30.0 if task_key == "ptb" else 0.3})
    device = torch.device("cuda" if args.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    parts = client_parts(task, cfg)
    cuda = device.type == "cuda"
    want = set(args.methods.split(",")) if args.methods != "all" else None

    def on(key: str, gpu_only: bool = False) -> bool:
        return (want is None or key in want) and (cuda or not gpu_only)

    methods = []
    if on("plain"):
        methods.append(("plain", PlainLoop(task, parts, cfg, device)))
    if on("seq"):
        methods.append(("seq", EngineMethod("engine seq (one module per client)", task, parts, cfg,
                                            EngineOptions(path="sequential"))))
    vmap_ok = task_key != "ptb"
    for key, name, opts, gpu in [
        ("vmap", "engine vmap fp32", EngineOptions(path="vmap"), False),
        ("vmap-bf16", "engine vmap bf16", EngineOptions(path="vmap", bf16=True), True),
        ("graphs", "engine vmap + CUDA graph fp32", EngineOptions(path="vmap", cuda_graphs=True), True),
        ("graphs-bf16", "engine vmap + CUDA graph bf16", EngineOptions(path="vmap", cuda_graphs=True, bf16=True), True),
        ("graphs-bf16-cl", "engine vmap + graph bf16 channels-last",
         EngineOptions(path="vmap", cuda_graphs=True, bf16=True, channels_last=True), True),
    ]:
        if vmap_ok and on(key, gpu):
            methods.append((key, EngineMethod(name, task, parts, cfg, opts)))
    if task_key != "ptb":
        if on("one"):
            methods.append(("one", OneModel(task, cfg, device)))
        if on("one-graphs", True):
            methods.append(("one-graphs", OneModel(task, cfg, device, graphs=True)))
        if on("one-graphs-bf16", True):
            methods.append(("one-graphs-bf16", OneModel(task, cfg, device, bf16=True, graphs=True)))

    print(f"# {args.setting}: {args.clients} clients x batch {batch}, I = {args.local_steps} local steps, "
          f"device {device}{' ' + torch.cuda.get_device_name(device) if cuda else ''}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads")
    for _key, m in methods:
        if isinstance(m, EngineMethod):
            print(f"#   {m.name}: {'; '.join(m.engine.notes)}")
    clock = time.perf_counter if (args.clock == "wall" or (args.clock == "auto" and cuda)) else time.process_time
    print(f"#   clock: {'wall time' if clock is time.perf_counter else 'process CPU time (all threads)'}")
    times: dict[str, list[float]] = {k: [] for k, _ in methods}
    steps: dict[str, list[float]] = {k: [] for k, m in methods if isinstance(m, EngineMethod)}
    for rep in range(args.repeats + 1):  # rep 0 warms up (compilation, graph capture, caches)
        for key, m in methods:
            sync(device)
            t0 = clock()
            m.round(rep + 1)
            sync(device)
            if rep:
                times[key].append(clock() - t0)
                if key in steps:
                    steps[key].append(m.steps_only(rep + 1, clock))
    med = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    base = med.get("plain")
    one = {"one": med.get("one"), "one-graphs": med.get("one-graphs"), "one-graphs-bf16": med.get("one-graphs-bf16")}
    ref_of = {"vmap": "one", "seq": "one", "plain": "one", "vmap-bf16": "one", "graphs": "one-graphs",
              "graphs-bf16": "one-graphs-bf16", "graphs-bf16-cl": "one-graphs-bf16"}
    print(f"\n{'method':44s} {'s/round':>9s} {'median':>9s} {'ms/step':>9s} {'plain/x':>8s} {'x/one':>7s} "
          f"{'overhead':>9s}")
    for key, m in methods:
        t = med[key]
        ref = one.get(ref_of.get(key, ""), None)
        over = ""
        if key in steps:
            s = min(steps[key])
            over = f"{100 * max(t - s, 0.0) / s:8.1f}%"
        print(f"{m.name:44s} {t:9.3f} {median[key]:9.3f} {1e3 * t / args.local_steps:9.1f} "
              f"{(base / t if base else float('nan')):8.2f} {(t / ref if ref else float('nan')):7.2f} {over:>9s}")
    print("\ns/round: best of the measured rounds; plain/x: speed-up over the plain loop;\n"
          "x/one: time relative to ONE model at batch N*b "
          "(same precision/graphs); overhead: (round - local steps) / local steps (averaging, bookkeeping).")
    n_train = nominal_train or task.train_size
    rounds_per_epoch = n_train / (args.clients * args.local_steps * batch)
    print(f"\nseconds per global epoch ({n_train} training {'sequences' if task_key == 'ptb' else 'examples'}, "
          f"{rounds_per_epoch:.1f} rounds of I={args.local_steps}):")
    for key, m in methods:
        if key.startswith("one"):
            continue
        print(f"  {m.name:44s} {med[key] * rounds_per_epoch:10.1f} s")


if __name__ == "__main__":
    main()
