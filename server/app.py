"""The ServerApp: run config -> model + the method's strategy -> rounds -> results file and weights.

Thin by design: the method is the run config's ``algorithm`` (``strategies.methods``), run
as a Flower strategy by ``strategies.flower_api.strategy``; the rows, evaluation and checkpoints are the
engine's too (``tasks.runs``); what is Flower's own -- the federation check, the watched
grid, partial participation's node choice, resuming under ``Strategy.start`` -- lives here
and beside it in ``server/``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from strategies.core.averaging import state_nbytes
from strategies.core.buffers import buffer_rules
from strategies.core.client_sampling import node_clients
from strategies.flower_api import fast_objects
from strategies.flower_api.strategy import ClippedSGDStrategy, flower_strategy
from strategies.methods import method
from strategies.methods.privacy import Privacy
from tasks import cached_task, check_partitions, initial_model
from tasks.config import RunConfig, shared_default_notes
from tasks.device import pick_device
from tasks.protocol import counts_rows, is_stateful, lr_scale_bound
from tasks.runs.checkpoint import Checkpoint, restore_strategy, resume_point, split_client_records
from tasks.runs.evaluation import Evaluator
from tasks.runs.recorder import RunRecorder
from tasks.runs.run_folder import claim_run_folder

from .faults import WatchedGrid
from .federation import Claim, Federation, decide, read_claim
from .memory import plan_memory
from .participation import client_assignment, fewest_nodes
from .resumed import ResumedStrategy

app = ServerApp()


class FederationError(RuntimeError):
    """The connected nodes do not match the run's num-clients."""



def strategy_metrics_only(records: list[RecordDict], weighted_by_key: str) -> MetricRecord:
    """No client metrics beyond the strategy's own definitions (the results rows' columns)."""
    return MetricRecord()


def build_strategy(cfg: RunConfig, train_size: int, **reply_checks: Any) -> ClippedSGDStrategy:
    """The Flower strategy of the method named by ``algorithm``, every setting from the config
    (``strategies.flower_api.strategy.flower_strategy``: the same arguments for every method).
    ``reply_checks``: ``verify_examples``, ``bound_keys``, ``max_lr_scale``, ``buffer_rules`` (``reply_checks``).
    """
    h = cfg.hyper
    return flower_strategy(method(cfg.algorithm))(
        **reply_checks,
        local_steps=h.local_steps, lr=h.lr, clip=h.clip, batch_size=h.batch_size, weight_decay=h.weight_decay,
        momentum=h.momentum, lr_decay=h.lr_decay, lr_milestones=h.lr_milestones, aggregation=h.aggregation,
        trim_fraction=h.trim_fraction,
        **{method(cfg.algorithm).own_keys()[k].name: v for k, v in cfg.method_options.items()},  # its own settings
        train_size=train_size, population=cfg.num_clients or None, exchange_timeout=cfg.round_timeout,
        num_clients=cfg.per_round or None, fraction_train=1.0, fraction_evaluate=0.0,  # 0: not yet resolved
        # every online node trains; a round needs min-replies of them (fault tolerance)
        min_train_nodes=cfg.required_replies, min_available_nodes=cfg.required_replies,
        train_metrics_aggr_fn=strategy_metrics_only,
        packed=True,  # this project's ClientApp: a message's arrays as one packed record each way (strategies.flower_api.packing)
        transport=cfg.transport,
        node_sums=cfg.node_aggregation,
    )


def reply_checks(task: object, model: torch.nn.Module) -> dict[str, Any]:
    """What the server checks in every reply beyond its structure: the example count (the
    server knows it: local-steps x batch-size rows), the clipping bound on the trainable
    parameters, the task's largest lr scale (``strategies.core.bound``, docs/DEPLOY.md), the model's
    BatchNorm layers (``strategies.core.buffers``: counters and variance floors)."""
    return {"verify_examples": counts_rows(task),
            "bound_keys": [k for k, p in model.named_parameters() if p.requires_grad],
            "max_lr_scale": lr_scale_bound(task), "buffer_rules": buffer_rules(model)}


