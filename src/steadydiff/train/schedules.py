"""Learning-rate schedules: objects mapping the optimiser step k (0-based) to a multiplier of train.lr.

All share the same linear warm-up min(1, (k + 1) / warmup_steps), so the first step already moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _warmup(step: int, warmup_steps: int) -> float:
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)


@dataclass
class WarmupConstant:
    """Linear warm-up, then constant (U-ViT/ScaleLong: 2,500 warm-up steps)."""

    warmup_steps: int = 0

    def __call__(self, step: int) -> float:
        return _warmup(step, self.warmup_steps)


@dataclass
class WarmupCosine:
    """Linear warm-up, then a half cosine from 1 to 0 at `total_steps`."""

    warmup_steps: int
    total_steps: int

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class InverseSqrt:
    """EDM2 (Sec. 2.3 / App. B): alpha(k) = alpha_ref / sqrt(max(k / t_ref, 1)), with a linear ramp-up.

    EDM2 counts images; at a fixed batch, t_ref in steps = t_ref_images / batch.
    """

    warmup_steps: int
    ref_steps: int

    def __call__(self, step: int) -> float:
        return _warmup(step, self.warmup_steps) / math.sqrt(max(step / self.ref_steps, 1.0))


# train.lr_schedule -> the schedule, built from a TrainConfig.
LR_SCHEDULES = {
    "constant": lambda t: WarmupConstant(t.warmup_steps),
    "cosine": lambda t: WarmupCosine(t.warmup_steps, t.steps),
    "inv_sqrt": lambda t: InverseSqrt(t.warmup_steps, t.lr_ref_steps),
}


def build_lr_schedule(cfg) -> WarmupConstant | WarmupCosine | InverseSqrt:
    """From a TrainConfig: `lr_schedule` constant | cosine | inv_sqrt."""
    return LR_SCHEDULES[cfg.lr_schedule](cfg)
