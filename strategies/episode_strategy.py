"""EPISODE as a Flower strategy: two exchanges a round, resampled gradients then local steps."""

from __future__ import annotations

import math
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from .averaging import NON_FINITE, state_nbytes
from .celgc import CELGC
from .episode import CORRECTION_KEY, EPISODE_MODE, GLOBAL_NORM_KEY, RESAMPLE_MODE, corrections


class EPISODE(CELGC):
    """EPISODE: episodic gradient clipping with periodic resampled corrections.

    Crawshaw, Bao, Liu (ICLR 2023), https://arxiv.org/abs/2302.07155, Algorithm 1 (the
    math: ``strategies.episode``). A round has two exchanges with the sampled clients:

    1. ``configure_train`` sends the global arrays with ``mode = "episode-resample"`` and
       waits (``grid.send_and_receive``, ``resample_timeout``) for each client's gradient
       G_r^i at the global point on a fresh minibatch (a ``gradient_reply``: ArrayRecords
       ``grads`` and ``buffers``, drawn from the resample stream
       ``strategies.episode.resample_seed``). It averages them into G_r (uniformly, or by
       examples with ``aggregation = "examples"``) and builds each client's correction
       c_i = G_r - G_r^i. A client whose resample failed or was unsound (keys or shapes
       other than the trainable parameters', non-finite values) is left out of the round.
    2. The train messages carry the global arrays, ArrayRecord ``correction`` (c_i) and in
       the ConfigRecord ``mode = "episode"`` and ``global-grad-norm`` (‖G_r‖): the client
       runs I local EPISODE steps, clipping every step iff ‖G_r‖ > clip/lr, and returns its
       parameters, which are averaged as in CELGC.

    Bytes: ``bytes-sent`` counts the global model twice per client (both exchanges) plus
    each correction; ``bytes-received`` the resample replies (gradients and buffers) plus
    the parameter replies. Round metrics add ``global-grad-norm`` (‖G_r‖) and
    ``resample-failures``. Global epochs count the I local steps' samples (as CELGC), not
    the resample minibatch.

    Parameters
    ----------
    local_steps, lr, **kwargs
        As for :class:`strategies.celgc.CELGC`.
    resample_timeout : float, optional
        Seconds to wait for the resampled gradients (None: no limit).
    """

    def __init__(self, local_steps: int, lr: float, resample_timeout: float | None = None, **kwargs: Any) -> None:
        if resample_timeout is not None and not (resample_timeout > 0):
            raise ValueError(f"resample_timeout must be > 0 seconds or None, got {resample_timeout!r}")
        super().__init__(local_steps=local_steps, lr=lr, **kwargs)
        self.resample_timeout = resample_timeout
        self._traffic: dict[int, tuple[int, int]] = {}  # round -> (bytes sent, bytes received) of the resample
        self._resample_metrics: dict[int, dict[str, float | int]] = {}

    def _summary_lines(self) -> list[str]:
        return [f"local steps I: {self.local_steps} | batch size: {self.batch_size}",
                "each round: resampled gradients at the global point -> corrections c_i and one clip decision"]

    def owned_keys(self) -> dict[str, str]:
        return {**super().owned_keys(), "mode": "(the strategy's class)", GLOBAL_NORM_KEY: "(the strategy's class)"}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Exchange 1 (resampled gradients, here) and the messages of exchange 2."""
        first = list(super().configure_train(server_round, arrays, config, grid))
        if not first:
            return []
        for msg in first:
            msg.content[self.configrecord_key]["mode"] = RESAMPLE_MODE
        out_bytes = state_nbytes(self._global) * len(first)
        replies = list(grid.send_and_receive(first, timeout=self.resample_timeout))
        grads, nodes, weights, received, failed = self._read_resample(server_round, replies)
        failed += max(len(first) - len(replies), 0)
        self._resample_metrics[server_round] = {"resample-failures": failed}
        if not grads:
            log(WARNING, "Round %d: no sound resampled gradient, the round is skipped", server_round)
            self._sent[server_round] = 0
            self._traffic[server_round] = (out_bytes, received)
            return []
        g_mean, corr, norm = corrections(grads, weights if self.aggregation == "examples" else None)
        del g_mean
        self._resample_metrics[server_round]["global-grad-norm"] = norm
        self._traffic[server_round] = (out_bytes + sum(state_nbytes(c) for c in corr), received)
        self._sent[server_round] = len(nodes)
        own = ConfigRecord(dict(first[0].content[self.configrecord_key]))
        own["mode"] = EPISODE_MODE
        own[GLOBAL_NORM_KEY] = norm
        log(INFO, "configure_train: %d resampled gradients, |G_r| = %g", len(grads), norm)
        return [Message(content=RecordDict({self.arrayrecord_key: arrays, CORRECTION_KEY: ArrayRecord(c),
                                    self.configrecord_key: own}), dst_node_id=node, message_type=MessageType.TRAIN)
                for node, c in zip(nodes, corr, strict=True)]

    def _read_resample(self, server_round: int, replies: list[Message]
                       ) -> tuple[list[dict[str, torch.Tensor]], list[int], list[float], int, int]:
        """(gradients, their nodes, their weights, bytes received, failed) of the resample replies."""
        grads, nodes, weights, received, failed = [], [], [], 0, 0
        trainable = None
        for msg in replies:
            if msg.has_error():
                failed += 1
                log(WARNING, "Round %d: resample failed on node %d: %s", server_round, msg.metadata.src_node_id,
                    msg.error.reason)
                continue
            got, why = self._resample_payload(msg)
            if got is not None:
                received += sum(state_nbytes(a.to_torch_state_dict()) for a in msg.content.array_records.values())
            if why is None:
                grad, weight = got
                if trainable is None:
                    trainable = set(grad)
                if set(grad) != trainable:
                    why = "its gradients name other parameters than the other clients'"
            if why is not None:
                failed += 1
                self.last_failures.append(f"node {msg.metadata.src_node_id}: resample rejected, {why}")
                log(WARNING, "Round %d: resample from node %d rejected: %s", server_round, msg.metadata.src_node_id, why)
                continue
            grads.append(grad)
            nodes.append(msg.metadata.src_node_id)
            weights.append(weight)
        return grads, nodes, weights, received, failed

    def _resample_payload(self, msg: Message) -> tuple[tuple[dict[str, torch.Tensor], float] | None, str | None]:
        """((G_r^i, weight), None) or (payload or None, reason to leave the client out)."""
        content = msg.content
        if set(content.array_records) != {"grads", "buffers"}:
            return None, f"expected ArrayRecords 'grads' and 'buffers', got {sorted(content.array_records)}"
        try:
            grad = content.array_records["grads"].to_torch_state_dict()
        except Exception as exc:  # a malformed payload must not end the run
            return None, f"arrays could not be decoded ({exc})"
        metrics = list(content.metric_records.values())
        weight = metrics[0].get(self.weighted_by_key) if len(metrics) == 1 else None
        payload = (grad, float(weight) if isinstance(weight, (int, float)) and not isinstance(weight, bool) else 0.0)
        if self.aggregation == "examples" and not (isinstance(weight, (int, float)) and math.isfinite(weight)
                                                   and weight >= 0):
            return payload, f"{self.weighted_by_key} must be a finite number >= 0, got {weight!r}"
        if not grad:
            return payload, "no gradients"
        for key, value in grad.items():
            ref = self._global.get(key)
            if ref is None:
                return payload, f"gradient of {key!r}, which the global model does not hold"
            if tuple(value.shape) != tuple(ref.shape) or value.dtype != ref.dtype:
                return payload, f"{key} has shape {tuple(value.shape)} / {value.dtype}, expected {tuple(ref.shape)} / {ref.dtype}"
            if not bool(torch.isfinite(value).all()):
                return payload, f"{key} {NON_FINITE}"
        return payload, None

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """CELGC's averaging; the resample exchange's bytes and ‖G_r‖ added to the metrics."""
        arrays, metrics = super().aggregate_train(server_round, replies)
        sent, received = self._traffic.pop(server_round, (0, 0))
        extra = self._resample_metrics.pop(server_round, {})
        if metrics is not None:
            metrics["bytes-sent"] = int(metrics.get("bytes-sent", 0)) + sent
            metrics["bytes-received"] = int(metrics.get("bytes-received", 0)) + received
            for key, value in extra.items():
                metrics[key] = value
        return arrays, metrics
