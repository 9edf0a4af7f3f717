"""Choosing the device a command runs on."""

from __future__ import annotations

import torch

from .errors import ConfigError


def pick_device(name: str) -> torch.device:
    """`auto` is CUDA when one is visible, else the CPU; asking for CUDA without one is a ConfigError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use train.device=auto or cpu")
    return torch.device(name)
