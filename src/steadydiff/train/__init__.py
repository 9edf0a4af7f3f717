"""Training: the loop, LR schedules, EMA, checkpoints."""

from .checkpoint import CheckpointError, find_weights, latest_checkpoint, read_checkpoint, save_checkpoint
from .ema import EMA
from .loop import NonFiniteLossError, RunDirError, Trainer, generate, plot_curves
from .schedules import WarmupConstant

__all__ = [
    "EMA", "CheckpointError", "NonFiniteLossError", "RunDirError", "Trainer", "WarmupConstant", "find_weights",
    "generate", "latest_checkpoint", "plot_curves", "read_checkpoint", "save_checkpoint",
]
