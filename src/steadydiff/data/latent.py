"""Latent stores: an image store encoded by a VAE (`steadydiff dataset encode STORE --vae VAE --out LATENTS`).

As EDM2 does for ImageNet-512, a latent store keeps each image's posterior N(mean, std^2) rather than one
sample of it: rows are float32 (2c, h, w), the mean's c channels then the std's, so that every training step
draws a fresh latent z = mean + std * eps with eps from the step's own generator (`StoreDataset.draw`; resume
and DDP equality hold as for images). The model sees normalised latents,

    x = (z - m_c) / s_c * SCALE,

with m_c and s_c the mean and standard deviation of channel c of z over the whole dataset, computed exactly
from the posteriors (E z = E mean, Var z = E[mean^2 + std^2] - (E z)^2), and SCALE = 0.5: the data standard
deviation that EDM's sigma_data = 0.5 assumes (EDM2 scales its latents to 0.5 too). dataset.json records
them under "latent", with the VAE's identity (`nn/vae.py`) and the image store it came from, so that
sampling and evaluation decode with the same VAE and score decoded pixels against that image store.

`data/encode.py` writes latent stores; the data layer does not know VAEs (`encode_store` takes the encoder as
a function; `nn/vae.py` provides it).
"""

from __future__ import annotations

from typing import Any

import torch

SCALE = 0.5


def split_posterior(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) halves of latent-store rows (B, 2c, h, w)."""
    c = rows.shape[1] // 2
    return rows[:, :c].float(), rows[:, c:].float()


def _stats(latent: dict[str, Any], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, -1) + (1,) * (like.dim() - 2)
    m = torch.tensor(latent["channel_mean"], dtype=like.dtype, device=like.device).view(shape)
    s = torch.tensor(latent["channel_std"], dtype=like.dtype, device=like.device).view(shape)
    return m, s


def normalise(z: torch.Tensor, latent: dict[str, Any]) -> torch.Tensor:
    """Raw VAE latents -> what the model trains on: (z - m_c) / s_c * SCALE."""
    m, s = _stats(latent, z)
    return (z - m) / s * latent.get("scale", SCALE)


def denormalise(x: torch.Tensor, latent: dict[str, Any]) -> torch.Tensor:
    """The model's latents -> raw VAE latents (the inverse of `normalise`)."""
    m, s = _stats(latent, x)
    return x / latent.get("scale", SCALE) * s + m
