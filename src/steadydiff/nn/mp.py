"""Magnitude-preserving (MP) primitives of EDM2 (Karras et al., CVPR 2024, configs D-G).

Written from the paper's equations (summarised in shared/papers/edm2-notes.md Sec. 1). "Magnitude" is the
RMS per element, M[a] = sqrt(mean_i E[a_i^2]); every op here maps unit-magnitude inputs to unit-magnitude
outputs, and every learned layer normalises its weights so that their size cannot change the activations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..utils.errors import ConfigError

__all__ = ["MPAttention", "MPConv", "MPFourier", "mp_cat", "mp_silu", "mp_sum", "normalize", "pixel_norm"]


def normalize(x: Tensor, dim: int | Sequence[int] | None = None, eps: float = 1e-4) -> Tensor:
    """Unit RMS per slice: x / (eps + ||x||_2 / sqrt(n)), n = elements per slice (notes Sec. 1.1).

    dim=None normalises over all dims but the first (one slice per weight row / per sample). The norm is
    taken in float32 (float64 for float64 inputs), whatever the dtype of x.
    """
    if dim is None:
        if x.ndim < 2:
            raise ValueError("normalize(dim=None) needs a tensor with at least 2 dims")
        dim = tuple(range(1, x.ndim))
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=torch.promote_types(x.dtype, torch.float32))
    n = x.numel() / max(norm.numel(), 1)
    return x / (eps + norm / math.sqrt(n)).to(x.dtype)


def pixel_norm(x: Tensor, dim: int = 1, eps: float = 1e-4) -> Tensor:
    """Pixel norm (Eq. 30): unit RMS over the channels of every pixel."""
    return normalize(x, dim=dim, eps=eps)


def mp_silu(x: Tensor) -> Tensor:
    """MP-SiLU (Eq. 81): E_{x~N(0,1)}[silu(x)^2] = 0.3558, sqrt = 0.596."""
    return F.silu(x) / 0.596


def mp_sum(a: Tensor, b: Tensor, t: float = 0.5) -> Tensor:
    """MP-Sum (Eq. 88): ((1 - t) a + t b) / sqrt((1 - t)^2 + t^2); t = 0 returns a, t = 1 returns b."""
    return a.lerp(b, t) / math.sqrt((1 - t) ** 2 + t**2)


def mp_cat(a: Tensor, b: Tensor, dim: int = 1, t: float = 0.5) -> Tensor:
    """MP-Cat (Eq. 103): C [(1 - t)/sqrt(Na) a (+) t/sqrt(Nb) b], C = sqrt((Na + Nb) / ((1 - t)^2 + t^2)).

    Output RMS 1 for unit-RMS a, b, and a's share of the energy is (1 - t)^2 / ((1 - t)^2 + t^2) whatever
    the widths Na, Nb.
    """
    na, nb = a.shape[dim], b.shape[dim]
    c = math.sqrt((na + nb) / ((1 - t) ** 2 + t**2))
    wa = c / math.sqrt(na) * (1 - t)
    wb = c / math.sqrt(nb) * t
    return torch.cat([wa * a, wb * b], dim=dim)


class MPFourier(nn.Module):
    """MP Fourier features (Eq. 75): sqrt(2) cos(2 pi (f_i a + phi_i)), f_i ~ N(0, 1) bandwidth, phi_i ~ U(0, 1).

    Buffers store 2 pi f and 2 pi phi (fixed, not learned); E[cos^2] = 1/2 over the random phase, so the
    factor sqrt(2) makes the output unit-RMS.
    """

    def __init__(self, num_channels: int, bandwidth: float = 1.0):
        super().__init__()
        self.register_buffer("freqs", 2 * math.pi * torch.randn(num_channels) * bandwidth)
        self.register_buffer("phases", 2 * math.pi * torch.rand(num_channels))

    def forward(self, x: Tensor) -> Tensor:
        y = torch.outer(x.reshape(-1).to(torch.float32), self.freqs.to(torch.float32))
        y = y + self.phases.to(torch.float32)
        return (math.sqrt(2) * y.cos()).to(x.dtype)


class MPConv(nn.Module):
    """MP convolution (kernel (k, k)) or linear layer (kernel ()), no bias (Eqs. 46-47, 66).

    The stored weight is N(0, 1). In training mode every forward first rewrites it in place to unit RMS per
    output row, i.e. row norm sqrt(fan_in) ("forced" weight normalisation, Eq. 66); the layer then uses
    w_hat = gain * w / ||w|| (row-wise; "weight normalisation on use", Eqs. 46-47), written as
    normalize(w) * gain / sqrt(fan_in). Unit-RMS uncorrelated inputs give unit-RMS outputs.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel: Sequence[int] = ()):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, *kernel))

    @property
    def fan_in(self) -> int:
        return self.weight[0].numel()

    def forward(self, x: Tensor, gain: float | Tensor = 1.0) -> Tensor:
        if self.training:
            with torch.no_grad():
                self.weight.copy_(normalize(self.weight))  # forced WN (Eq. 66): row norm -> sqrt(fan_in)
        # A copy in training mode, so a graph from an earlier forward never sees the in-place reset above.
        w = self.weight.to(torch.promote_types(self.weight.dtype, torch.float32), copy=self.training)
        w = normalize(w)  # WN on use (Eq. 47): unit RMS per row, computed with gradient
        w = (w * (gain / math.sqrt(self.fan_in))).to(x.dtype)  # ||w_row|| = gain
        if w.ndim == 2:
            return F.linear(x, w)
        return F.conv2d(x, w, padding=w.shape[-1] // 2)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel={tuple(self.weight.shape[2:])}"


class MPAttention(nn.Module):
    """Cosine self-attention branch (notes Sec. 1.4); returns the branch output, merged by the caller (MP-Sum).

    qkv from a 1x1 MPConv, laid out as (heads, C_head, 3, HW); q, k and v are each pixel-normalised over the
    per-head channel dim (unit RMS, so ||q|| = ||k|| = sqrt(C_head)); SDPA's logits q.k / sqrt(C_head) are
    then sqrt(C_head) cos(q, k). The result goes through a 1x1 MPConv.
    """

    def __init__(self, channels: int, channels_per_head: int = 64):
        super().__init__()
        if channels_per_head < 1 or channels % channels_per_head:
            raise ConfigError(f"attention channels {channels} not divisible by channels_per_head {channels_per_head}; "
                              "make model.channels x model.channel_mult divisible by model.channels_per_head")
        self.num_heads = channels // channels_per_head
        self.qkv = MPConv(channels, 3 * channels, (1, 1))
        self.proj = MPConv(channels, channels, (1, 1))

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        qkv = self.qkv(x).reshape(b, self.num_heads, c // self.num_heads, 3, h * w)
        qkv = normalize(qkv, dim=2)  # pixel norm per head (Eq. 30 over C_head)
        q, k, v = (t.transpose(-1, -2) for t in qkv.unbind(3))  # each (B, heads, HW, C_head)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(-1, -2).reshape(b, c, h, w))
