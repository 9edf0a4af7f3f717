"""Sample-set distances for low-dimensional data (toy2d)."""

from __future__ import annotations

import torch
from torch import Tensor


def sliced_wasserstein(x: Tensor, y: Tensor, n_proj: int = 256, generator: torch.Generator | None = None) -> float:
    """Sliced 2-Wasserstein distance sqrt(E_theta W2^2(theta.x, theta.y)) over random unit directions theta.

    Each 1-D W2 between equal-size empirical sets is the RMS difference of the sorted projections
    (Rabin et al. 2011; Bonneel et al. 2015). Sets of different sizes are compared at matched quantiles.
    """
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"expected two (N, D) sets of equal D, got {tuple(x.shape)} and {tuple(y.shape)}")
    x, y = x.double(), y.double()
    theta = torch.randn(x.shape[1], n_proj, generator=generator, dtype=torch.float64)
    theta = theta / theta.norm(dim=0, keepdim=True)
    px, _ = (x @ theta).sort(dim=0)
    py, _ = (y @ theta).sort(dim=0)
    if px.shape[0] != py.shape[0]:
        q = torch.linspace(0, 1, max(px.shape[0], py.shape[0]), dtype=torch.float64)
        px, py = torch.quantile(px, q, dim=0), torch.quantile(py, q, dim=0)
    return float((px - py).pow(2).mean().sqrt())
