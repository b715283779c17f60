"""The engine loop and its command line: the same runs as the Flower path, without messaging.

    python -m simulations.engine --config pyproject.toml --run-config "num-rounds=50 local-steps=8"
    torchrun --nproc-per-node=4 -m simulations.engine --run-config "engine-cuda-graphs=true"
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 -m simulations.engine

Same config keys, partitions (``tasks.partitions``), minibatches (``task.round_batches``),
initial model and results files (``tasks.runs``, the Flower path's rows) as ``flwr run``, and
the same method objects (``strategies.methods``: the schedule, the server side of a round,
the client side of every exchange, the averaging): for the same seed the per-client path
reproduces the Flower path bit for bit, the vmap path to float rounding (a max-pool window
whose inputs tie can route its gradient differently: see tests/test_engine_parity.py). Each
process runs a balanced block of clients (``distributed.shard``); an exchange ends with ONE
all-reduce. Process 0 evaluates (``tasks.runs.evaluation``: averaged iterates, eval-train),
shows progress and writes the results. A stateful task's clients keep their state per client
across rounds (``client-state = "keep"``), as the ClientApp keeps it in ``Context.state``; so
does a method's own client state (SCAFFOLD's c_i). With ``clients-per-round = K`` <
num-clients only the round's K clients (``strategies.core.client_sampling``, the ServerApp's choice
too) are run, the processes sharing the K slots; epochs, schedule and bytes count K. Nothing
here imports flwr, and nothing here names a method.

Execution path (``engine-path``, reported on screen and in the results header): ``vmap``
(``strategies.methods.executors.vectorised``) or ``sequential`` (``strategies.methods.executors.sequential``,
one module per client). ``auto`` probes one vmapped step and falls back to sequential when
the model cannot be vmapped (``nn.LSTM``, random layers, a model class with ``engine_vmap =
False``) or the method's step cannot (``Algorithm.vectorises``). On the CPU ``auto`` runs
one client after another: measured (benchmarks/engine_speed.py) faster there than vmap's
batched kernels, and bit-identical to the ClientApp. Results folders, ``resume`` and
``checkpoint-every`` behave as in the ServerApp (``tasks.runs``, one checkpoint format): a
folder that holds a run is refused unless resumed, and a resumed run ends bit-identical to
an uninterrupted one: the checkpoint holds the method's server state (SCAFFOLD: c and every
c_i) and the clients' own (a kept language-model state, a method's client memory), gathered
from every process. Every process reads the checkpoint on resume,
so the results folder must be visible to all of them (one machine, or a shared file system).
"""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from strategies.core.averaging import state_nbytes
from strategies.core.client_sampling import participants
from strategies.methods import build
from strategies.methods.algorithm import Algorithm, Exchange, RoundReport
from strategies.methods.executors import ClientGroup, EngineOptions, SequentialClients, VmapClients, choose_executor
from strategies.methods.executors.options import split_engine_keys
from strategies.methods.privacy import Privacy
from strategies.methods.reduce import ClientResults
from tasks import cached_task, check_partitions, initial_model, partitions
from tasks.config import RunConfig, shared_default_notes
from tasks.config import toml_values as cfg_values
from tasks.device import pick_device
from tasks.overrides import parse_overrides
from tasks.protocol import Task, draw_batches, example_counter, is_stateful, lr_scale_bound, training_loss
from tasks.runs.checkpoint import CLIENT_RECORDS as CHECKPOINT_CLIENT_RECORDS
from tasks.runs.checkpoint import Checkpoint, resume_point, split_client_records
from tasks.runs.evaluation import Evaluator
from tasks.runs.recorder import RunRecorder
from tasks.runs.run_folder import claim_run_folder

from .distributed import World, all_reduce_sum, close_world, gather_mappings, init_world, shard
from .progress import RoundProgress

log = logging.getLogger("simulations.engine")


def engine_device(cfg: RunConfig, world: World) -> torch.device:
    device = pick_device(cfg.device)
    if device.type == "cuda":
        index = world.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return device


#: the clients' own state a checkpoint keeps: entry prefix (``tasks.runs.checkpoint.CLIENT_RECORDS``) -> the
#: Engine attribute holding it by client id
CLIENT_RECORDS = dict(zip(CHECKPOINT_CLIENT_RECORDS, ("client_state", "memory"), strict=True))


