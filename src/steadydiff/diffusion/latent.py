"""Latent diffusion's last step: decoding what a model trained on a latent store (`data/latent.py`) samples
back to pixels with the VAE that encoded the store (`nn/vae.py`). A model trained on an image store needs no
decoder (`latent_decoder` returns None), so every caller treats both alike:

    decode = latent_decoder(cfg.data)            # None for image data
    images = decode(x) if decode else x
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..data.latent import denormalise
from ..data.store import read_index
from ..nn.vae import VAECodec, VAEError, load_vae


def latent_record(data_cfg) -> dict[str, Any] | None:
    """The "latent" record of the store `data_cfg` reads, or None for any other data."""
    if data_cfg.name != "store" or not data_cfg.root:
        return None
    return read_index(data_cfg.root).get("latent")


def image_store(data_cfg):
    """The DataConfig of the image store a latent store was encoded from (what metrics compare decoded samples
    with); `data_cfg` itself for image data."""
    import dataclasses

    rec = latent_record(data_cfg)
    return data_cfg if rec is None else dataclasses.replace(data_cfg, root=rec["image_store"]["root"], max_items=None)


class LatentDecoder:
    """model latents -> images in [-1, 1]: denormalise with the store's statistics, then the VAE's decoder."""

    def __init__(self, record: dict[str, Any], codec: VAECodec):
        want = record["vae"]
        if codec.latent_channels != want["latent_channels"]:
            raise VAEError(f"the VAE {codec.source} has {codec.latent_channels} latent channels, the store's latents "
                           f"have {want['latent_channels']}; decode with the VAE that encoded it ({want['source']})")
        if codec.identity["weights_sha256"] != want["weights_sha256"]:
            raise VAEError(f"the VAE {codec.source} is not the one that encoded the store (weights "
                           f"{codec.identity['weights_sha256']}, the store's {want['weights_sha256']}); pass "
                           f"--vae with that VAE ({want['source']})")
        self.record, self.codec = record, codec
        self.image_shape = tuple(record["image_store"]["shape"])

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(denormalise(x.float(), self.record))


def latent_decoder(data_cfg, vae: str | Path | None = None, device: torch.device | str = "cpu") -> LatentDecoder | None:
    """The decoder for models trained on `data_cfg` (None for image data). `vae` overrides where the VAE is
    loaded from (the store records its source; a moved folder or a local copy of a hub VAE), and must be the
    same VAE."""
    record = latent_record(data_cfg)
    if record is None:
        if vae is not None:
            raise VAEError("--vae applies to models trained on a latent store; this run trains on images")
        return None
    if not isinstance(record.get("vae"), dict) or "image_store" not in record:
        raise VAEError(f"the latent store {data_cfg.root} has no VAE record; re-encode it with "
                       "`steadydiff dataset encode`")
    return LatentDecoder(record, load_vae(vae or record["vae"]["source"], device))
