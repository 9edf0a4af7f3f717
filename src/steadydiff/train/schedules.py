"""Learning-rate schedules: objects mapping the optimiser step k (0-based) to a multiplier of train.lr.

All share the same linear warm-up min(1, (k + 1) / warmup_steps), so the first step already moves.

Every schedule (here, momentum.py, timesteps.py) states its own horizon for experiment reports: `horizon`,
the step where it ends (None: it never ends), `horizon_key`, the config key that sets it (None: train.steps
itself), and `horizon_name`. A horizon that follows train.steps makes a shorter run of the same config run a
compressed schedule, so "steps to reach X" read off a longer run is not what the shorter one needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..utils.registry import Registry


def _warmup(step: int, warmup_steps: int) -> float:
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)


@dataclass
class WarmupConstant:
    """Linear warm-up, then constant (U-ViT/ScaleLong: 2,500 warm-up steps)."""

    warmup_steps: int = 0
    horizon = None  # constant after the warm-up: nothing ends

    def __call__(self, step: int) -> float:
        return _warmup(step, self.warmup_steps)


@dataclass
class WarmupCosine:
    """Linear warm-up, then a half cosine from 1 to 0 at `total_steps`."""

    warmup_steps: int
    total_steps: int
    horizon_key = None  # the decay always ends at train.steps
    horizon_name = "cosine LR decay length (train.steps)"

    @property
    def horizon(self) -> int:
        return self.total_steps

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
    horizon = None  # decays for ever (t_ref is where the decay starts, not where it ends)

    def __call__(self, step: int) -> float:
        return _warmup(step, self.warmup_steps) / math.sqrt(max(step / self.ref_steps, 1.0))


@dataclass
class ExponentialRamp:
    """Smith's LR range test (Smith 2017, arXiv 1506.01186, Sec. 3.3): the LR rises exponentially from train.lr
    at step 0 to `end_ratio` x train.lr at the last step, lr_k = lr_0 * end_ratio ** (k / (total_steps - 1)), so
    every decade of LR gets the same number of steps. `steadydiff lr-range` with `mode: ramp` runs it (no warm-up:
    the ramp starts small)."""

    warmup_steps: int
    total_steps: int
    end_ratio: float
    horizon_key = None  # the ramp ends at train.steps
    horizon_name = "LR ramp length (train.steps)"

    @property
    def horizon(self) -> int:
        return self.total_steps

    def __call__(self, step: int) -> float:
        frac = min(1.0, step / max(1, self.total_steps - 1))
        return _warmup(step, self.warmup_steps) * self.end_ratio ** frac


# train.lr_schedule -> the schedule, built from a TrainConfig.
LR_SCHEDULES = Registry("LR schedule", key="train.lr_schedule")
LR_SCHEDULES.add("constant", lambda t: WarmupConstant(t.warmup_steps))
LR_SCHEDULES.add("cosine", lambda t: WarmupCosine(t.warmup_steps, t.steps))
LR_SCHEDULES.add("inv_sqrt", lambda t: InverseSqrt(t.warmup_steps, t.lr_ref_steps))
LR_SCHEDULES.add("exp_ramp", lambda t: ExponentialRamp(t.warmup_steps, t.steps, t.lr_ramp_end / t.lr))


def build_lr_schedule(cfg) -> WarmupConstant | WarmupCosine | InverseSqrt | ExponentialRamp:
    """From a TrainConfig: the schedule `lr_schedule` names (LR_SCHEDULES)."""
    return LR_SCHEDULES.choose(cfg.lr_schedule)(cfg)
