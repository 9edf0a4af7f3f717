"""Plain helpers that several test files share (fixtures live in conftest.py; these are also needed at import
time, e.g. in parametrize lists, so they are a module to import: `from helpers import ...`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from PIL import Image

# ---------------------------------------------------------------------------------------------------------
# The toy run: a tiny MLP U-Net on 2-D toy data, the configuration every trainer test starts from

TOY = ["data.name=toy2d", "data.toy_size=500", "model.backbone=mlp_unet", "model.hidden=32", "model.depth=4",
       "train.batch_size=32", "train.lr=2e-3", "train.warmup_steps=2", "train.log_every=1", "train.sample_n=32",
       "train.sample_steps=2", "train.threads=1"]


def toy(*overrides: str) -> list[str]:
    """The toy run's `key=value` overrides followed by `overrides` (the later value of a key wins, so a test
    names only what it changes)."""
    return [*TOY, *overrides]


def toy_cfg(*overrides: str):
    """The toy run's Config, with `overrides`."""
    from steadydiff.config import load_config

    return load_config(None, toy(*overrides))


def toy_sets(*overrides: str) -> list[str]:
    """The toy run's overrides as command-line `--set KEY=VALUE` pairs."""
    return [a for o in toy(*overrides) for a in ("--set", o)]


# The session-scoped run that `toy_run` copies (tests/conftest.py): the toy run, 2 steps, one checkpoint.
TOY_RUN = toy("train.steps=2")


def logged_losses(run: Path) -> tuple[list[int], list[float | None]]:
    """Steps and losses of a run's training log lines (monitor lines carry grad/... keys, no loss)."""
    rows = [r for r in metrics_rows(run) if "loss" in r]
    return [r["step"] for r in rows], [r["loss"] for r in rows]


def assert_resume_exact(root: Path, overrides: Sequence[str], steps: int, *, split: int | None = None,
                        split_overrides: Sequence[str] = (), config: str | None = None,
                        losses: float | None = None, weights: float | None = None, ema: bool = True,
                        before_resume: Callable | None = None) -> SimpleNamespace:
    """The full / split / resume check. Trains `overrides` (on `config`, a YAML file) to `steps` in one go
    (root/full) and, in root/split, to `split` (default steps // 2) then resumed to `steps` (`split_overrides`
    added to both halves; `before_resume(trainer)` sees the resumed trainer before it trains). Then:

    - losses: both runs log the same steps, with losses within `losses` (absolute, strictly below; 0: equal);
    - weights: both end at `steps` on the same model weights within `weights` (absolute; 0: bit for bit), and
      with `ema` the same EMA weights too.

    None skips that check (the test checks what it needs itself). Returns the run directories and the full and
    resumed trainers."""
    from steadydiff.config import load_config
    from steadydiff.runs import latest_checkpoint, read_checkpoint
    from steadydiff.train import Trainer

    split = steps // 2 if split is None else split

    def cfg(n: int, extra: Sequence[str] = ()):
        return load_config(config, [*overrides, *extra, f"train.steps={n}"])

    full_dir, split_dir = root / "full", root / "split"
    full = Trainer(cfg(steps), full_dir, show_progress=False)
    full.fit()
    Trainer(cfg(split, split_overrides), split_dir, show_progress=False).fit()
    resumed = Trainer(cfg(steps, split_overrides), split_dir, show_progress=False)
    assert resumed.step == split
    if before_resume is not None:
        before_resume(resumed)
    resumed.fit()
    if losses is not None:
        (s_full, l_full), (s_split, l_split) = logged_losses(full_dir), logged_losses(split_dir)
        assert s_full == s_split, (s_full, s_split)
        if losses == 0:
            assert l_full == l_split, (l_full, l_split)
        else:
            assert max(abs(a - b) for a, b in zip(l_full, l_split)) < losses, (l_full, l_split)
    if weights is not None:
        import torch

        a = read_checkpoint(latest_checkpoint(full_dir / "checkpoints"))
        b = read_checkpoint(latest_checkpoint(split_dir / "checkpoints"))
        assert a.step == b.step == steps and a.model.keys() == b.model.keys()
        for k in a.model:
            torch.testing.assert_close(a.model[k], b.model[k], rtol=0, atol=weights, msg=k)
            if ema:
                torch.testing.assert_close(a.ema[k], b.ema[k], rtol=0, atol=weights, msg=k)
    return SimpleNamespace(full=full_dir, split=split_dir, full_trainer=full, resumed=resumed)


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

    # The 10,000 test images in one shard (as 625 shards of 16 this took 2.4 s; only the first 40 are kept).
    build_store("fashion_mnist:test", r / "img", labels=True, shard_size=10_000, workers=0, progress=False)
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
