"""The client API's public import path: ``from strategies.clientapp import local_update, round_settings, train_reply``.

The module itself is the Flower adapter ``strategies.flower_api.client_api`` (settings in, I
clipped steps, a reply out); this path names the same objects and stays stable.
"""

from .flower_api.client_api import (
    ConfigError,
    RoundSettings,
    RoundStats,
    StepConfig,
    count_examples,
    gradient_reply,
    local_update,
    round_settings,
    train_reply,
)

__all__ = ["ConfigError", "RoundSettings", "RoundStats", "StepConfig", "count_examples", "gradient_reply",
           "local_update", "round_settings", "train_reply"]
