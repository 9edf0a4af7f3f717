"""Training: the loop, LR schedules, EMA, checkpoints."""

from .checkpoint import CheckpointError, find_weights, latest_checkpoint, read_checkpoint, save_checkpoint
from .ema import EMA
from .loop import NonFiniteLossError, RunDirError, Trainer, generate, load_run_model, plot_curves
from .schedules import InverseSqrt, WarmupConstant, WarmupCosine, build_lr_schedule

__all__ = [
    "EMA", "CheckpointError", "InverseSqrt", "NonFiniteLossError", "RunDirError", "Trainer", "WarmupConstant",
    "WarmupCosine", "build_lr_schedule", "find_weights", "generate", "latest_checkpoint", "load_run_model",
    "plot_curves", "read_checkpoint", "save_checkpoint",
]
