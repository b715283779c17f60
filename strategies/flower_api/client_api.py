"""The client API of CELGC for any Flower ClientApp: settings in, I clipped steps, a reply out.

Everything a ClientApp needs to take part in a CELGC (or NaiveParallelClip) run, in one
import; the math is ``strategies.core.local_update`` (pure PyTorch)::

    from strategies.clientapp import local_update, round_settings, train_reply

    @app.train()
    def train(msg, context):
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        settings = round_settings(msg)                      # error naming every missing key
        metrics = local_update(model, loader, loss_fn, settings)   # exactly local-steps batches
        return train_reply(msg, model, metrics)             # one ArrayRecord + one MetricRecord

``local_update`` takes any iterable of batches (tuples, dicts, custom objects; a DataLoader
is restarted when it runs out) and ``count=`` where the number of examples of a batch
cannot be inferred. The reply's MetricRecord holds ``num-examples`` (int), ``num-steps``,
``clip-fraction``, ``train-loss``, ``grad-norm``, ``skipped-steps`` and any extra metrics.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from torch import nn

from ..core.clipped_sgd import StepConfig
from ..core.local_update import ConfigError, RoundSettings, RoundStats, count_examples, local_update

__all__ = ["ConfigError", "RoundSettings", "RoundStats", "StepConfig", "count_examples", "gradient_reply",
           "local_update", "round_settings", "train_reply"]


def round_settings(msg: Message | Mapping, configrecord_key: str | None = None) -> RoundSettings:
    """The round's settings from a train Message (its one ConfigRecord, or ``configrecord_key``)
    or from a ConfigRecord / mapping; an error names every missing key."""
    if isinstance(msg, Message):
        records = msg.content.config_records
        if configrecord_key is not None:
            if configrecord_key not in records:
                raise ConfigError(f"the message has no ConfigRecord {configrecord_key!r} (it has {sorted(records)})")
            config: Mapping = records[configrecord_key]
        elif len(records) == 1:
            config = next(iter(records.values()))
        else:
            raise ConfigError(f"the message holds {len(records)} ConfigRecords {sorted(records)}: pass configrecord_key=")
    else:
        config = msg
    return RoundSettings.from_config(config)


def _state(model_or_state: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = model_or_state.state_dict() if isinstance(model_or_state, nn.Module) else model_or_state
    return {k: v.detach().cpu() for k, v in state.items()}


def _metrics(metrics: Mapping[str, float | int], extra: Mapping[str, float | int] | None) -> MetricRecord:
    out = {**metrics, **(extra or {})}
    n = out.get("num-examples")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"metrics need an integer num-examples >= 0 (local_update reports it), got {n!r}")
    return MetricRecord(out)


def train_reply(msg: Message, model_or_state: nn.Module | Mapping[str, torch.Tensor],
                metrics: Mapping[str, float | int], extra: Mapping[str, float | int] | None = None) -> Message:
    """The reply CELGC expects: ArrayRecord ``arrays`` (the model's whole state dict, buffers
    included) and MetricRecord ``metrics`` (``local_update``'s metrics plus ``extra``)."""
    content = RecordDict({"arrays": ArrayRecord(_state(model_or_state)), "metrics": _metrics(metrics, extra)})
    return Message(content=content, reply_to=msg)


def gradient_reply(msg: Message, grads: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor],
                   metrics: Mapping[str, float | int], extra: Mapping[str, float | int] | None = None) -> Message:
    """The reply NaiveParallelClip expects for ``mode = "gradient"``: ArrayRecords ``grads``
    (each trainable parameter's gradient) and ``buffers`` (the rest of the state dict)."""
    content = RecordDict({"grads": ArrayRecord(_state(grads)), "buffers": ArrayRecord(_state(buffers)),
                          "metrics": _metrics(metrics, extra)})
    return Message(content=content, reply_to=msg)
