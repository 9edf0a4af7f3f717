"""Training: the Trainer and its loop, and the objects it calls (LR and momentum schedules, noise-level
samplers, weight averagers, the non-finite policy, the optimiser)."""

from .ema import EMA
from .loop import StepResult, Trainer
from .nonfinite import NonFiniteLossError
from .phema import PowerEMA
from .schedules import InverseSqrt, WarmupConstant, WarmupCosine, build_lr_schedule

__all__ = [
    "EMA", "InverseSqrt", "NonFiniteLossError", "PowerEMA", "StepResult", "Trainer", "WarmupConstant",
    "WarmupCosine", "build_lr_schedule",
]
