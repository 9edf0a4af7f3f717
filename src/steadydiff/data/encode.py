"""`steadydiff dataset encode STORE --vae VAE --out LATENTS`: an image store into a latent store (the format and
the normalisation: `data/latent.py`). Written through `build_store`, so an interrupted encode continues from
its last finished shard when re-run, and a store that looks complete is complete."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .base import DataError
from .build import build_store
from .latent import SCALE
from .sources import Source
from .store import open_store


def channel_stats(store_dir: Path, shards: list[dict[str, Any]], channels: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of z ~ N(mean, std^2) over every row of the shards, in float64, one shard in
    memory at a time."""
    total = np.zeros(channels)
    second = np.zeros(channels)
    n = 0
    for entry in shards:
        rows = np.load(store_dir / entry["file"], mmap_mode="r")
        mean, std = rows[:, :channels].astype(np.float64), rows[:, channels:].astype(np.float64)
        total += mean.sum(axis=(0, 2, 3))
        second += (mean * mean + std * std).sum(axis=(0, 2, 3))
        n += mean.shape[0] * mean.shape[2] * mean.shape[3]
    mu = total / n
    return mu.tolist(), np.sqrt(np.maximum(second / n - mu * mu, 0.0)).tolist()


def encode_store(store: str | Path, out: str | Path, encode: Callable[[torch.Tensor], tuple[torch.Tensor, ...]],
                 vae_identity: dict[str, Any], batch: int = 32, shard_size: int = 10_000,
                 progress: bool = True) -> dict[str, Any]:
    """Encode the image store `store` into the latent store `out` with `encode(images in [-1, 1]) -> (mean,
    std)`; resumable like `steadydiff dataset build` (re-run the same command after an interruption)."""
    if batch < 1:
        raise DataError(f"--batch must be >= 1, got {batch}")
    src = open_store(store)
    if src.latent is not None:
        raise DataError(f"{store} is already a latent store; encode the image store it came from "
                        f"({src.latent['image_store']['root']})")
    mean0, _ = encode(src.items(torch.arange(1)))
    c, h, w = (int(v) for v in mean0.shape[1:])
    if vae_identity.get("latent_channels") not in (None, c):
        raise DataError(f"the VAE reports {vae_identity['latent_channels']} latent channels but encodes {c}")

    def read(items, _pool):
        rows = []
        for i in range(0, len(items), batch):
            mean, std = encode(src.items(torch.as_tensor(items[i:i + batch])))
            rows.append(torch.cat([mean, std], dim=1).float().numpy())
        return np.concatenate(rows), list(range(len(items))), []

    def finalize(stage: Path, shards: list[dict[str, Any]]) -> dict[str, Any]:
        m, s = channel_stats(stage, shards, c)
        return {"latent": {"vae": vae_identity, "channel_mean": m, "channel_std": s, "scale": SCALE,
                           "image_store": {"root": str(Path(store).resolve()), "digest": src.digest(),
                                           "shape": list(src.sample_shape)}}}

    labels = None if src.labels is None else src.labels.numpy()
    # The batch is part of the plan: convolution numerics depend on it, so a resumed encode must use the same.
    source = Source(f"{Path(store).resolve()} encoded by {vae_identity['source']} (batch {batch})", len(src), c, h,
                    labels,
                    src.class_names or (None if labels is None else [str(i) for i in range(src.num_classes)]),
                    src.meta.get("resize", ""), read, dtype="float32", row_shape=(2 * c, h, w),
                    finalize=finalize)
    if h != w:
        raise DataError(f"latents of {h}x{w}: stores hold square samples; encode square images")
    return build_store(source, out, shard_size=shard_size, workers=0, progress=progress)
