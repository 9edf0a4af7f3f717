"""Small building blocks shared by the backbones."""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from ..utils.errors import ConfigError


def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal embedding of (continuous) times t, shape (B,) -> (B, dim) (Vaswani et al. 2017 / DDPM).

    Frequencies max_period^(-k / half) for k = 0..half-1; [cos | sin] halves, zero-padded for odd dim.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm with up to 32 groups of at least 4 channels (32 groups as in DDPM/ADM for wide layers)."""
    groups = math.gcd(32, max(1, channels // 4))
    if channels % groups:
        raise ConfigError(f"GroupNorm cannot split {channels} channels into {groups} groups; make model.channels "
                          "divisible by 4")
    return nn.GroupNorm(groups, channels)


def zero_module(module: nn.Module) -> nn.Module:
    """Zero-initialise a layer so that a residual branch starts as the identity (ADM convention)."""
    for p in module.parameters():
        nn.init.zeros_(p)
    return module


NULL_LABEL = -1  # "no class": what label dropout trains and classifier-free guidance's unconditional branch uses


def embed_labels(table: nn.Embedding, labels: Tensor) -> Tensor:
    """Rows of `table` for int labels (B,); NULL_LABEL rows are zero, so the null label adds no label term (as
    EDM2's label dropout, which zeroes the one-hot vector; Ho & Salimans 2022 train it with probability p)."""
    keep = labels >= 0
    return table(labels.clamp(min=0)) * keep.unsqueeze(-1).to(table.weight.dtype)


class TimeEmbedding(nn.Module):
    """Sinusoidal features of the model time -> MLP (Linear, SiLU, Linear), plus an optional label embedding."""

    def __init__(self, freq_dim: int, dim: int, num_classes: int = 0):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.label = nn.Embedding(num_classes, dim) if num_classes > 0 else None

    def forward(self, t: Tensor, labels: Tensor | None = None) -> Tensor:
        emb = self.mlp(timestep_embedding(t, self.freq_dim))
        if self.label is not None:
            if labels is None:
                raise ValueError("this model is class-conditional: pass labels (model.num_classes > 0)")
            emb = emb + embed_labels(self.label, labels)
        return emb


def run_block(block: nn.Module, *args: Tensor | None, checkpoint: bool = False) -> Tensor:
    """`block(*args)`; with `checkpoint` (in training, with gradients on) its activations are not stored but
    recomputed in backward: less memory for ~one extra forward. Dropout masks are replayed exactly (the RNG
    state is saved), so gradients match the plain call."""
    if checkpoint and block.training and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
    return block(*args)
