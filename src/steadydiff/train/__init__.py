"""Training: the Trainer and its loop, and the objects it calls (LR and momentum schedules, noise-level
samplers, weight averagers, the non-finite policy, the optimiser)."""

# The periodic eval's metrics (loop.py imports them when it first evaluates): imported with the trainer, so that a
# config loaded after `import steadydiff.train` has train.eval_metrics checked on load, not at the first eval.
from ..metrics.evaluate import METRICS  # noqa: F401
from .ema import EMA
from .loop import StepResult, Trainer
from .nonfinite import NonFiniteLossError
from .phema import PowerEMA
from .preemption import EXIT_PREEMPTED, TrainingInterrupted
from .schedules import InverseSqrt, WarmupConstant, WarmupCosine, build_lr_schedule

__all__ = [
    "EMA", "EXIT_PREEMPTED", "InverseSqrt", "NonFiniteLossError", "PowerEMA", "StepResult", "Trainer",
    "TrainingInterrupted", "WarmupConstant", "WarmupCosine", "build_lr_schedule",
]