@dataclass
class EngineResult:
    state: dict[str, Tensor]
    rows: list[dict[str, Any]]
    path: str
    clients: range
    folder: Path | None = None
    notes: list[str] = field(default_factory=list)


class Engine:
    """One process's share of a run: its clients, the method, the global model, the round loop."""

    def __init__(self, cfg: RunConfig, options: EngineOptions, world: World, task: Task | None = None,
                 parts: Sequence[np.ndarray] | None = None) -> None:
        self.cfg, self.options, self.world = cfg, options, world
        self.device = engine_device(cfg, world)
        self.task = task if task is not None else cached_task(cfg)
        self.parts = list(parts if parts is not None else partitions(cfg))
        if len(self.parts) != cfg.num_clients:
            raise ValueError(f"{len(self.parts)} partitions for num-clients={cfg.num_clients}")
        check_partitions(cfg, self.parts)  # before any work, as the ServerApp does
        self.algorithm: Algorithm = build(cfg.algorithm, cfg.hyper, train_size=self.task.train_size,
                                          population=cfg.num_clients, per_round=cfg.per_round, options=cfg.method_options)
        # this process's slots among the round's K participants (K = num-clients: slot = partition id)
        self.clients = shard(cfg.per_round, world.size, world.rank)
        self.all_reduce = functools.partial(all_reduce_sum, world=world) if world.distributed else None
        self.model = initial_model(self.task, cfg.seed).to(self.device)
        self.state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.privacy = self._privacy()
        self.algorithm.privacy = self.privacy  # every round's release goes through it (strategies.round)
        self.round_clients = self._participants(1)
        self.count = example_counter(self.task)
        keep = cfg.client_state == "keep" and is_stateful(self.task)
        memory = self.algorithm.keeps_client_memory
        partial = cfg.per_round < cfg.num_clients
        if (keep or memory or self.algorithm.keeps_client_records) and partial and world.size > 1:
            what = "a stateful task (client-state=keep)" if keep else f"algorithm {cfg.algorithm!r} (it keeps state per client)"
            raise ValueError(f"clients-per-round < num-clients with {what} runs on one process only: a client's state "
                             "would move between processes; use one process" + (" or client-state=reset" if keep else ""))
        owned = range(cfg.num_clients) if partial else self.round_clients  # every client's state, sampled or not
        self.client_state: dict[int, dict[str, Tensor]] | None = {pid: {} for pid in owned} if keep else None
        self.memory: dict[int, dict[str, Tensor]] | None = {pid: {} for pid in owned} if memory else None
        self.notes: list[str] = []
        if partial:
            self.notes.append(f"partial participation: {cfg.per_round} of {cfg.num_clients} clients a round "
                              f"(this process runs slots {self.clients.start}..{self.clients.stop - 1} of the sample)")
        self.executor = self._choose_executor()
        self.evaluator = Evaluator(cfg, self.task, self.model, self.device)

    # --- execution path ----------------------------------------------------------------
    def _privacy(self) -> Privacy | None:
        """The run's DP mechanism (dp-noise-multiplier > 0), as the ServerApp builds it: process 0 adds
        the noise and draws a secure client sample, which every process then holds."""
        cfg = self.cfg
        if not cfg.dp.enabled:
            return None
        trainable = [k for k, p in self.model.named_parameters() if p.requires_grad]
        broadcast = functools.partial(all_reduce_sum, world=self.world) if self.world.distributed else None
        return Privacy(cfg.dp, population=cfg.num_clients, per_round=cfg.per_round, seed=cfg.seed, state=self.state,
                       trainable=trainable, max_lr_scale=lr_scale_bound(self.task), adds_noise=self.world.is_main,
                       broadcast=broadcast)

    def _participants(self, server_round: int) -> list[int]:
        """This process's clients (partition ids) in ``server_round``: its slots of the round's K."""
        if self.privacy is not None:
            chosen = self.privacy.participants(server_round)
        else:
            chosen = participants(self.cfg.seed, server_round, self.cfg.num_clients, self.cfg.per_round)
        return [chosen[i] for i in self.clients]

    def _draw(self, pid: int, state: dict[str, Tensor] | None, **kw: Any):
        return draw_batches(self.task, self.parts[pid], state, partition_id=pid, device=self.device, **kw)

    def _choose_executor(self) -> VmapClients | SequentialClients:
        def probe():
            lr, clip = self.algorithm.round_hparams(1)
            batches = [next(iter(self._draw(pid, None, seed=self.cfg.seed, server_round=1,
                                            local_steps=self.cfg.local_steps, batch_size=self.cfg.batch_size)))
                       for pid in self.round_clients]
            return batches, self.cfg.hyper.step(lr, clip), self.state

        executor, note = choose_executor(self.task.build_model, training_loss(self.task), self.task.loss,
                                         len(self.clients), self.device, self.options, count=self.count,
                                         method=self.algorithm, model=self.model, probe=probe)
        self.notes.append(note)
        return executor

    @property
    def path(self) -> str:
        return self.executor.path

    # --- rounds ------------------------------------------------------------------------
    def train_round(self, server_round: int) -> RoundReport:
        """One round of the round's K clients (all processes): the method's server side, each
        exchange run by its client side on this process's clients; updates ``self.state``."""
        self.round_clients = self._participants(server_round)
        rnd = self.algorithm.begin(server_round, self.state, self.round_clients, expected=self.cfg.per_round,
                                   all_reduce=self.all_reduce, trainable=self.executor.trainable)
        server = self.algorithm.server(rnd)
        exchange = next(server)
        while True:
            try:
                exchange = server.send(self.run_exchange(exchange))
            except StopIteration as stop:
                report = stop.value
                break
        if report.state is not None:
            self.state = report.state
        return report

    def run_exchange(self, exchange: Exchange) -> ClientResults:
        """The client side of ``exchange`` on this process's clients that take part in it."""
        positions = [self.round_clients.index(pid) for pid in exchange.clients]
        states = self.client_state or {}
        memory = self.memory or {}
        group = ClientGroup(self.executor.subset(positions), exchange.clients, self._draw, seed=self.cfg.seed,
                            task_states=[states.get(pid) for pid in exchange.clients],
                            memory=[memory.setdefault(pid, {}) for pid in exchange.clients], base=self.cfg.hyper)
        group.load(exchange.state)
        return self.algorithm.client(exchange, group)

    # --- checkpoints (the ServerApp's format: tasks.runs.checkpoint) -------------------
    def server_state(self) -> dict[str, Tensor]:
        """What a checkpoint keeps beside the model, gathered from every process (a collective:
        every process calls it): the method's state and the clients' own (``client-state/<id>/...``,
        ``client-memory/<id>/...``)."""
        out = dict(self.algorithm.state_dict())
        for prefix, per_client in CLIENT_RECORDS.items():
            for pid, record in sorted((getattr(self, per_client) or {}).items()):
                out.update({f"{prefix}/{pid}/{k}": v for k, v in record.items()})
        gathers = self.algorithm.keeps_client_records or any(getattr(self, a) is not None for a in CLIENT_RECORDS.values())
        return gather_mappings(out, self.world) if gathers else out

    def load_server_state(self, state: dict[str, Tensor]) -> None:
        """Restore ``server_state()``: the method's part, and the clients' own where this process runs them."""
        own, clients = split_client_records(state)
        for prefix, records in clients.items():
            held = getattr(self, CLIENT_RECORDS[prefix])
            for pid, record in records.items():
                if held is not None and pid in held:
                    held[pid].update({k: v.to(self.device) for k, v in record.items()})
        self.algorithm.load_state_dict({k: v.to(self.device) for k, v in own.items()})

    def resume(self, folder: Path) -> Checkpoint | None:
        """resume=true: continue from the folder's checkpoint (every process reads it); None: round 0."""
        ckpt = resume_point(folder, self.cfg.to_mapping(), self.cfg.num_rounds, reference=self.state)
        if ckpt is None:
            log.warning("resume=true but %s holds no checkpoint: starting at round 0", folder)
            return None
        self.state = {k: ckpt.arrays[k].to(self.device) for k in self.state}
        self.load_server_state(dict(ckpt.strategy_state))
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
    folder = Path(cfg.results_dir).resolve() / cfg.folder_name() if write_results else None  # a link there is refused
    if folder is None or not world.is_main:
        return _rounds(cfg, options, world, task, parts, folder, show_progress)
    with claim_run_folder(folder, resume=cfg.resume):  # process 0 owns the folder for the run
        return _rounds(cfg, options, world, task, parts, folder, show_progress)


