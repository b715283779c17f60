"""The engine loop and its command line: the same runs as the Flower path, without messaging.

    python -m simulations.engine --config pyproject.toml --run-config "num-rounds=50 local-steps=8"
    torchrun --nproc-per-node=4 -m simulations.engine --run-config "engine-cuda-graphs=true"
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 -m simulations.engine

Same config keys, partitions (``tasks.partitions``), minibatches
(``task.round_batches``), initial model, schedule (``strategies.schedule``), local step
(``clipped_sgd_step``), averaging (``strategies.averaging.finalize`` semantics) and results
file (``server.results.ResultsWriter``, the Flower path's row keys) as ``flwr run``: for the
same seed the per-client path reproduces the Flower path bit for bit, the vmap path to float
rounding (a max-pool window whose inputs tie can route its gradient differently: see
tests/test_engine_parity.py). Each process runs a
balanced block of clients (``distributed.shard``); a round ends with ONE all-reduce. Process 0
evaluates (``server.evaluation``: averaged iterates, eval-train), shows progress and writes the
results. A stateful task's clients keep their state per client across rounds
(``client-state = "keep"``), as the ClientApp keeps it in ``Context.state``. With
``clients-per-round = K`` < num-clients only the round's K clients (``strategies.participation``,
the ServerApp's choice too) are stacked and run, the processes sharing the K slots; epochs,
schedule and bytes count K. Nothing here imports flwr.

Execution path (``engine-path``, reported on screen and in the results header): ``vmap``
(``vectorised.py``) or ``sequential`` (``sequential.py``, one module per client). ``auto``
probes one vmapped step and falls back to sequential when the model cannot be vmapped
(``nn.LSTM``, random layers, a model class with ``engine_vmap = False``). On the CPU ``auto``
runs one client after another: measured (benchmarks/engine_speed.py) faster there than vmap's
batched kernels, and bit-identical to the ClientApp. Results folders, ``resume`` and
``checkpoint-every`` behave as in the ServerApp (``server.run_folder``, ``server.checkpoint``,
one checkpoint format): a folder that holds a run is refused unless resumed, and a resumed
run ends bit-identical to an uninterrupted one. Every process reads the checkpoint on
resume, so the results folder must be visible to all of them (one machine, or a shared
file system).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from client.update import StepConfig, grad_norm
from server.checkpoint import Checkpoint, CheckpointError, refuse_non_finite, resume_point, save_checkpoint
from server.evaluation import Evaluator
from server.results import ResultsWriter, RunClock, check_replies, round_row, save_weights
from server.run_folder import claim_run_folder
from strategies.averaging import state_nbytes
from strategies.episode import corrections, resample_seed
from strategies.naive_step import naive_server_step
from strategies.participation import participants
from strategies.schedule import global_epoch, scheduled
from tasks import cached_task, initial_model, partitions
from tasks.config import RunConfig, parse_overrides
from tasks.device import pick_device
from tasks.protocol import Task, draw_batches, example_counter, is_stateful, training_loss

from .aggregate import COLUMNS, ClientMetrics, average_round
from .distributed import World, close_world, init_world, shard
from .options import EngineOptions, split_engine_keys
from .progress import RoundProgress
from .sequential import SequentialClients
from .vectorised import VmapClients

log = logging.getLogger("simulations.engine")




def round_hparams(cfg: RunConfig, server_round: int, train_size: int) -> tuple[float, float]:
    """(lr, clip) of a round: the paper's schedule on global epochs done before it."""
    return scheduled(cfg.lr, cfg.clip, server_round - 1, cfg.per_round, cfg.local_steps, cfg.batch_size,
                     train_size, cfg.lr_milestones, cfg.lr_decay)


def engine_device(cfg: RunConfig, world: World) -> torch.device:
    device = pick_device(cfg.device)
    if device.type == "cuda":
        index = world.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return device


@dataclass
class EngineResult:
    state: dict[str, Tensor]
    rows: list[dict[str, Any]]
    path: str
    clients: range
    folder: Path | None = None
    notes: list[str] = field(default_factory=list)


