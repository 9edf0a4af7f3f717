"""The image autoencoder of latent diffusion: a diffusers `AutoencoderKL` (Rombach et al. 2022; the Stable
Diffusion VAE that EDM2's ImageNet-512 models and U-ViT's latent models use), behind two calls:

    codec = load_vae("path/to/vae")          # a local folder (save_pretrained), or a hub id when online
    mean, std = codec.encode(images)         # images in [-1, 1], (B, C, H, W) -> posterior N(mean, std^2)
    images = codec.decode(z)                 # raw latents (B, c, h, w) -> images in [-1, 1]

The latents are the VAE's own (no `scaling_factor`): steadydiff normalises them per channel with statistics of
the dataset, recorded in the latent store (`data/latent.py`). `codec.identity` names the VAE (where it was
loaded from, and a hash of its config and weights), so that a store is decoded by the VAE that encoded it.

Needs the optional extra `pip install "steadydiff[hf]"` (diffusers).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..utils.errors import SteadydiffError


class VAEError(SteadydiffError):
    """The VAE cannot be loaded or does not match the latents; the message names the fix."""


def _weights_digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()[:16]


class VAECodec:
    """An `AutoencoderKL` in eval mode, no gradients, float32 unless `dtype` says otherwise."""

    def __init__(self, vae: torch.nn.Module, source: str, device: torch.device | str = "cpu"):
        self.vae = vae.to(device).eval().requires_grad_(False)
        self.source = source
        self.device = torch.device(device)
        cfg = dict(vae.config)
        self.latent_channels = int(cfg["latent_channels"])
        self.image_channels = int(cfg["in_channels"])
        self.downsample = 2 ** (len(cfg["block_out_channels"]) - 1)
        config_text = json.dumps({k: v for k, v in cfg.items() if not k.startswith("_")}, sort_keys=True, default=str)
        self.identity: dict[str, Any] = {
            "source": source, "class": type(vae).__name__,
            "config_sha256": hashlib.sha256(config_text.encode()).hexdigest()[:16],
            "weights_sha256": _weights_digest(vae), "latent_channels": self.latent_channels,
            "image_channels": self.image_channels, "downsample": self.downsample,
        }

    @torch.no_grad()
    def encode(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """Posterior mean and std (each (B, c, H / f, W / f), float32, on the CPU) of images in [-1, 1]."""
        if images.shape[1] != self.image_channels:
            raise VAEError(f"the VAE {self.source} encodes {self.image_channels}-channel images, the store holds "
                           f"{images.shape[1]}-channel ones; pick a VAE for this data")
        dist = self.vae.encode(images.to(self.device, torch.float32)).latent_dist
        return dist.mean.float().cpu(), dist.std.float().cpu()

    @torch.no_grad()
    def decode(self, z: Tensor) -> Tensor:
        """Images in [-1, 1] (float32, on z's device) from raw latents."""
        if z.shape[1] != self.latent_channels:
            raise VAEError(f"the VAE {self.source} decodes {self.latent_channels}-channel latents, not {z.shape[1]}; "
                           "decode with the VAE that encoded the store")
        return self.vae.decode(z.to(self.device, torch.float32)).sample.clamp(-1, 1).to(z.device)


def load_vae(source: str | Path, device: torch.device | str = "cpu") -> VAECodec:
    """The `AutoencoderKL` saved at the local folder `source` (`save_pretrained`), or the hub id `source`."""
    try:
        from diffusers import AutoencoderKL
    except ImportError as e:
        raise VAEError("latent diffusion needs diffusers: pip install 'steadydiff[hf]'") from e
    source = str(source)
    local = Path(source)
    if local.exists() and not (local / "config.json").is_file():
        raise VAEError(f"{source} is not a saved AutoencoderKL (no config.json); pass the folder written by "
                       "`AutoencoderKL.save_pretrained`, or a hub id such as stabilityai/sd-vae-ft-mse")
    try:
        vae = AutoencoderKL.from_pretrained(source, low_cpu_mem_usage=False)  # no `accelerate` warning
    except Exception as e:  # offline hub id, damaged weights, a folder of another model class
        hint = ("the folder's files are damaged or not an AutoencoderKL" if local.exists() else
                "no such local folder, and the hub could not be reached (offline?); download the VAE with "
                "`AutoencoderKL.from_pretrained(ID).save_pretrained(FOLDER)` where you are online and pass FOLDER")
        raise VAEError(f"cannot load the VAE {source}: {hint} ({type(e).__name__})") from e
    return VAECodec(vae, source, device)
