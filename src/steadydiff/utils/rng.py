"""Random draws that are pure functions of their seeds, on any device.

Every random draw of training step k comes from generators seeded by (seed, k), and every chunk of samples
from a generator seeded by (seed, chunk): so a step or a chunk does not depend on what was drawn before it,
which is what makes resume exact and the output independent of the number of processes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def step_generator(seed: int, step: int, stream: int, device: torch.device | str = "cpu") -> torch.Generator:
    """An independent generator for (seed, step, stream): draws never depend on what came before."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step) * 16 + stream)
    return g


def chunk_seed(seed: int, k: int) -> int:
    """Seed of sample chunk k: `seed` itself for the first chunk (so a set of up to one chunk is what a plain
    `torch.Generator().manual_seed(seed)` draws), an independent stream derived from (seed, k) for the rest."""
    if k == 0:
        return seed
    return int(np.random.SeedSequence([seed % 2**64, k]).generate_state(1, dtype=np.uint64)[0] >> 1)


def _draw(fn, shape, generator: torch.Generator | None, device, dtype: torch.dtype) -> Tensor:
    # Drawn on the generator's device (a CPU generator cannot feed a CUDA draw), then moved to `device`.
    where = generator.device if generator is not None else torch.device(device if device is not None else "cpu")
    out = fn(tuple(shape), generator=generator, device=where, dtype=dtype)
    return out.to(device) if device is not None else out


def draw_normal(shape: tuple[int, ...] | torch.Size, generator: torch.Generator | None,
                device: torch.device | str | None, dtype: torch.dtype = torch.float32) -> Tensor:
    """N(0, I) from `generator`, on `device`."""
    return _draw(torch.randn, shape, generator, device, dtype)


def draw_uniform(shape: tuple[int, ...] | torch.Size, generator: torch.Generator | None,
                 device: torch.device | str | None, dtype: torch.dtype = torch.float32) -> Tensor:
    """U[0, 1) from `generator`, on `device`."""
    return _draw(torch.rand, shape, generator, device, dtype)