class Engine:
    """One process's share of a run: its clients, the global model, the round loop."""

    def __init__(self, cfg: RunConfig, options: EngineOptions, world: World, task: Task | None = None,
                 parts: Sequence[np.ndarray] | None = None) -> None:
        self.cfg, self.options, self.world = cfg, options, world
        self.device = engine_device(cfg, world)
        self.task = task if task is not None else cached_task(cfg)
        self.parts = list(parts if parts is not None else partitions(cfg))
        if len(self.parts) != cfg.num_clients:
            raise ValueError(f"{len(self.parts)} partitions for num-clients={cfg.num_clients}")
        # this process's slots among the round's K participants (K = num-clients: slot = partition id)
        self.clients = shard(cfg.per_round, world.size, world.rank)
        self.round_clients = self._participants(1)
        self.model = initial_model(self.task, cfg.seed).to(self.device)
        self.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.count = example_counter(self.task)
        self.momentum: dict[str, Tensor] | None = None  # naive: the server's heavy-ball buffer
        # each client's own state across rounds (client-state = "keep" and a stateful task)
        keep = cfg.client_state == "keep" and is_stateful(self.task)
        partial = cfg.per_round < cfg.num_clients
        if keep and partial and world.size > 1:
            raise ValueError("clients-per-round < num-clients with a stateful task (client-state=keep) runs on one "
                             "process only: a client's state would move between processes; use one process or "
                             "client-state=reset")
        owned = range(cfg.num_clients) if partial else self.clients  # every client's state, sampled or not
        self.client_state: dict[int, dict[str, Tensor]] | None = {pid: {} for pid in owned} if keep else None
        self.notes: list[str] = []
        if partial:
            self.notes.append(f"partial participation: {cfg.per_round} of {cfg.num_clients} clients a round "
                              f"(this process runs slots {self.clients.start}..{self.clients.stop - 1} of the sample)")
        self.runner = self._choose_runner()
        self.evaluator = Evaluator(cfg, self.task, self.model, self.device)

    # --- execution path ----------------------------------------------------------------
    def _participants(self, server_round: int) -> list[int]:
        """This process's clients (partition ids) in ``server_round``: its slots of the round's K."""
        chosen = participants(self.cfg.seed, server_round, self.cfg.num_clients, self.cfg.per_round)
        return [chosen[i] for i in self.clients]

    def _iters(self, server_round: int, probe: bool = False) -> list[Any]:
        states = self.client_state if self.client_state is not None and not probe else {}
        return [draw_batches(self.task, self.parts[pid], states.get(pid), seed=self.cfg.seed, partition_id=pid,
                             server_round=server_round, local_steps=self.cfg.local_steps,
                             batch_size=self.cfg.batch_size, device=self.device)
                for pid in self.round_clients]

    def _sequential(self) -> SequentialClients:
        return SequentialClients(self.task.build_model, training_loss(self.task), len(self.clients), self.device,
                                 count=self.count, streams=self.options.streams)

    def _choose_runner(self) -> VmapClients | SequentialClients:
        o = self.options
        streams = " on one CUDA stream per client" if self.device.type == "cuda" and o.streams else ""
        if self.cfg.algorithm == "episode":
            if o.path == "vmap":
                raise ValueError("engine-path=vmap does not run algorithm 'episode' (its corrected local steps "
                                 "exist on the sequential path only): use engine-path=sequential or auto")
            self.notes.append(f"path: sequential{streams} (algorithm episode runs client by client)")
            return self._sequential()
        if o.path == "sequential":
            self.notes.append(f"path: sequential{streams} (engine-path=sequential)")
            return self._sequential()
        if o.path == "auto" and getattr(self.model, "engine_vmap", True) is False:
            self.notes.append(f"path: sequential{streams} ({type(self.model).__name__}.engine_vmap is False)")
            return self._sequential()
        if o.path == "auto" and self.device.type == "cpu":
            self.notes.append("path: sequential (auto on the CPU: one client after another beats vmap's batched "
                              "kernels there and is bit-identical to the ClientApp; engine-path=vmap vectorises)")
            return self._sequential()
        template = self.task.build_model().to(self.device)
        runner = VmapClients(template, self.task.loss, len(self.clients), count=self.count, bf16=o.bf16,
                             channels_last=o.channels_last, cuda_graphs=o.cuda_graphs, randomness=o.randomness)
        runner.load(self.state)
        lr, clip = round_hparams(self.cfg, 1, self.task.train_size)
        why = runner.probe([next(it) for it in self._iters(1, probe=True)],
                           StepConfig(lr=lr, clip=clip, weight_decay=self.cfg.weight_decay,
                                      momentum=self.cfg.momentum))
        if why is None:
            flags = [name for name, on in (("bf16", o.bf16), ("channels-last", o.channels_last),
                                           ("cuda-graphs", o.cuda_graphs)) if on]
            self.notes.append(f"path: vmap over {len(self.clients)} clients" + (f" ({', '.join(flags)})" if flags else ""))
            return runner
        if o.path == "vmap":
            raise RuntimeError(f"engine-path=vmap but this model cannot run under torch.func.vmap: {why}")
        if o.bf16 or o.channels_last or o.cuda_graphs:
            log.warning("engine-bf16/channels-last/cuda-graphs apply to the vmap path only; ignored")
        self.notes.append(f"path: sequential{streams} (vmap cannot take {type(self.model).__name__}: {why})")
        return self._sequential()

    @property
    def path(self) -> str:
        return self.runner.path

    # --- rounds ------------------------------------------------------------------------
    def _seed(self, server_round: int):
        def seed(i: int, step: int) -> int:
            pid = self.round_clients[i]
            return int(np.random.SeedSequence([self.cfg.seed, server_round, pid, step, 0xE9]).generate_state(1)[0])
        return seed

    def train_round(self, server_round: int) -> dict[str, float | int]:
        """One round of the round's K clients (all processes); updates ``self.state``; the round's metrics."""
        cfg = self.cfg
        self.round_clients = self._participants(server_round)
        lr, clip = round_hparams(cfg, server_round, self.task.train_size)
        step = StepConfig(lr=lr, clip=clip, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
        self.runner.load(self.state)
        iters = self._iters(server_round)
        if cfg.algorithm == "naive":
            return self._naive_round(server_round, iters, step)
        if cfg.algorithm == "episode":
            return self._episode_round(server_round, iters, step)
        if isinstance(self.runner, VmapClients):
            if self.options.cuda_graphs:  # one capture for the run: base values, schedule as a factor
                base = StepConfig(lr=cfg.lr, clip=cfg.clip, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
                stats = self.runner.run_round(iters, base, lr_scale=lr / cfg.lr)
            else:
                stats = self.runner.run_round(iters, step)
        else:
            stats = self.runner.run_round(iters, step, seed=self._seed(server_round))
        state, metrics = average_round(self.runner.client_states(), self.state, ClientMetrics.from_stats(stats),
                                       aggregation=cfg.aggregation, num_clients=cfg.per_round, world=self.world)
        if state is not None:
            self.state = state
        return metrics

    def _naive_round(self, server_round: int, iters: list[Any], step: StepConfig) -> dict[str, float | int]:
        """Naive parallel clipping: average the clients' gradients (and buffers) with the one
        all-reduce, then ONE clipped step on the shared parameters (as NaiveParallelClip)."""
        if isinstance(self.runner, VmapClients):
            grads, loss, scale, examples = self.runner.gradients(iters)
            names = list(grads)
            states = {**self.runner.client_states(), **grads}
            if scale is not None:
                states["lr-scale"] = scale.double()
            norms = torch.func.vmap(grad_norm)([grads[k] for k in names])
        else:  # client by client: no stacked copy of large models
            per_client, loss, scale, examples = self.runner.gradients(iters, seed=self._seed(server_round))
            names = list(per_client[0])
            states = [{**s, **g} for s, g in zip(self.runner.client_states(), per_client, strict=True)]
            if scale is not None:
                for s, v in zip(states, scale.double(), strict=True):
                    s["lr-scale"] = v
            norms = torch.stack([grad_norm(list(g.values())) for g in per_client])
        like = dict(self.state)
        if scale is not None:
            like["lr-scale"] = torch.zeros((), dtype=torch.float64, device=self.device)
        table = torch.full((loss.shape[0], len(COLUMNS)), float("nan"), dtype=torch.float64, device=self.device)
        table[:, COLUMNS.index("train-loss")] = loss.double()
        table[:, COLUMNS.index("grad-norm")] = norms.double()
        table[:, COLUMNS.index("num-examples")] = examples
        table[:, COLUMNS.index("num-steps")] = 1.0
        table[:, COLUMNS.index("skipped-steps")] = 0.0
        if getattr(self.runner, "last_ce", None) is not None:
            table[:, COLUMNS.index("train-ce")] = self.runner.last_ce.double()
        avg, metrics = average_round(states, like, ClientMetrics(table), aggregation=self.cfg.aggregation,
                                     num_clients=self.cfg.per_round, world=self.world)
        if "grad-norm" in metrics:
            metrics["client-grad-norm"] = metrics.pop("grad-norm")
        if avg is None:
            return metrics
        lr_scale = float(avg.pop("lr-scale")) if scale is not None else 1.0
        params, self.momentum, stats = naive_server_step(self.state, {k: avg[k] for k in names}, self.momentum,
                                                         step, lr_scale)
        self.state = {**avg, **params}
        self.state = {k: self.state[k] for k in like if k != "lr-scale"}
        metrics.update(stats)
        return metrics

    def _episode_round(self, server_round: int, iters: list[Any], step: StepConfig) -> dict[str, float | int]:
        """EPISODE (as ``strategies.episode_strategy.EPISODE``): every client's gradient at the
        global point on its resampled minibatch, the corrections and ‖G_r‖, then I corrected
        local steps per client (one clip decision for the round) and the average."""
        if self.world.size > 1:
            raise ValueError("algorithm 'episode' runs on the engine in one process (its corrections need every "
                             "client's resampled gradient): run without torchrun, or use the Flower path")
        cfg = self.cfg
        resample = [draw_batches(self.task, self.parts[pid], None, seed=resample_seed(cfg.seed), partition_id=pid,
                                 server_round=server_round, local_steps=1, batch_size=cfg.batch_size,
                                 device=self.device) for pid in self.round_clients]
        grads, _, _, examples = self.runner.gradients(resample, seed=self._seed(server_round))
        bad = [pid for pid, g in zip(self.round_clients, grads, strict=True)
               if not all(bool(torch.isfinite(v).all()) for v in g.values())]
        if bad:
            raise FloatingPointError(f"round {server_round}: the resampled gradients of clients {bad} are not finite")
        weights = examples.tolist() if cfg.aggregation == "examples" else None
        _, corr, norm = corrections(grads, weights)
        names = list(grads[0])
        self.runner.load(self.state)  # the resample's forward passes must not move the buffers
        stats = self.runner.run_round(iters, step, seed=self._seed(server_round),
                                      episode=([[c[k] for k in names] for c in corr], norm))
        state, metrics = average_round(self.runner.client_states(), self.state, ClientMetrics.from_stats(stats),
                                       aggregation=cfg.aggregation, num_clients=cfg.per_round, world=self.world)
        if state is not None:
            self.state = state
        n, model_bytes = len(self.round_clients), state_nbytes(self.state)
        answered = int(metrics.get("replies", 0)) + int(metrics.get("rejected-replies", 0))
        metrics["bytes-sent"] = 2 * model_bytes * n + sum(state_nbytes(c) for c in corr)
        metrics["bytes-received"] = model_bytes * n + model_bytes * answered  # gradients + buffers, then the states
        metrics["resample-failures"] = 0
        metrics["global-grad-norm"] = norm
        return metrics

    # --- checkpoints (the ServerApp's format: server.checkpoint) -----------------------
    def checkpoint(self, folder: Path, server_round: int, wall_clock: float) -> None:
        """The global model after ``server_round`` (and naive's server momentum), atomically."""
        momentum = {f"momentum.{k}": v for k, v in (self.momentum or {}).items()}
        save_checkpoint(folder, Checkpoint(round=server_round, arrays=self.state, strategy_state=momentum, meta={
            "config": self.cfg.to_mapping(), "wall-clock": wall_clock, "num-rounds": self.cfg.num_rounds}))

    def resume(self, folder: Path) -> Checkpoint | None:
        """resume=true: continue from the folder's checkpoint (every process reads it); None: round 0."""
        ckpt = resume_point(folder, self.cfg.to_mapping(), self.cfg.num_rounds)
        if ckpt is None:
            log.warning("resume=true but %s holds no checkpoint: starting at round 0", folder)
            return None
        if set(ckpt.arrays) != set(self.state):
            raise CheckpointError(f"{folder}: the checkpoint's arrays do not match the model's")
        self.state = {k: ckpt.arrays[k].to(self.device) for k in self.state}
        momentum = {k.removeprefix("momentum."): v.to(self.device) for k, v in ckpt.strategy_state.items()
                    if k.startswith("momentum.")}
        self.momentum = momentum or None
        return ckpt

    def evaluate(self) -> dict[str, float | int]:
        return self.evaluator(self.state)


def run_engine(cfg: RunConfig, options: EngineOptions | None = None, *, task: Task | None = None,
               parts: Sequence[np.ndarray] | None = None, world: World | None = None, write_results: bool = True,
               show_progress: bool = True) -> EngineResult:
    """Run ``cfg`` with the engine; returns the final global state (on every process)."""
    options = options or EngineOptions()
    cfg = cfg.with_clients(None)  # no federation to follow: num-clients = 0 runs DEFAULT_CLIENTS
    own_world = world is None
    if world is None:
        world = init_world(pick_device(cfg.device).type)
    try:
        return _run(cfg, options, world, task, parts, write_results, show_progress)
    finally:
        if own_world:
            close_world(world)


def _run(cfg: RunConfig, options: EngineOptions, world: World, task: Any, parts: Any, write_results: bool,
         show_progress: bool) -> EngineResult:
    folder = (Path(cfg.results_dir) / cfg.folder_name()).resolve() if write_results else None
    if folder is None or not world.is_main:
        return _rounds(cfg, options, world, task, parts, folder, show_progress)
    with claim_run_folder(folder, resume=cfg.resume):  # process 0 owns the folder for the run
        return _rounds(cfg, options, world, task, parts, folder, show_progress)


def _rounds(cfg: RunConfig, options: EngineOptions, world: World, task: Any, parts: Any, folder: Path | None,
            show_progress: bool) -> EngineResult:
    engine = Engine(cfg, options, world, task, parts)
    main = world.is_main
    model_bytes = state_nbytes(engine.state)
    train_size = engine.task.train_size
    ckpt = engine.resume(folder) if folder is not None and cfg.resume else None
    done = ckpt.round if ckpt else 0
    writer = None
    if main and folder is not None:
        writer = ResultsWriter(folder, cfg.to_mapping(), {
            "train-size": train_size, "model-bytes": model_bytes, "backend": "engine", "world-size": world.size,
            "engine": {**options.to_mapping(), "path": engine.path, "device": str(engine.device),
                       "notes": engine.notes},
        }, resume_from=done if ckpt else None)
    rows: list[dict[str, Any]] = []
    clock = RunClock(float(ckpt.meta.get("wall-clock", 0.0)) if ckpt else 0.0)
    with RoundProgress(cfg.num_rounds, enabled=main and show_progress) as progress:
        for note in engine.notes:
            progress.note(f"engine: {note}; {world.size} process(es), clients {engine.clients.start}.."
                          f"{engine.clients.stop - 1} here, device {engine.device}")
            log.info("%s", note)
        if ckpt:
            progress.note(f"engine: resuming {folder} from its round-{done} checkpoint")
        for server_round in range(done + 1 if ckpt else 0, cfg.num_rounds + 1):
            epoch = global_epoch(server_round, cfg.per_round, cfg.local_steps, cfg.batch_size, train_size)
            row = round_row(server_round, epoch)
            if server_round > 0:
                metrics = engine.train_round(server_round)
                replies = int(metrics.get("replies", 0))
                rejected = int(metrics.get("rejected-replies", 0))
                check_replies(server_round, replies, cfg.required_replies,
                              [f"{rejected} clients had non-finite states" if rejected else ""])
                lr, clip = round_hparams(cfg, server_round, train_size)
                counts = {k: metrics.pop(k) for k in ("replies", "rejected-replies", "failed-replies")}
                traffic = {"bytes-sent": model_bytes * cfg.per_round, "bytes-received": model_bytes * (replies + rejected)}
                row = round_row(server_round, epoch, lr=lr, clip=clip, failed_nodes=[],  # no messaging: no node fails
                                resumed_from=done if done and server_round == done + 1 else None,
                                metrics={**counts, **traffic, **metrics})
            t0 = time.monotonic()
            if main and cfg.evaluates(server_round):
                row.update(engine.evaluate())
            clock.exclude(time.monotonic() - t0)
            row["wall-clock"] = clock.now()
            rows.append(row)
            if writer is not None:
                writer.row(row)
                if server_round > 0:
                    refuse_non_finite(engine.state, server_round)
                if cfg.checkpoints(server_round):
                    engine.checkpoint(folder, server_round, row["wall-clock"])
            progress.update(row)
    if folder is not None and main:
        save_weights(engine.state, folder / "model.pt")
        progress.note(f"engine: results: {folder / 'results.jsonl'}")
    return EngineResult(engine.state, rows, engine.path, engine.clients, folder if main else None, engine.notes)


def main(argv: Sequence[str] | None = None) -> EngineResult:
    parser = argparse.ArgumentParser(prog="python -m simulations.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="pyproject.toml", help="pyproject.toml or a flat TOML file of run keys")
    parser.add_argument("--run-config", action="append", default=[], metavar="'k=v ...'",
                        help="overrides as for flwr run (repeatable; a .toml file of keys also works); "
                             "engine-* keys choose the execution path and switches")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run_keys, engine_keys = split_engine_keys(parse_overrides(args.run_config))
    cfg = RunConfig.from_toml(args.config, run_keys)
    return run_engine(cfg, EngineOptions.from_mapping(engine_keys), show_progress=not args.quiet)
