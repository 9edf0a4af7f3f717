"""Batch assembly: the global-batch rule, each rank's slice, and step k's batch (`BatchAssembler`).

Distributed data parallel (under torchrun, see `utils/distributed.py`): `train.batch_size` is the global
batch. Every rank draws the whole global batch (indices, flips, noise levels, noise) from the same (seed, k)
generators and keeps its contiguous slice, so the trajectory is the same for any number of processes up to
the order of floating-point reductions, and a checkpoint resumes under any number of processes. Only
dropout draws per rank (seeded by (seed, k, rank), in the loop): with model.dropout > 0 runs on different
numbers of processes are equal in distribution, not bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..data import InfiniteSampler, Prefetcher, get_batch, model_labels
from ..nn import NULL_LABEL
from ..utils.errors import ConfigError
from ..utils.rng import draw_normal, draw_uniform, step_generator


def check_global_batch(batch_size: int, world_size: int, grad_accum: int) -> None:
    """ConfigError unless the global batch splits evenly into `world_size` ranks x `grad_accum` micro-batches:
    equal shards are what makes DDP's average of per-rank means the global-batch mean."""
    unit = world_size * grad_accum
    if batch_size % unit:
        raise ConfigError(
            f"train.batch_size={batch_size} is the global batch and must be divisible by the number of "
            f"processes ({world_size}) x train.grad_accum ({grad_accum}); use a multiple of {unit}"
        )


def check_num_classes(num_classes: int, dataset) -> None:
    """A class-conditional model must have the dataset's number of classes (0: unconditional)."""
    if num_classes and num_classes != dataset.num_classes:
        raise ConfigError(f"model.num_classes={num_classes} but the dataset has {dataset.num_classes} classes; "
                          f"set model.num_classes={dataset.num_classes} or 0 (unconditional)")


def rank_slice(batch_size: int, rank: int, world_size: int) -> slice:
    """The contiguous rows of the global batch that `rank` keeps."""
    return slice(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)


class Batch(NamedTuple):
    """Step k's batch on this rank: its slice of the data, labels, noise levels, noise and loss weights, and
    the whole global batch's levels (logged as the level histogram)."""

    x: torch.Tensor
    labels: torch.Tensor | None
    levels: torch.Tensor
    noise: torch.Tensor
    weights: torch.Tensor | None
    all_levels: torch.Tensor


class BatchAssembler:
    """`assembler(k)` is step k's `Batch`, a pure function of (config, k).

    The data rows come from the seeded index stream at global position k x batch (read ahead by the loader
    threads); levels, noise and label dropout from the step's generator, drawn for the whole global batch in
    the single-process order (levels, then noise, then the label-dropout coins), so the step does not depend
    on the number of processes and label_dropout = 0 draws nothing extra."""

    def __init__(self, cfg, dataset, timesteps, dist, device: torch.device):
        self.cfg, self.dataset, self.timesteps, self.device = cfg, dataset, timesteps, device
        self.keep = rank_slice(cfg.train.batch_size, dist.rank, dist.world_size)
        self.sampler = InfiniteSampler(len(dataset), seed=cfg.train.seed)
        self.loader = Prefetcher(self.read, cfg.data.workers)

    def read(self, k: int):
        """This rank's rows of step k's global batch (a pure function of (seed, k): safe to read ahead)."""
        t = self.cfg.train
        idx = self.sampler.indices(k * t.batch_size, t.batch_size)
        x, labels = get_batch(self.dataset, idx, self.cfg.data.hflip, step_generator(t.seed, k, stream=1),
                              keep=self.keep)
        if self.device.type == "cuda":
            x = x.pin_memory()  # so that the copy to the GPU can overlap the step
        return x, labels

    def __call__(self, k: int) -> Batch:
        t, sl = self.cfg.train, self.keep
        gen = step_generator(t.seed, k, stream=0, device=self.device)
        x, labels = self.loader.get(k)
        levels = self.timesteps.sample(t.batch_size, k, gen, self.device)
        weights = self.timesteps.weights(levels, k)
        noise = draw_normal((t.batch_size, *x.shape[1:]), gen, self.device, dtype=x.dtype)
        x = x.to(self.device, non_blocking=True)
        labels = model_labels(labels, self.cfg.model.num_classes)
        if labels is not None:
            labels = labels.to(self.device)
            p_drop = self.cfg.model.label_dropout
            if p_drop > 0:  # classifier-free guidance training: the null label with probability p
                drop = draw_uniform((t.batch_size,), gen, self.device)[sl] < p_drop
                labels = torch.where(drop, torch.full_like(labels, NULL_LABEL), labels)
        noise = noise[sl]
        if t.channels_last and x.dim() == 4:
            x, noise = (v.contiguous(memory_format=torch.channels_last) for v in (x, noise))
        return Batch(x, labels, levels[sl], noise, None if weights is None else weights[sl], levels)

    def close(self) -> None:
        self.loader.close()
