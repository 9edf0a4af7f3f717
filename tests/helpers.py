"""Plain helpers that several test files share (fixtures live in conftest.py; these are also needed at import
time, e.g. in parametrize lists, so they are a module to import: `from helpers import ...`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

# ---------------------------------------------------------------------------------------------------------
# Data


def rgb_tree(root: Path, n_per_class: int = 5, size: tuple[int, int] = (12, 10)) -> None:
    """An image folder of two classes (ants, bees) of random RGB PNGs."""
    g = np.random.default_rng(0)
    for c in ("ants", "bees"):
        (root / c).mkdir(parents=True)
        for i in range(n_per_class):
            arr = g.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / c / f"{i:02d}.png")


# A tiny U-ViT on 8x8 images from a folder or a store (test_store.py, and its 2-process run).
UVIT = ["model.backbone=uvit", "model.patch_size=2", "model.embed_dim=16", "model.depth=2", "model.num_heads=2",
        "train.steps=6", "train.batch_size=8", "train.log_every=1", "train.ckpt_every=3", "train.sample_every=0",
        "train.threads=1", "train.warmup_steps=1", "data.resolution=8", "data.hflip=true"]

# A tiny conv U-Net (with configs/demo.yaml) on a 4-channel latent store (test_latent.py, and its 2-process run).
LATENT_UNET = ["model.channels=8", "model.num_heads=1", "model.channel_mult=[1,2]", "model.num_res_blocks=1",
               "model.attn_resolutions=[]", "train.batch_size=8", "train.sample_n=4", "train.sample_steps=2",
               "train.threads=1", "train.ckpt_every=2", "diagnostics.grad_every=0", "data.hflip=false"]


def tiny_vae(path: Path, latent_channels: int = 4, seed: int = 0) -> Path:
    """A randomly initialised 1-channel AutoencoderKL (28x28 -> 14x14 latents) saved to a local folder."""
    import diffusers
    import torch

    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKL(in_channels=1, out_channels=1, block_out_channels=(8, 16),
                                  latent_channels=latent_channels, down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4, sample_size=28)
    vae.save_pretrained(path)
    return path


def latent_stores(r: Path) -> Path:
    """Under r: a 40-image Fashion-MNIST store with labels (small), a VAE folder (vae), and the latent store it
    encodes to (lat)."""
    import torch

    from steadydiff.cli import main
    from steadydiff.data import build_store, open_store

    build_store("fashion_mnist:test", r / "img", labels=True, shard_size=16, workers=0, progress=False)
    # keep 40 images: rebuild from the first 40 as an .npz (a store of exactly that many rows)
    src = open_store(r / "img")
    imgs = ((src.items_range(0, 40) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()[:, 0]
    np.savez(r / "small.npz", images=imgs, labels=src.labels[:40].numpy())
    build_store(str(r / "small.npz"), r / "small", labels=True, shard_size=16, workers=0, progress=False)
    tiny_vae(r / "vae")
    assert main(["dataset", "encode", str(r / "small"), "--vae", str(r / "vae"), "--out", str(r / "lat"),
                 "--batch", "7", "--shard-size", "16", "--device", "cpu", "--quiet"]) == 0
    return r


# ---------------------------------------------------------------------------------------------------------
# Runs


def metrics_rows(run: Path) -> list[dict]:
    """Every record of a run's metrics.jsonl."""
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