def wait_for_federation(grid: Grid, cfg: RunConfig, poll: float = 0.1,
                        watched: WatchedGrid | None = None) -> tuple[list[int], int]:
    """Wait (at most ``node-wait`` s) for the whole federation: (its member nodes, their number K).

    Connected nodes are asked for their ``partition-id`` / ``num-partitions`` (a query
    message) and the federation decided from every answer (``server.federation``): K nodes
    with distinct partition ids 0..K-1, K <= num-clients (K < num-clients: each node serves
    every K-th client, ``strategies.core.client_sampling.node_clients``; nodes that report nothing:
    K = num-clients). A node whose answer is malformed or conflicts is excluded (never
    trained; ``watched`` records why, in round 1's failures) and the run starts without it
    while min-replies can be met; a federation of the wrong shape fails with the fix.
    """
    deadline = time.monotonic() + cfg.node_wait
    claims: dict[int, Claim | str] = {}
    while True:
        nodes = sorted(grid.get_node_ids())
        fresh = [n for n in nodes if n not in claims]
        if fresh:
            claims.update(_query(grid, fresh, cfg.round_timeout))
        fed = decide({n: c for n, c in claims.items() if n in nodes}, cfg.num_clients)
        if fed.size > cfg.num_clients:
            raise FederationError(
                f"run with --federation-config \"num-supernodes={cfg.num_clients}\" (or fewer: a node serves one "
                f"or more clients), or set num-clients={fed.size} (or num-clients=0 to follow the federation): the "
                f"federation has num-partitions={fed.size} but the run asks for num-clients={cfg.num_clients}; in "
                f"deployment start at most {cfg.num_clients} SuperNodes with --node-config \"partition-id=i "
                f"num-partitions=K\"")
        members, size = fed.members, fed.size
        if len(members) > size:
            raise FederationError(
                f"run with --federation-config \"num-supernodes={size}\" (at most num-clients={cfg.num_clients} nodes, "
                f"each serving one or more clients): {len(members)} nodes are connected but the federation has "
                f"num-partitions={size}")
        served = sum(len(node_clients(fed.partition_of[n], size, cfg.num_clients)) if n in fed.partition_of else 1
                     for n in members)
        complete = len(members) == size
        enough = bool(fed.excluded) and cfg.min_replies and served >= cfg.min_replies and len(nodes) >= size
        if complete or enough or time.monotonic() > deadline:
            if not complete and not (cfg.min_replies and served >= cfg.min_replies):
                raise FederationError(
                    f"in simulation run with --federation-config \"num-supernodes=K\" (K <= num-clients="
                    f"{cfg.num_clients}); in deployment start K SuperNodes with --node-config \"partition-id=i "
                    f"num-partitions=K\": only {len(members)} of the federation's {size} nodes connected within "
                    f"node-wait={cfg.node_wait:g} s" + _excluded_text(fed))
            if not complete:
                log(WARNING, "starting with %d of %d nodes (min-replies=%d)%s", len(members), size, cfg.min_replies,
                    _excluded_text(fed))
            if watched is not None:
                watched.partition_of.update(fed.partition_of)
                watched.claims.update({n: c for n, c in claims.items() if n in members and isinstance(c, Claim)})
                for node, reason in fed.excluded.items():
                    watched.exclude(node, f"query reply excluded, {reason}")
            if size < cfg.num_clients:
                log(INFO, "%d clients on %d nodes: node i serves clients i, i + %d, i + %d, ...", cfg.num_clients,
                    size, size, 2 * size)
            return members, size
        log(INFO, "Waiting for nodes: %d of %d connected", len(members), size)
        time.sleep(poll)


def _excluded_text(fed: Federation) -> str:
    return "".join(f"; node {n} excluded: {why}" for n, why in fed.excluded.items())


