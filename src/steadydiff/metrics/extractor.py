"""The feature-extractor interface and the image conversions every extractor shares.

    ext = get_extractor("inception")              # or "fmnist", "mnist" (metrics/features.py)
    f = ext.features(images, batch_size=64)      # images (N, C, H, W) in [-1, 1] -> (N, ext.dim) float32, CPU

Every extractor takes images in [-1, 1] of any size and 1, 2 (gray + alpha), 3 (RGB) or 4 (RGBA) channels,
and resizes / converts them itself. `ext.id` is the name plus a hash of the weights and input convention:
use it to key anything cached from the features (see `steadydiff.metrics.reference`). The extractors:
`inception.py` (the FID network), `classifier.py` (small classifiers trained by steadydiff).
"""

from __future__ import annotations

import abc
import hashlib
import os
from pathlib import Path

import torch
from torch import Tensor

from ..utils.errors import SteadydiffError

__all__ = ["ExtractorError", "FeatureExtractor", "check_images", "extractor_cache_dir", "tensor_digest", "to_gray",
           "to_rgb"]


class ExtractorError(SteadydiffError):
    """A feature extractor cannot be built or used; str(e) names the fix."""


def extractor_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/steadydiff/extractors`, default `~/.cache/steadydiff/extractors`."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "steadydiff" / "extractors"


def tensor_digest(*tensors: Tensor) -> str:
    """SHA-256 (hex) of the tensors' dtypes, shapes and bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def check_images(images: Tensor) -> Tensor:
    if not isinstance(images, Tensor) or images.ndim != 4:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ExtractorError(f"expected images as a (B, C, H, W) tensor in [-1, 1], got {shape}")
    if not images.is_floating_point():
        raise ExtractorError(f"expected float images in [-1, 1], got {images.dtype}; convert with x / 127.5 - 1")
    if images.shape[1] not in (1, 2, 3, 4):
        raise ExtractorError(
            f"images have {images.shape[1]} channels; expected 1 (gray), 2 (gray + alpha), 3 (RGB) or 4 (RGBA)"
        )
    return images


def to_rgb(x: Tensor) -> Tensor:
    """(B, C, H, W) with C in 1..4 -> RGB: gray is repeated, alpha dropped."""
    c = x.shape[1]
    if c in (1, 2):
        return x[:, :1].expand(-1, 3, -1, -1)
    return x[:, :3]


_LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601, as PIL's convert("L")


def to_gray(x: Tensor) -> Tensor:
    """(B, C, H, W) with C in 1..4 -> (B, 1, H, W): luma of RGB(A), alpha dropped."""
    if x.shape[1] in (1, 2):
        return x[:, :1]
    w = torch.tensor(_LUMA, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x[:, :3] * w).sum(dim=1, keepdim=True)


class FeatureExtractor(abc.ABC):
    """Maps images (B, C, H, W) in [-1, 1] to features (B, dim) float32.

    `name` is the registry name, `dim` the feature width, `id` the name plus a hash of the weights and input
    convention (two extractors with equal ids give equal features), `device` where the network runs.
    """

    name: str
    dim: int
    id: str
    device: torch.device

    @abc.abstractmethod
    def _forward(self, images: Tensor) -> Tensor:
        """Features of a validated float32 batch already on `self.device`."""

    def __call__(self, images: Tensor) -> Tensor:
        """Features (B, dim) float32 on `self.device`; differentiable where the network is."""
        x = check_images(images).to(self.device, torch.float32)
        out = self._forward(x)
        return out.float().reshape(x.shape[0], self.dim)

    def features(self, images: Tensor, batch_size: int = 64) -> Tensor:
        """Features of all `images` (N, C, H, W), `batch_size` at a time, under no_grad; (N, dim) on the CPU."""
        check_images(images)
        if batch_size < 1:
            raise ExtractorError(f"batch_size must be >= 1, got {batch_size}")
        out = torch.empty(images.shape[0], self.dim, dtype=torch.float32)
        with torch.no_grad():
            for i in range(0, images.shape[0], batch_size):
                out[i : i + batch_size] = self(images[i : i + batch_size]).cpu()
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, dim={self.dim}, device={str(self.device)!r})"
