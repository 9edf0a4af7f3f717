"""Learning-rate schedules: objects mapping the optimiser step to a multiplier of the base LR."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WarmupConstant:
    """Linear warm-up from ~0 to 1 over `warmup_steps` optimiser steps, then constant (U-ViT/ScaleLong)."""

    warmup_steps: int = 0

    def __call__(self, step: int) -> float:
        if self.warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / self.warmup_steps)
