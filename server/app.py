"""The ServerApp: run config -> model + strategy -> rounds -> results file and weights."""

from __future__ import annotations

import time
from logging import INFO
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from client.local_round import partitions, pick_device
from simulations.config import RunConfig
from strategies.averaging import state_nbytes
from strategies.celgc import CELGC
from strategies.naive import NaiveParallelClip
from strategies.schedule import global_epoch
from tasks import load_task

from .results import ResultsWriter, save_weights

app = ServerApp()


class FederationError(RuntimeError):
    """The connected nodes do not match the run's num-clients."""


def initial_model(task: Any, seed: int) -> torch.nn.Module:
    """The task's model initialised from ``seed`` without touching the global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return task.build_model()


def build_strategy(cfg: RunConfig, train_size: int) -> CELGC:
    """The strategy named by ``algorithm`` with every setting from the config.

    celgc and local-sgd (celgc with clip off) -> CELGC; naive -> NaiveParallelClip (a
    CELGC subclass: one step a round, clients send gradients, the server clips).
    """
    common = dict(
        lr=cfg.lr, clip=cfg.clip, batch_size=cfg.batch_size,
        weight_decay=cfg.weight_decay, momentum=cfg.momentum, lr_decay=cfg.lr_decay,
        lr_milestones=cfg.lr_milestones, train_size=train_size, aggregation=cfg.aggregation,
        num_clients=cfg.num_clients, fraction_train=1.0, fraction_evaluate=0.0,
    )
    if cfg.algorithm == "naive":
        return NaiveParallelClip(**common)
    return CELGC(local_steps=cfg.local_steps, **common)


def wait_for_federation(grid: Grid, cfg: RunConfig, poll: float = 0.5) -> list[int]:
    """Wait (at most ``node-wait`` s) for exactly num-clients nodes with matching partitions.

    Connected nodes are asked for their ``partition-id`` / ``num-partitions`` (a query
    message) so that a federation of the wrong size fails at once with the fix, instead
    of training a different number of clients than asked for.
    """
    deadline = time.monotonic() + cfg.node_wait
    checked: set[int] = set()
    while True:
        nodes = sorted(grid.get_node_ids())
        fresh = [n for n in nodes if n not in checked]
        if fresh:
            _check_nodes(grid, cfg, fresh)
            checked.update(fresh)
        if len(nodes) > cfg.num_clients:
            raise FederationError(
                f"{len(nodes)} nodes are connected but num-clients is {cfg.num_clients}: "
                f"set num-clients={len(nodes)} or run with --federation-config \"num-supernodes={cfg.num_clients}\""
            )
        if len(nodes) == cfg.num_clients:
            return nodes
        if time.monotonic() > deadline:
            raise FederationError(
                f"only {len(nodes)} of num-clients={cfg.num_clients} nodes connected within node-wait={cfg.node_wait:g} s: "
                f"in simulation run with --federation-config \"num-supernodes={cfg.num_clients}\"; in deployment start "
                f"{cfg.num_clients} SuperNodes with --node-config \"partition-id=i num-partitions={cfg.num_clients}\""
            )
        log(INFO, "Waiting for nodes: %d of %d connected", len(nodes), cfg.num_clients)
        time.sleep(poll)


def _check_nodes(grid: Grid, cfg: RunConfig, nodes: list[int]) -> None:
    queries = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in nodes]
    for reply in grid.send_and_receive(queries, timeout=cfg.node_wait):
        if reply.has_error():
            continue  # an app without a query handler: the train step checks again
        info = next(iter(reply.content.metric_records.values()), {})
        num = info.get("num-partitions")
        if num is not None and int(num) != cfg.num_clients:
            raise FederationError(
                f"the federation has num-partitions={int(num)} but the run asks for num-clients={cfg.num_clients}: "
                f"in simulation run with --federation-config \"num-supernodes={cfg.num_clients}\" "
                f"(or set num-clients={int(num)}); in deployment start the SuperNodes with "
                f"--node-config \"partition-id=i num-partitions={cfg.num_clients}\""
            )


def check_partitions(cfg: RunConfig) -> None:
    """Fail before any round if the clients' data cannot hold the configured batches."""
    sizes = [len(p) for p in partitions(cfg)]
    if cfg.batch_size > min(sizes):
        raise ValueError(
            f"batch-size ({cfg.batch_size}) exceeds the smallest client's {min(sizes)} examples "
            f"(partitioner {cfg.partitioner}, num-clients {cfg.num_clients}): lower batch-size or num-clients"
        )


def run_name(cfg: RunConfig) -> str:
    return cfg.run_name or f"{cfg.task}-{cfg.algorithm}-I{cfg.local_steps}-s{cfg.seed}-{time.strftime('%Y%m%d-%H%M%S')}"


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = RunConfig.from_mapping(dict(context.run_config))
    folder = (Path(cfg.results_dir) / run_name(cfg)).resolve()
    log(INFO, "CELGC run: %s -> results in %s", cfg.task, folder)
    task = load_task(cfg)
    device = pick_device(cfg.device)
    check_partitions(cfg)
    model = initial_model(task, cfg.seed).to(device)
    arrays = ArrayRecord(model.state_dict())
    wait_for_federation(grid, cfg)
    strategy = build_strategy(cfg, task.train_size)
    writer = ResultsWriter(folder, cfg.to_mapping(), {"train-size": task.train_size,
                                                      "model-bytes": state_nbytes(model.state_dict())})
    clock = {"start": time.monotonic(), "eval": 0.0}

    def evaluate_fn(server_round: int, round_arrays: ArrayRecord) -> MetricRecord | None:
        t0 = time.monotonic()
        row: dict[str, Any] = {
            "round": server_round,
            "global-epoch": global_epoch(server_round, cfg.num_clients, cfg.local_steps, cfg.batch_size, task.train_size),
            "communication-rounds": server_round,
        }
        if server_round > 0:
            replies = int((strategy.last_round_metrics or {}).get("replies", 0))
            if replies < cfg.required_replies:
                raise RuntimeError(
                    f"round {server_round}: {replies} sound replies, {cfg.required_replies} required "
                    f"(min-replies); failures: {'; '.join(strategy.last_failures) or 'replies timed out'}"
                )
            lr, clip = strategy.round_hparams(server_round, cfg.num_clients)
            row.update({"lr": lr, "clip": clip})
            row.update(dict(strategy.last_round_metrics or {}))
        metrics = None
        if server_round % cfg.eval_every == 0 or server_round == cfg.num_rounds:
            model.load_state_dict(round_arrays.to_torch_state_dict())
            metrics = task.evaluate(model, device)
            row.update(metrics)
        clock["eval"] += time.monotonic() - t0
        row["wall-clock"] = time.monotonic() - clock["start"] - clock["eval"]
        writer.row(row)
        return MetricRecord(metrics) if metrics else None

    result = strategy.start(
        grid=grid, initial_arrays=arrays, num_rounds=cfg.num_rounds, timeout=cfg.round_timeout,
        train_config=ConfigRecord(), evaluate_fn=evaluate_fn,
    )
    path = save_weights(result.arrays.to_torch_state_dict(), folder / "model.pt")
    log(INFO, "Final weights: %s | results: %s", path, writer.path)