def _query(grid: Grid, nodes: list[int], timeout: float) -> dict[int, Claim | str]:
    """Each answering node's claim (``server.federation.read_claim``), in the order the answers came."""
    queries = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in nodes]
    out: dict[int, Claim | str] = {}
    for reply in grid.send_and_receive(queries, timeout=timeout):
        if reply.has_error():  # an app without a query handler: the train step checks again
            continue
        records = list(reply.content.metric_records.values())
        out[reply.metadata.src_node_id] = read_claim(dict(records[0])) if len(records) == 1 else \
            f"the query reply carries {len(records)} MetricRecords, expected exactly one"
    return out


def follow_federation(grid: Grid, cfg: RunConfig, poll: float = 0.1) -> RunConfig:
    """``cfg`` with num-clients resolved: 0 follows the ``num-partitions`` most nodes report
    (Flower's num-supernodes in simulation); a set value stays."""
    if cfg.num_clients:
        return cfg
    deadline = time.monotonic() + cfg.node_wait
    while not (nodes := sorted(grid.get_node_ids())):
        if time.monotonic() > deadline:
            raise FederationError(f"no node connected within node-wait={cfg.node_wait:g} s (num-clients=0 follows them)")
        time.sleep(poll)
    fed = decide(_query(grid, nodes, cfg.round_timeout), num_clients=0)
    if not fed.reported_size:
        raise FederationError(
            "set num-clients=N: num-clients=0 follows the num-partitions the nodes report (node config), "
            "and they report none" + _excluded_text(fed))
    log(INFO, "num-clients=0: following the federation, %d clients", fed.size)
    return cfg.replace(num_clients=fed.size)


def resume(cfg: RunConfig, folder: Path, strategy: object, model: torch.nn.Module) -> Checkpoint | None:
    """resume=true: the checkpoint to continue from (checked against ``model``), its strategy
    state restored; None: round 0."""
    if not cfg.resume:
        return None
    ckpt = resume_point(folder, cfg.to_mapping(), cfg.num_rounds, reference=model.state_dict())
    if ckpt is None:
        log(WARNING, "resume=true but %s holds no checkpoint: starting at round 0", folder)
        return None
    own, clients = split_client_records(ckpt.strategy_state)  # an engine's checkpoint holds its clients' state too
    restore_strategy(strategy, own)
    if clients:
        log(WARNING, "Resuming: the checkpoint's %s of clients %s cannot reach their ClientApps; they start afresh",
            " and ".join(clients), sorted({p for r in clients.values() for p in r}))
    log(INFO, "Resuming %s from its round-%d checkpoint", folder.name, ckpt.round)
    return ckpt


def resume_resets(cfg: RunConfig, task: object, strategy: object) -> str | None:
    """What a resumed Flower run cannot restore, said in its first row: the clients' own state lives in
    their ``Context.state``, which a new run starts empty (the engine keeps it in the checkpoint)."""
    lost = []
    if cfg.client_state == "keep" and is_stateful(task):
        lost.append("each client's kept task state (client-state=keep: hidden state, place in its text) starts afresh")
    if getattr(getattr(strategy, "algorithm", None), "keeps_client_memory", False):
        lost.append(f"each client's own memory of algorithm {cfg.algorithm!r} starts afresh")
    return "; ".join(lost) or None


@app.main()
def main(grid: Grid, context: Context) -> None:
    fast_objects.install()  # this process's messages: fewer copies, one hash a chunk (Flower's objects, same bytes)
    cfg = None
    try:
        cfg = RunConfig.from_app(dict(context.run_config))
        for note in shared_default_notes(cfg, context.run_config):
            log(INFO, "%s", note)
        run(grid, cfg)
    except Exception as exc:  # the cause (and fix) first, before Flower's traceback, naming the run's method
        what = "" if cfg is None else f" ({method(cfg.algorithm).label(cfg.local_steps)} on {cfg.task})"
        log(ERROR, "%s%s: %s", FAILED_MARK, what, one_line(exc))
        raise


