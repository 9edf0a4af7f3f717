"""Batch assembly under data parallelism: the global-batch rule and each rank's slice.

`train.batch_size` is the global batch. Every rank draws the whole global batch from the step's generators and
keeps its contiguous slice, so a step does not depend on the number of processes (see `train/loop.py`).
"""

from __future__ import annotations

from ..utils.errors import ConfigError


def check_global_batch(batch_size: int, world_size: int, grad_accum: int) -> None:
    """ConfigError unless the global batch splits evenly into `world_size` ranks x `grad_accum` micro-batches:
    equal shards are what makes DDP's average of per-rank means the global-batch mean."""
    unit = world_size * grad_accum
    if batch_size % unit:
        raise ConfigError(
            f"train.batch_size={batch_size} is the global batch and must be divisible by the number of "
            f"processes ({world_size}) x train.grad_accum ({grad_accum}); use a multiple of {unit}"
        )


def rank_slice(batch_size: int, rank: int, world_size: int) -> slice:
    """The contiguous rows of the global batch that `rank` keeps."""
    return slice(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)