def _rounds(cfg: RunConfig, options: EngineOptions, world: World, task: Any, parts: Any, folder: Path | None,
            show_progress: bool) -> EngineResult:
    engine = Engine(cfg, options, world, task, parts)
    main = world.is_main
    train_size = engine.task.train_size
    ckpt = engine.resume(folder) if folder is not None and cfg.resume else None
    done = ckpt.round if ckpt else 0
    header = {"train-size": train_size, "model-bytes": state_nbytes(engine.state),
              "backend": "engine", "world-size": world.size,
              "engine": {**options.to_mapping(), "path": engine.path, "device": str(engine.device), "notes": engine.notes}}
    privacy = engine.privacy
    last = privacy.last_round(cfg.num_rounds) if privacy is not None else cfg.num_rounds
    if privacy is not None:
        header["privacy"] = privacy.header()
    recorder = RunRecorder(cfg, engine.evaluator if main else None, folder if main else None, header, resumed=ckpt,
                           last_round=last, stop_reason=privacy.stop_reason(cfg.num_rounds) if privacy else None)
    with RoundProgress(cfg.num_rounds, enabled=main and show_progress) as progress:
        for note in engine.notes:
            progress.note(f"engine: {note}; {world.size} process(es), clients {engine.clients.start}.."
                          f"{engine.clients.stop - 1} here, device {engine.device}")
            log.info("%s", note)
        if ckpt:
            progress.note(f"engine: resuming {folder} from its round-{done} checkpoint")
        if cfg.transport != "float32":
            progress.note(f"engine: transport={cfg.transport} rounds this project's Flower messages; the engine sends "
                          "none, so its model is the exact one (float32)")
        for line in privacy.summary() if privacy is not None else []:
            progress.note(f"engine: {line}")
        for server_round in range(done + 1 if ckpt else 0, last + 1):
            report = engine.train_round(server_round) if server_round > 0 else None
            epoch = engine.algorithm.epoch_at(server_round)
            lost = int(report.metrics.get("rejected-replies", 0)) if report is not None else 0
            row = recorder.record(server_round, epoch, engine.state, report,
                                  failures=[f"{lost} client(s) had non-finite results"] if lost else [],
                                  server_state=engine.server_state() if recorder.checkpoint_due(server_round) else None)
            progress.update(row)
        if recorder.stop_reason:
            progress.note(f"engine: {recorder.stop_reason}")
            log.warning("%s", recorder.stop_reason)
        path = recorder.finish(engine.state) if main else None
        if path is not None:
            progress.note(f"engine: results: {folder / 'results.jsonl'}")
    return EngineResult(engine.state, recorder.rows, engine.path, engine.clients, folder if main else None, engine.notes)