#: the words a failed run's log line starts its cause with (``simulations.flower.RunFailed`` shows that line
#: first): ``celgc run failed (<method> on <task>): <exception>: <message>`` -- the project's name, not a
#: method's: the method follows in brackets once the run config was read
FAILED_MARK = "celgc run failed"


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


#: ``wrap(strategy) -> Strategy``: a Flower strategy around this project's (e.g. Flower's DP wrappers)
Wrap = Callable[[ClippedSGDStrategy], Strategy]


def run(grid: Grid, cfg: RunConfig, wrap: Wrap | None = None) -> None:
    """One run of ``cfg`` on the grid's federation: rounds, results, checkpoints, weights.

    ``wrap``: a Flower strategy around the method's (Flower's
    ``DifferentialPrivacyServerSideFixedClipping``, say) that drives the rounds instead of it;
    the reply checks, rows and checkpoints stay the inner strategy's (docs/how-to/flower-dp-wrappers.md, "Flower's own DP
    wrappers"). Refused together with this project's own DP keys (noise would be added twice)."""
    cfg = follow_federation(grid, cfg)
    if wrap is not None and cfg.dp.enabled:
        raise ValueError("dp-noise-multiplier > 0 and a wrapped strategy: noise would be added twice; use this "
                         "project's DP keys (dp-noise-multiplier = 0 with a wrapper) or Flower's wrapper, not both")
    folder = Path(cfg.results_dir).resolve() / cfg.folder_name()  # not the run folder: a link there is refused
    log(INFO, "%s run: %s -> results in %s", method(cfg.algorithm).label(cfg.local_steps), cfg.task, folder)
    with claim_run_folder(folder, resume=cfg.resume):
        run_in_folder(grid, cfg, folder, wrap)


