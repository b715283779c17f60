"""What CELGC and naive parallel clipping share as Flower strategies: the clipped-SGD
settings, the paper's schedule, the round config, and reply handling.

``ClippedSGDStrategy`` is a ``FedAvg`` that honours FedAvg's contract (``weighted_by_key``,
``arrayrecord_key``, ``configrecord_key``, ``train_metrics_aggr_fn`` and
``evaluate_metrics_aggr_fn``, float weights) and adds the clipped-SGD round: it samples
``num_clients`` clients, sends each the global arrays and the round's step settings, reads
and checks every reply in ONE place (``read_reply``; a bad reply is rejected and counted,
never averaged and never a crash), and hands the sound payloads to ``combine`` -- averaging
parameters (CELGC) or taking one clipped step on averaged gradients (naive). Subclasses add
their own knobs; none inherits a knob it must forbid.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.exception import InconsistentMessageReplies
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords, sample_nodes
from flwr.supercore import log

from .averaging import AGGREGATIONS, NON_FINITE, check_state, client_weights, state_nbytes
from .replies import parse_metrics
from .schedule import global_epoch, scheduled

#: round-config key -> the strategy argument that sets it (a caller's train_config may not set these)
OWNED_KEYS = {"local-steps": "local_steps", "lr": "lr", "clip": "clip", "weight-decay": "weight_decay",
              "momentum": "momentum", "batch-size": "batch_size"}

#: CELGC's own client metrics: a reply with neither comes from a ClientApp that does not run local clipped SGD
OWN_METRICS = ("num-steps", "clip-fraction")


@dataclass
class ReadReply:
    """One reply, read: its payload, metrics and weight, or the reason it is rejected."""

    node: int
    content: RecordDict
    payload: Any = None
    metrics: MetricRecord | None = None
    weight: float = 0.0
    reason: str | None = None


class ClippedSGDStrategy(FedAvg):
    """Base of the clipped-SGD strategies: settings, schedule, round config, reply handling.

    Parameters
    ----------
    lr : float
        eta, the learning rate (> 0).
    clip : float (default: 1.0)
        gamma, the clipping threshold (> 0); ``math.inf`` disables clipping.
    batch_size : int (default: 32)
        Minibatch size of every step.
    weight_decay, momentum : float (default: 0.0)
        lambda and mu (torch.optim.SGD semantics; the paper uses mu = 0).
    lr_decay : float (default: 0.1)
        Factor applied to lr and clip at each milestone.
    lr_milestones : sequence of float (default: ())
        Global epochs at which lr and clip decay. Needs ``train_size``. Epochs are counted
        from the clients actually sampled in each round.
    train_size : int, optional
        Training-set size (all clients together), to count global epochs.
    aggregation : {"uniform", "examples"} (default: "uniform")
        Uniform mean (the paper) or weighted by each reply's ``weighted_by_key`` value.
    num_clients : int, optional
        Clients sampled per round: exactly ``num_clients`` once that many nodes are
        connected (at least ``min_train_nodes``, which defaults to ``num_clients``: the
        round waits for them). None: FedAvg's ``fraction_train`` sampling.
    verify_examples : bool (default: False)
        Reject a reply whose ``num-examples`` is not ``local_steps * batch_size`` (what a
        client that counts a batch's rows processes): the server does not trust a client's
        count. Off for clients that count examples otherwise.
    bound_keys : sequence of str, optional
        Names of the trainable parameters: reject a reply that moved them farther from the
        global model than ``local_steps`` clipped steps can (``strategies.bound``; off where
        no bound holds: momentum > 0 or clip = inf).
    max_lr_scale : float (default: 1.0)
        The largest per-step lr scale an honest client uses (batches' ``lr_scale``);
        ``math.inf`` turns the clipping-bound filter off.
    select : callable, optional
        ``select(server_round, node_ids) -> node_ids``: which of the connected nodes
        (sorted ids, at least ``min_available_nodes`` of them, waited for) train in the
        round, instead of a uniform random sample -- e.g. the nodes holding the round's
        partitions under partial participation (``strategies.participation``), so every
        backend trains the same clients. It must return distinct connected node ids.
    **fedavg_kwargs
        Passed to ``FedAvg``: ``fraction_train``, ``fraction_evaluate``, ``min_train_nodes``,
        ``min_evaluate_nodes``, ``min_available_nodes``, ``weighted_by_key`` (default
        ``"num-examples"``: every reply needs it, a real number >= 0), ``arrayrecord_key``,
        ``configrecord_key``, ``train_metrics_aggr_fn`` (the clients' own metrics, kept in
        the round's metrics beside the strategy's), ``evaluate_metrics_aggr_fn``.

    The round's ``ConfigRecord`` holds the caller's ``train_config`` plus the keys in
    ``OWNED_KEYS`` (and ``server-round``); a ``train_config`` that sets an owned key is an
    error naming it (set the strategy's argument instead).
    """

    #: local steps per round (CELGC: its ``local_steps``; naive parallel clipping: 1)
    local_steps: int = 1
    #: True where a reply cannot be used without the global model of ``configure_train``
    needs_global: bool = False

    def __init__(
        self,
        lr: float,
        clip: float = 1.0,
        batch_size: int = 32,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        lr_decay: float = 0.1,
        lr_milestones: Sequence[float] = (),
        train_size: int | None = None,
        aggregation: str = "uniform",
        num_clients: int | None = None,
        verify_examples: bool = False,
        bound_keys: Sequence[str] | None = None,
        max_lr_scale: float = 1.0,
        select: Callable[[int, list[int]], Sequence[int]] | None = None,
        **fedavg_kwargs: Any,
    ) -> None:
        if num_clients is not None:
            if isinstance(num_clients, bool) or not (isinstance(num_clients, int) and num_clients >= 1):
                raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
            fedavg_kwargs.setdefault("min_train_nodes", num_clients)
            fedavg_kwargs.setdefault("min_available_nodes", num_clients)
        super().__init__(**fedavg_kwargs)
        checks: list[tuple[bool, str]] = [
            (math.isfinite(lr) and lr > 0, f"lr must be a finite number > 0, got {lr!r}"),
            (clip > 0, f"clip must be > 0 (math.inf disables clipping), got {clip!r}"),
            (isinstance(batch_size, int) and batch_size >= 1, f"batch_size must be an integer >= 1, got {batch_size!r}"),
            (math.isfinite(weight_decay) and weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay!r}"),
            (0 <= momentum < 1, f"momentum must be in [0, 1), got {momentum!r}"),
            (0 < lr_decay <= 1, f"lr_decay must be in (0, 1], got {lr_decay!r}"),
            (aggregation in AGGREGATIONS, f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}"),
            (not lr_milestones or train_size is not None, "lr_milestones are global epochs: pass train_size too"),
            (train_size is None or train_size >= 1, f"train_size must be >= 1, got {train_size!r}"),
            (list(lr_milestones) == sorted(lr_milestones), f"lr_milestones must be increasing, got {list(lr_milestones)}"),
            (max_lr_scale >= 1, f"max_lr_scale must be >= 1 (math.inf: no bound), got {max_lr_scale!r}"),
            (select is None or callable(select), f"select must be callable (server_round, node_ids) -> node_ids, got {select!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.lr = float(lr)
        self.clip = float(clip)
        self.batch_size = batch_size
        self.weight_decay = float(weight_decay)
        self.momentum = float(momentum)
        self.lr_decay = float(lr_decay)
        self.lr_milestones = tuple(float(m) for m in lr_milestones)
        self.train_size = train_size
        self.aggregation = aggregation
        self.num_clients = num_clients
        self.verify_examples = verify_examples
        self.bound_keys = list(bound_keys) if bound_keys is not None else None
        self.max_lr_scale = float(max_lr_scale)
        self.select = select
        self._global: dict[str, torch.Tensor] = {}
        self._sent: dict[int, int] = {}  # round -> number of train messages sent (clients sampled)
        self._warned_foreign = False
        self.last_round_metrics: MetricRecord | None = None
        self.last_failures: list[str] = []

    # --- settings ---------------------------------------------------------------------
    def _summary_lines(self) -> list[str]:
        """The algorithm's own first line(s) of ``summary()``."""
        return []

    def summary(self) -> None:
        """Log every setting."""
        log(INFO, "\t├──> %s settings:", type(self).__name__)
        for line in self._summary_lines():
            log(INFO, "\t│\t├── %s", line)
        log(INFO, "\t│\t├── lr: %g | clip: %s | weight decay: %g | momentum: %g",
            self.lr, "off" if math.isinf(self.clip) else f"{self.clip:g}", self.weight_decay, self.momentum)
        log(INFO, "\t│\t├── schedule: x%g at global epochs %s (train size %s)",
            self.lr_decay, list(self.lr_milestones), self.train_size)
        log(INFO, "\t│\t├── aggregation: %s | clients per round: %s", self.aggregation, self.num_clients or "all")
        log(INFO, "\t│\t└── non-finite or mis-shaped replies are rejected")
        super().summary()

    def clients_per_round(self) -> int:
        """The clients a round samples when every node is connected."""
        return self.num_clients or max(self.min_train_nodes, 1)

    def clients_before(self, server_round: int) -> int:
        """Clients sampled in rounds 1 .. server_round - 1 (a round this strategy did not
        configure, e.g. before a resume, counts ``clients_per_round()``)."""
        nominal = self.clients_per_round()
        return sum(self._sent.get(r, nominal) for r in range(1, server_round))

    def epoch_at(self, rounds_done: int, clients_per_round: int | None = None) -> float | None:
        """Global epochs after ``rounds_done`` rounds (None without ``train_size``); by
        default counted from the clients sampled, else at ``clients_per_round`` a round."""
        if self.train_size is None:
            return None
        if clients_per_round is not None:
            return global_epoch(rounds_done, clients_per_round, self.local_steps, self.batch_size, self.train_size)
        return global_epoch(self.clients_before(rounds_done + 1), 1, self.local_steps, self.batch_size, self.train_size)

    def round_hparams(self, server_round: int, clients_per_round: int | None = None) -> tuple[float, float]:
        """(lr, clip) of a round after the schedule (epochs completed before the round; by
        default counted from the clients sampled, else at ``clients_per_round`` a round)."""
        if self.train_size is None:
            return self.lr, self.clip
        if clients_per_round is None:
            rounds_done, clients_per_round = self.clients_before(server_round), 1
        else:
            rounds_done = server_round - 1
        return scheduled(self.lr, self.clip, rounds_done, clients_per_round, self.local_steps, self.batch_size,
                         self.train_size, self.lr_milestones, self.lr_decay)

    def round_config(self, server_round: int, clients_per_round: int | None = None) -> dict[str, Any]:
        """The step settings every client receives in ``server_round``."""
        lr, clip = self.round_hparams(server_round, clients_per_round)
        return {
            "local-steps": self.local_steps,
            "lr": lr,
            "clip": clip,
            "weight-decay": self.weight_decay,
            "momentum": self.momentum,
            "batch-size": self.batch_size,
        }

    def owned_keys(self) -> dict[str, str]:
        """Round-config keys this strategy sets -> the argument that sets them."""
        return dict(OWNED_KEYS)

    # --- rounds -----------------------------------------------------------------------
    def sample(self, grid: Grid, server_round: int | None = None) -> list[int]:
        """This round's clients: ``num_clients`` of the connected nodes (FedAvg's
        ``fraction_train`` without it), at least ``min_train_nodes`` (waited for); with
        ``select``, the nodes it picks for ``server_round``."""
        if self.select is not None:
            return self._selected(grid, server_round)
        connected = len(list(grid.get_node_ids()))
        if self.num_clients is None:
            size = max(int(connected * self.fraction_train), self.min_train_nodes)
        else:
            size = max(min(self.num_clients, connected), self.min_train_nodes)
        node_ids, everyone = sample_nodes(grid, self.min_available_nodes, size)
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_ids), len(everyone))
        return node_ids

    def _selected(self, grid: Grid, server_round: int | None) -> list[int]:
        if server_round is None:
            raise ValueError("sample(grid, server_round) needs the round when the strategy has a select function")
        _, everyone = sample_nodes(grid, self.min_available_nodes, 0)  # waits for min_available_nodes
        connected = sorted(everyone)
        node_ids = [int(n) for n in self.select(server_round, connected)]
        strays = sorted(set(node_ids) - set(connected))
        if strays or len(set(node_ids)) != len(node_ids):
            raise ValueError(f"select({server_round}, ...) must return distinct connected node ids, got {node_ids} "
                             f"(connected: {connected})")
        log(INFO, "configure_train: Selected %s nodes (out of %s)", len(node_ids), len(connected))
        return node_ids

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Send the global arrays and this round's settings to the sampled clients."""
        owned = self.owned_keys()
        clash = [k for k in config if k in owned]
        if clash:
            raise ValueError(
                f"train_config sets {', '.join(repr(k) for k in clash)}, which {type(self).__name__} sends every round: "
                f"set {', '.join(f'{owned[k]}=' for k in clash)} on the strategy instead"
            )
        if self.fraction_train == 0.0:
            return []
        node_ids = self.sample(grid, server_round)
        own = ConfigRecord(dict(config))  # never mutate the caller's record
        for key, value in self.round_config(server_round).items():
            own[key] = value
        own["server-round"] = server_round
        self._global = arrays.to_torch_state_dict()
        self._sent[server_round] = len(node_ids)
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: own})
        return list(self._construct_messages(record, node_ids, MessageType.TRAIN))

    def unpack(self, content: RecordDict) -> tuple[Any, str | None]:
        """(payload, reason to reject or None) of one reply's arrays."""
        raise NotImplementedError

    def payload_state(self, payload: Any) -> dict[str, torch.Tensor]:
        """The tensors of a payload, checked against the global model (keys, shapes, dtypes)."""
        raise NotImplementedError

    def combine(self, server_round: int, payloads: list[Any], weights: list[float],
                metrics: list[MetricRecord]) -> tuple[dict[str, torch.Tensor], dict[str, float | int]]:
        """The new global state and the round's metrics from the sound replies."""
        raise NotImplementedError

    def read_reply(self, msg: Message) -> ReadReply:
        """Read one reply: its MetricRecord, its weight (``weighted_by_key``) and its payload
        (``unpack``), or the reason it is rejected. The one place a reply is read."""
        node, content = msg.metadata.src_node_id, msg.content
        records = content.metric_records
        if len(records) != 1:
            return ReadReply(node, content, reason=f"expected exactly one MetricRecord, got {len(records)}")
        metrics = next(iter(records.values()))
        if self.weighted_by_key not in metrics:
            return ReadReply(node, content, metrics=metrics, reason=f"metrics lack {self.weighted_by_key!r} (weighted_by_key)")
        weight = metrics[self.weighted_by_key]
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not (math.isfinite(weight) and weight >= 0):
            return ReadReply(node, content, metrics=metrics,
                             reason=f"{self.weighted_by_key} must be a finite number >= 0, got {weight!r}")
        _, reason = parse_metrics(metrics)
        if reason is None and self.verify_examples and "num-examples" in metrics:
            expected = self.local_steps * self.batch_size
            if metrics["num-examples"] != expected:
                reason = (f"num-examples {metrics['num-examples']!r} is not the {expected} examples of "
                          f"{self.local_steps} step(s) of batch size {self.batch_size}")
        if reason is not None:
            return ReadReply(node, content, metrics=metrics, reason=reason)
        payload, reason = self.unpack(content)
        return ReadReply(node, content, payload=payload, metrics=metrics, weight=float(weight), reason=reason)

    def check_payload(self, server_round: int, payload: Any, metrics: MetricRecord) -> str | None:
        """Why a structurally sound reply cannot come from an honest client this round, or
        None (subclasses: the clipping bound, naive's lr-scale); needs the round's global model."""
        return None

    def reference(self, read: list[ReadReply]) -> dict[str, torch.Tensor] | None:
        """What replies are checked against: the global model sent this round, or without
        ``configure_train`` the layout (keys, shapes, dtypes) most replies share."""
        if self._global:
            return self._global
        if self.needs_global:
            return None
        layouts = Counter(_layout(self.payload_state(r.payload)) for r in read if r.reason is None)
        if not layouts:
            return None
        common = layouts.most_common(1)[0][0]
        return next(self.payload_state(r.payload) for r in read if r.reason is None
                    and _layout(self.payload_state(r.payload)) == common)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Read and check every reply, then ``combine`` the sound ones; count rejected and
        failed ones. Every reply rejected for one structural reason raises
        ``InconsistentMessageReplies`` naming it (as FedAvg does), instead of an empty round."""
        replies = list(replies)
        ok, failed = self._check_and_log_replies(replies, is_train=True, validate=False)
        self.last_failures = [f"node {m.metadata.src_node_id}: {m.error.reason}" for m in failed]
        read = [self.read_reply(msg) for msg in ok]
        ref = self.reference(read)
        for r in read:
            if r.reason is None:
                r.reason = (check_state(self.payload_state(r.payload), ref) if ref is not None else
                            "no global model for this round: configure_train must run first")
            if r.reason is None and self._global:
                r.reason = self.check_payload(server_round, r.payload, r.metrics)
        sound = [r for r in read if r.reason is None]
        rejected = [r for r in read if r.reason is not None]
        for r in rejected:
            self.last_failures.append(f"node {r.node}: rejected, {r.reason}")
            log(WARNING, "Round %d: rejected reply from node %d: %s", server_round, r.node, r.reason)
        reasons = {r.reason for r in rejected}
        if rejected and not sound and len(reasons) == 1 and not next(iter(reasons)).endswith(NON_FINITE):
            raise InconsistentMessageReplies(
                reason=f"round {server_round}: all {len(rejected)} replies rejected: {next(iter(reasons))}")
        self._warn_foreign(sound)
        sent = self._sent.get(server_round, 0)
        summary = MetricRecord({
            "replies": len(sound),
            "rejected-replies": len(rejected),
            "failed-replies": len(failed) + max(sent - len(replies), 0),
            "bytes-sent": state_nbytes(self._global) * sent,
            "bytes-received": sum(state_nbytes(self.payload_state(r.payload)) for r in read if r.payload is not None),
        })
        if not sound:
            log(WARNING, "Round %d: no sound replies, the global model is unchanged", server_round)
            self.last_round_metrics = summary
            return None, summary
        weights = client_weights([r.weight for r in sound], self.aggregation, self.weighted_by_key)
        metrics = [r.metrics for r in sound]
        state, round_metrics = self.combine(server_round, [r.payload for r in sound], weights, metrics)
        summary.update(round_metrics)
        for key, value in self._clients_metrics([r.content for r in sound]).items():
            if key not in summary:  # the clients' own metrics; the strategy's own definitions win
                summary[key] = value
        self.last_round_metrics = summary
        return ArrayRecord(state), summary

    def _clients_metrics(self, contents: list[RecordDict]) -> MetricRecord:
        """``train_metrics_aggr_fn`` over the sound replies (FedAvg's default: the weighted mean
        by ``weighted_by_key``); metrics the default cannot average are left out with a warning."""
        if self.train_metrics_aggr_fn is not aggregate_metricrecords:
            return self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        try:
            return self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            log(WARNING, "The clients' own metrics could not be averaged by %r (%s): left out",
                self.weighted_by_key, exc)
            return MetricRecord()

    def _warn_foreign(self, sound: list[ReadReply]) -> None:
        """One warning when replies carry none of CELGC's own metrics."""
        foreign = [r.node for r in sound if r.metrics is not None and not any(k in r.metrics for k in OWN_METRICS)]
        if foreign and not self._warned_foreign:
            self._warned_foreign = True
            log(WARNING, "Replies from node(s) %s carry none of %s: those ClientApps are not running local clipped "
                "SGD (they ignore local-steps, lr and clip). Use strategies.clientapp in the ClientApp.",
                foreign, list(OWN_METRICS))


def _layout(state: dict[str, torch.Tensor]) -> tuple:
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in state.items()))
