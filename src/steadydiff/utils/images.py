"""Sample pictures as PNG: image grids with Pillow, 2-D point clouds with matplotlib (no torchvision)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .io import atomic_write


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """(B, C, H, W) in [-1, 1] -> (B, H, W, C) uint8."""
    x = ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


def image_grid(x: torch.Tensor, nrow: int | None = None, pad: int = 2) -> Image.Image:
    imgs = to_uint8(x)
    b, h, w, c = imgs.shape
    nrow = nrow or math.ceil(math.sqrt(b))
    ncol = math.ceil(b / nrow)
    grid = np.zeros((ncol * (h + pad) + pad, nrow * (w + pad) + pad, c), dtype=np.uint8)
    for k in range(b):
        r, q = divmod(k, nrow)
        grid[pad + r * (h + pad): pad + r * (h + pad) + h, pad + q * (w + pad): pad + q * (w + pad) + w] = imgs[k]
    return Image.fromarray(grid[..., 0] if c == 1 else grid)


def save_samples(x: torch.Tensor, path: str | Path, reference: torch.Tensor | None = None) -> None:
    """Images -> grid PNG; 2-D points -> scatter PNG (over `reference` points in grey if given)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if x.ndim == 4:
        grid = image_grid(x)
        atomic_write(path, lambda p: grid.save(p, format="PNG"))
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 4), dpi=100)
    if reference is not None:
        r = reference[:5000].cpu().numpy()
        ax.scatter(r[:, 0], r[:, 1], s=1, c="0.8", label="data")
    p = x.detach().float().cpu().numpy()
    ax.scatter(p[:, 0], p[:, 1], s=1, c="C0", label="samples")
    ax.set_aspect("equal")
    ax.legend(loc="upper right", markerscale=5, fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda q: fig.savefig(q, format="png"))
    plt.close(fig)