def run_in_folder(grid: Grid, cfg: RunConfig, folder: Path, wrap: Wrap | None = None) -> None:
    """The run in its (claimed) folder: federation check, rounds, results rows, checkpoints, weights
    (``wrap``: see ``run``)."""
    task = cached_task(cfg)
    device = pick_device(cfg.device)
    check_partitions(cfg)
    model = initial_model(task, cfg.seed).to(device)
    arrays = ArrayRecord(model.state_dict())
    checks = reply_checks(task, model)
    strategy = build_strategy(cfg, task.train_size, **checks)
    privacy = dp_mechanism(cfg, model, checks)
    strategy.algorithm.privacy = privacy  # every round's release goes through it (strategies.round)
    last = privacy.last_round(cfg.num_rounds) if privacy is not None else cfg.num_rounds
    ckpt = resume(cfg, folder, strategy, model)
    done = ckpt.round if ckpt else 0
    if ckpt:
        arrays = ArrayRecord(ckpt.arrays)
    watched = WatchedGrid(grid, min_clients=cfg.required_replies, node_wait=cfg.node_wait)
    nodes, spread = wait_for_federation(grid, cfg, watched=watched)
    watched.expect(nodes, cfg.num_clients, spread)
    plan_memory(cfg, state_nbytes(model.state_dict()), watched, nodes)  # refused before round 1 if it cannot fit
    # the round's clients (all, or the K sampled: the same on every backend) and the node serving each;
    # hosts with their own data and no partition-id are one client each, known by their node
    strategy.assign = client_assignment(cfg, watched, privacy) if _all_named(cfg, watched, nodes, spread) else None
    strategy.min_train_nodes = strategy.min_available_nodes = fewest_nodes(watched, nodes, cfg.required_replies)
    header = {"train-size": task.train_size, "model-bytes": state_nbytes(model.state_dict())}
    if privacy is not None:
        header["privacy"] = privacy.header()
        for line in privacy.summary():
            log(INFO, "DP: %s", line)
    recorder = RunRecorder(cfg, Evaluator(cfg, task, model, device), folder, header, resumed=ckpt, last_round=last,
                           stop_reason=privacy.stop_reason(cfg.num_rounds) if privacy is not None else None,
                           resume_resets=resume_resets(cfg, task, strategy))
    last_mode = strategy.algorithm.modes[-1]

    def evaluate_fn(server_round: int, round_arrays: ArrayRecord) -> MetricRecord | None:
        state = round_arrays.to_torch_state_dict()  # once a round: evaluation, finiteness, checkpoint
        report, failures, failed, rejected = None, [], [], 0
        if server_round > 0:
            report = strategy.last_report
            grid_failures = watched.take_failures()
            named = [f"{_name(r.client)}: {'' if r.mode is last_mode else f'{r.mode.value} '}"
                     f"rejected, {r.reason}" for r in (report.rejected if report is not None else [])]
            failures = [WatchedGrid.describe({k: v}) for k, v in grid_failures.items()] + named
            failed = sorted(grid_failures, key=lambda k: (isinstance(k, str), k if isinstance(k, int) else 0, str(k)))
            rejected = watched.take_rejected()
        row = recorder.record(server_round, strategy.epoch_at(server_round), state, report, failures=failures,
                              failed_nodes=failed, rejected=rejected, server_state=strategy.state_dict())
        if "dp-epsilon" in row:
            log(INFO, "Round %d: DP epsilon = %.4g at delta = %.3g%s", server_round, row["dp-epsilon"], row["dp-delta"],
                "" if row.get("dp-private") else " (dp-reproducible: NOT private)")
        return MetricRecord(recorder.last_evaluation) if recorder.last_evaluation else None

    final = arrays
    if done < last:
        if wrap is not None:  # a Flower wrapper reads and rewrites the replies' ArrayRecords: Flower's usual format
            strategy.packed = False
        outer = wrap(strategy) if wrap is not None else strategy
        runner = ResumedStrategy(outer, done) if done else outer
        result = runner.start(
            grid=watched, initial_arrays=arrays, num_rounds=last - done, timeout=cfg.round_timeout,
            train_config=ConfigRecord(), evaluate_fn=runner.shift_evaluate(evaluate_fn) if done else evaluate_fn,
        )
        final = result.arrays
    if recorder.stop_reason:
        log(WARNING, "DP budget: %s", recorder.stop_reason)
    path = recorder.finish(final.to_torch_state_dict())
    log(INFO, "Final weights: %s | results: %s", path, recorder.path)


def dp_mechanism(cfg: RunConfig, model: torch.nn.Module, checks: dict[str, Any]) -> Privacy | None:
    """The run's DP mechanism (dp-noise-multiplier > 0; ``strategies.methods.privacy``), as the engine builds it."""
    if not cfg.dp.enabled:
        return None
    return Privacy(cfg.dp, population=cfg.num_clients, per_round=cfg.per_round, seed=cfg.seed, state=model.state_dict(),
                   trainable=checks["bound_keys"], max_lr_scale=checks["max_lr_scale"])


def _all_named(cfg: RunConfig, grid: WatchedGrid, nodes: list[int], spread: int) -> bool:
    """Whether every node has a partition id; hosts with their own data may have none, in a
    federation of one node a client where every client trains every round."""
    anonymous = [n for n in nodes if n not in grid.partition_of]
    if anonymous and (cfg.per_round < cfg.num_clients or spread < cfg.num_clients):
        raise FederationError(
            f"give node(s) {anonymous} --node-config \"partition-id=i\" (a host with its own data then seeds its "
            f"sampling like partition i), or run every client every round with one node each: they reported no "
            f"partition-id, and "
            f"clients-per-round={cfg.clients_per_round} and {spread} nodes for num-clients={cfg.num_clients} "
            "sample and place clients by partition id")
    return not anonymous


def _name(label: int | str) -> str:
    return f"partition {label}" if isinstance(label, int) else str(label)
