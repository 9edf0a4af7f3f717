"""Drawing samples from a model: in seeded chunks, so that a sample set is a pure function of (seed, batch)
however many processes share the work."""

from __future__ import annotations

import math

import torch

from ..utils.rng import chunk_seed


@torch.no_grad()
def generate_chunks(model, formulation, sample_shape, n: int, sampler: str, steps: int, seed: int,
                    device: torch.device | str = "cpu", num_classes: int = 0, batch: int = 256,
                    clip: bool = True, rank: int = 0, world_size: int = 1,
                    class_label: int | None = None, decode=None) -> dict[int, torch.Tensor]:
    """{k: chunk k} for this process's share of `n` samples.

    Chunk k holds samples [k * batch, min(n, (k + 1) * batch)) and draws its prior noise and any sampler
    noise from its own generator (`chunk_seed(seed, k)`), so it is a pure function of (seed, k, batch): any
    process can draw any chunk and the union does not depend on how they were shared out. This process
    draws the chunks with k % world_size == rank. Labels: `sample_labels` (class_label for every sample, or
    0..num_classes-1 cycling over the sample index).
    `clip`: for image data (in [-1, 1]) keep the denoised estimate in that range at every step; points
    (toy2d) and latents are never clipped. `decode` (latent diffusion, `diffusion/latent.py`): each chunk's
    latents -> images.
    """
    if batch <= 0:
        raise ValueError(f"batch must be > 0, got {batch}")
    model.eval()
    out = {}
    for k in range(rank, math.ceil(n / batch), world_size):
        start = k * batch
        b = min(batch, n - start)
        g = torch.Generator(device=device).manual_seed(chunk_seed(seed, k))
        x_T = torch.randn((b, *sample_shape), generator=g, device=device)
        labels = sample_labels(start, b, num_classes, class_label, device)
        x = formulation.generate(model, x_T, sampler, steps, labels, generator=g,
                                 clip=clip and len(sample_shape) == 3 and decode is None)
        out[k] = (x if decode is None else decode(x)).float().cpu()
    return out


def sample_labels(start: int, count: int, num_classes: int, class_label: int | None = None,
                  device: torch.device | str = "cpu") -> torch.Tensor | None:
    """The labels of samples [start, start + count): `class_label` for all, else the index mod num_classes;
    None for an unconditional model."""
    if not num_classes:
        return None
    if class_label is not None:
        return torch.full((count,), int(class_label), dtype=torch.long, device=device)
    return torch.arange(start, start + count, device=device) % num_classes


def merge_chunks(shards: list[dict[int, torch.Tensor]]) -> torch.Tensor:
    """The chunks {k: tensor} held by the ranks, concatenated in chunk order (each k exactly once)."""
    chunks = {}
    for shard in shards:
        for k, v in shard.items():
            if k in chunks:
                raise ValueError(f"chunk {k} was drawn by two processes")
            chunks[k] = v
    if sorted(chunks) != list(range(len(chunks))):
        raise ValueError(f"chunks {sorted(chunks)} are not 0..{len(chunks) - 1}")
    return torch.cat([chunks[k] for k in range(len(chunks))])


def generate(model, formulation, sample_shape, n: int, sampler: str, steps: int, seed: int,
             device: torch.device | str = "cpu", num_classes: int = 0, batch: int = 256,
             clip: bool = True, class_label: int | None = None, decode=None) -> torch.Tensor:
    """Draw `n` samples with one of the formulation's samplers, in chunks of `batch` (see `generate_chunks`);
    a pure function of (seed, batch)."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    chunks = generate_chunks(model, formulation, sample_shape, n, sampler, steps, seed, device, num_classes,
                             batch, clip, class_label=class_label, decode=decode)
    return merge_chunks([chunks])
