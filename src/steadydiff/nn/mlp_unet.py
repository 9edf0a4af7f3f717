"""A small MLP-UNet for 2-D points (toy2d): skip scaling can be studied in seconds.

Input Linear(dim -> H); N = `depth` // 2 encoder blocks a_1..a_N (depth counts encoder + decoder blocks,
as U-ViT's does), each a residual MLP block with the time
embedding, whose outputs are the long skips (skip 0 = output of a_1, the outermost); a middle block;
N decoder blocks b_N..b_1, each fusing `Linear(2H -> H)(cat(h, kappa_i * skip_i))` and then a
residual MLP block, mirroring the U-ViT out-block; LayerNorm, zero-initialised Linear(H -> dim).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .layers import TimeEmbedding, run_block, zero_module
from .skip_scaling import LongSkips, SkipScaling


class MLPBlock(nn.Module):
    """h + W2 SiLU(W1 LN(h) + E t): pre-norm residual MLP block conditioned on the time embedding."""

    def __init__(self, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.emb = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)
        self.dropout = nn.Dropout(dropout)

    def forward(self, h: Tensor, emb: Tensor) -> Tensor:
        return h + self.fc2(self.dropout(F.silu(self.fc1(self.norm(h)) + self.emb(emb))))


class MLPUNet(LongSkips, nn.Module):
    time_input = "vp_time"  # a sinusoidal embedding designed for VP's model time 999 t
    # why `steadydiff export --format diffusers` refuses it (nn/diffusers_export.py)
    unet2d_refusal = "the MLP U-Net models vectors, not images, and diffusers' UNet2DModel is a conv UNet"

    def __init__(
        self,
        dim: int = 2,
        hidden: int = 128,
        depth: int = 3,
        dropout: float = 0.0,
        num_classes: int = 0,
        skip_scaling: SkipScaling | None = None,
        grad_checkpointing: bool = False,
    ):
        super().__init__()
        self.grad_checkpointing = grad_checkpointing  # recompute each block in backward (memory for compute)
        if depth < 2:
            raise ValueError(f"depth must be >= 2 (depth // 2 encoder and decoder blocks), got {depth}")
        n = depth // 2
        self.hidden, self.depth = hidden, depth
        self.num_classes = num_classes
        self.embed = TimeEmbedding(hidden, hidden, num_classes)
        self.inp = nn.Linear(dim, hidden)
        self.down = nn.ModuleList([MLPBlock(hidden, dropout) for _ in range(n)])
        self.mid = MLPBlock(hidden, dropout)
        self.fuse = nn.ModuleList([nn.Linear(2 * hidden, hidden) for _ in range(n)])
        self.up = nn.ModuleList([MLPBlock(hidden, dropout) for _ in range(n)])
        self.norm = nn.LayerNorm(hidden)
        self.out = zero_module(nn.Linear(hidden, dim))
        self.skip_channels = [hidden] * n
        self.attach_skip_scaling(skip_scaling)

    def describe(self) -> dict[str, int | str]:
        return {"width": self.hidden, "depth": self.depth}

    def decoder_blocks(self) -> list[nn.Module]:
        """The skip-consuming decoder blocks, outermost first (up[0] runs first and takes the innermost skip)."""
        return list(reversed(self.up))

    def forward(self, x: Tensor, t: Tensor, labels: Tensor | None = None) -> Tensor:
        emb = self.embed(t, labels)
        h = self.inp(x)
        skips = []
        ckpt = self.grad_checkpointing
        for block in self.down:
            h = run_block(block, h, emb, checkpoint=ckpt)
            skips.append(h)
        h = run_block(self.mid, h, emb, checkpoint=ckpt)
        for fuse, block in zip(self.fuse, self.up):
            i = len(skips) - 1
            s = skips.pop()
            if self.skip_scaling is not None:
                s = self.skip_scaling(i, s)
            h = run_block(block, fuse(torch.cat([h, s], dim=-1)), emb, checkpoint=ckpt)
        return self.out(self.norm(h))
