"""Two-dimensional toy distributions for fast diffusion experiments.

Each kind is drawn from a fixed seed (0 for the train split, 1 for test) and mapped by one fixed affine map
per kind: subtract the mean and divide by one isotropic scale (so shapes are not distorted), both measured
once on a large reference draw. The map therefore does not depend on the split or on `toy_size`, and every
kind ends up with about zero mean and unit standard deviation.

- `8gaussians`: eight equal modes on a circle of radius 2 (angles k * 45 degrees), each with std 0.1.
- `swissroll`: a spiral r = t, t in [1.5 pi, 4.5 pi], with Gaussian noise of std 0.25.
- `checkerboard`: uniform on the 8 dark cells of a 4x4 board covering [-2, 2]^2.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from .base import ArrayDataset, DataError

TOY_KINDS = ("8gaussians", "swissroll", "checkerboard")
SPLIT_SEEDS = {"train": 0, "test": 1}
_REFERENCE_SEED = 12345
_REFERENCE_SIZE = 1 << 17


def _eight_gaussians(n: int, g: torch.Generator) -> torch.Tensor:
    k = torch.randint(0, 8, (n,), generator=g, dtype=torch.float64)
    angle = k * (math.pi / 4)
    centres = 2.0 * torch.stack([torch.cos(angle), torch.sin(angle)], dim=1)
    return centres + 0.1 * torch.randn(n, 2, generator=g, dtype=torch.float64)


def _swissroll(n: int, g: torch.Generator) -> torch.Tensor:
    t = 1.5 * math.pi * (1 + 2 * torch.rand(n, generator=g, dtype=torch.float64))
    points = torch.stack([t * torch.cos(t), t * torch.sin(t)], dim=1)
    return points + 0.25 * torch.randn(n, 2, generator=g, dtype=torch.float64)


def _checkerboard(n: int, g: torch.Generator) -> torch.Tensor:
    col = torch.randint(0, 4, (n,), generator=g)
    row = 2 * torch.randint(0, 2, (n,), generator=g) + col % 2  # (row + col) even: a dark cell
    cell = torch.stack([col, row], dim=1).to(torch.float64)
    return cell - 2.0 + torch.rand(n, 2, generator=g, dtype=torch.float64)


_SAMPLERS = {"8gaussians": _eight_gaussians, "swissroll": _swissroll, "checkerboard": _checkerboard}


def _raw(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return _SAMPLERS[kind](n, g)


@cache
def _normaliser(kind: str) -> tuple[torch.Tensor, float]:
    ref = _raw(kind, _REFERENCE_SIZE, _REFERENCE_SEED)
    mean = ref.mean(dim=0)
    scale = float((ref - mean).pow(2).mean().sqrt())  # RMS over both axes: isotropic unit scale
    return mean, scale


def make_toy2d(kind: str, n: int, seed: int) -> torch.Tensor:
    """`n` normalised points of `kind` drawn from `seed`, float32 (n, 2)."""
    if kind not in _SAMPLERS:
        raise DataError(f"unknown toy {kind!r}; set data.toy to one of {', '.join(TOY_KINDS)}")
    if n < 1:
        raise DataError(f"data.toy_size must be >= 1, got {n}")
    mean, scale = _normaliser(kind)
    return ((_raw(kind, n, seed) - mean) / scale).to(torch.float32)


def load_toy2d(kind: str, split: str = "train", n: int = 20000) -> ArrayDataset:
    if split not in SPLIT_SEEDS:
        raise DataError(f"unknown toy2d split {split!r}; set data.split to train or test")
    return ArrayDataset(make_toy2d(kind, n, SPLIT_SEEDS[split]), None, 0, f"toy2d/{kind}/{split}")