def parse(argv: Sequence[str] | None = None) -> tuple[RunConfig, EngineOptions, bool]:
    """(config, engine options, quiet) of the command line; the run's folder name fixed now (a
    run-name from the clock otherwise), so that a stopped run can be named in its resume command."""
    parser = argparse.ArgumentParser(prog="python -m simulations.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="pyproject.toml", help="pyproject.toml or a flat TOML file of run keys")
    parser.add_argument("--run-config", action="append", default=[], metavar="'k=v ...'",
                        help="overrides as for flwr run (repeatable; a .toml file of keys also works); "
                             "engine-* keys choose the execution path and switches")
    parser.add_argument("--quiet", action="store_true", help="no progress display")
    args = parser.parse_args(argv)
    run_keys, engine_keys = split_engine_keys(parse_overrides(args.run_config))
    cfg = RunConfig.from_toml(args.config, run_keys)
    for note in shared_default_notes(cfg, cfg_values(args.config, run_keys), explicit=run_keys):
        log.warning("%s", note)
    if not cfg.run_name:
        cfg = RunConfig.from_mapping({**cfg.to_mapping(), "run-name": cfg.folder_name()})
    return cfg, EngineOptions.from_mapping(engine_keys), args.quiet


def main(argv: Sequence[str] | None = None) -> EngineResult:
    cfg, options, quiet = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_engine(cfg, options, show_progress=not quiet)
