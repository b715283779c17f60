"""Device choice, one rule for every backend."""

from __future__ import annotations

import torch


def pick_device(name: str) -> torch.device:
    """auto: the (first visible) GPU when CUDA is present, else the CPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but CUDA is not available here; use device=\"auto\" or \"cpu\"")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
