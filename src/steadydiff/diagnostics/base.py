"""Shared types of the diagnostics package: the `RunContext` an instrument sees, and the `Monitor` base the
trainer calls around each optimiser step.

They live apart from `monitors.py` so that monitors in their own modules (`validation.py`) can subclass
`Monitor` while `monitors.build_monitors` imports them, without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class RunContext:
    """What a monitor or a fixed-set builder may read of a run: never the Trainer itself, so instruments can
    be driven from a loaded run (`experiments/calibrate.py`) exactly as from a training loop.

    `model` is the trained module (for EDM the preconditioner holding the backbone); `ema_model` its EMA copy
    (None where there is none); `formulation` the diffusion formulation; `dataset` the training dataset."""

    cfg: Any  # steadydiff.config.Config
    dataset: Any  # steadydiff.data.ArrayDataset (or a store)
    formulation: Any
    model: nn.Module | None = None
    ema_model: nn.Module | None = None
    device: torch.device = torch.device("cpu")


class Monitor:
    """Base: `every` = 0 disables; the trainer calls the hooks only on due steps (`due(step)`), with the
    1-based number of the step being taken."""

    def __init__(self, every: int):
        self.every = every

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def after_backward(self, ctx: RunContext, step: int) -> dict[str, float]:
        """After backward, before gradient clipping."""
        return {}

    def before_step(self, ctx: RunContext, step: int) -> None:  # noqa: B027 - optional hook
        """After clipping, right before the optimiser step."""

    def after_step(self, ctx: RunContext, step: int) -> dict[str, float]:
        return {}
