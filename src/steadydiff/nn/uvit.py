"""U-ViT (Bao et al., CVPR 2023), the backbone of ScaleLong's released code, with pluggable skip scaling.

Tokens: [label token] + time token + image patches (conv patch embedding, stride = patch), plus a learned
position embedding. `depth // 2` in-blocks, one mid-block, `depth // 2` out-blocks; in-block outputs are
the long skips. Each out-block fuses `Linear(2D -> D)(cat(x, kappa_i * skip_i))` and then runs a pre-LN
attention + MLP block. Final LayerNorm, linear to patch pixels, unpatchify, optional 3x3 conv.

Parameter names follow the official state-dict layout (`patch_embed.proj`, `in_blocks.{i}.attn.qkv`,
`out_blocks.{i}.skip_linear`, `decoder_pred`, `final_layer`, ...) so that official checkpoints map onto
this module key for key (see `steadydiff.nn.convert`). Skip index 0 is the outermost skip (the first
in-block's output, consumed by the last out-block), as everywhere in steadydiff.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from ..utils.errors import ConfigError
from .layers import embed_labels, timestep_embedding
from .skip_scaling import LongSkips, SkipScaling, TokenGate


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ConfigError(f"embed_dim {dim} is not divisible by num_heads {num_heads}; make model.embed_dim "
                              "divisible by model.num_heads")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(d_head)) v
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """[skip fusion] -> x + Attn(LN(x)) -> x + MLP(LN(x))."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, qkv_bias: bool, skip: bool = False,
                 use_checkpoint: bool = False):
        super().__init__()
        self.skip_linear = nn.Linear(2 * dim, dim) if skip else None
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, qkv_bias)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.use_checkpoint = use_checkpoint

    def _forward(self, x: Tensor, skip: Tensor | None = None) -> Tensor:
        if self.skip_linear is not None:
            x = self.skip_linear(torch.cat([x, skip], dim=-1))
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def forward(self, x: Tensor, skip: Tensor | None = None) -> Tensor:
        if self.use_checkpoint and self.training:
            return torch.utils.checkpoint.checkpoint(self._forward, x, skip, use_reentrant=False)
        return self._forward(x, skip)


class PatchEmbed(nn.Module):
    def __init__(self, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, H*W/p^2, D)


class UViT(LongSkips, nn.Module):
    skip_gate = TokenGate  # LS in the official code gates tokens (mean over the embedding dim)
    time_input = "vp_time"  # a sinusoidal time token designed for VP's model time 999 t
    # why `steadydiff export --format diffusers` refuses it (nn/diffusers_export.py)
    unet2d_refusal = "U-ViT is a transformer over patch tokens, which diffusers' conv UNet2DModel cannot express"

    def __init__(
        self,
        img_size: int = 32,
        patch_size: int = 2,
        in_chans: int = 3,
        embed_dim: int = 512,
        depth: int = 12,
        num_heads: int = 8,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        mlp_time_embed: bool = False,
        num_classes: int = 0,
        conv: bool = True,
        use_checkpoint: bool = False,
        skip_scaling: SkipScaling | None = None,
    ):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"image size {img_size} is not divisible by patch size {patch_size}")
        if depth < 2:
            raise ValueError(f"depth must be >= 2 (depth // 2 in- and out-blocks), got {depth}")
        self.in_chans, self.patch_size, self.embed_dim, self.depth = in_chans, patch_size, embed_dim, depth
        self.num_classes = num_classes
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        num_patches = (img_size // patch_size) ** 2
        self.time_embed = (
            nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.SiLU(), nn.Linear(4 * embed_dim, embed_dim))
            if mlp_time_embed else nn.Identity()
        )
        self.label_emb = nn.Embedding(num_classes, embed_dim) if num_classes > 0 else None
        self.extras = 2 if num_classes > 0 else 1
        self.pos_embed = nn.Parameter(torch.zeros(1, self.extras + num_patches, embed_dim))

        def block(skip: bool) -> Block:
            return Block(embed_dim, num_heads, mlp_ratio, qkv_bias, skip, use_checkpoint)

        self.in_blocks = nn.ModuleList([block(False) for _ in range(depth // 2)])
        self.mid_block = block(False)
        self.out_blocks = nn.ModuleList([block(True) for _ in range(depth // 2)])
        self.norm = nn.LayerNorm(embed_dim)
        self.decoder_pred = nn.Linear(embed_dim, patch_size**2 * in_chans)
        self.final_layer = nn.Conv2d(in_chans, in_chans, 3, padding=1) if conv else nn.Identity()
        self._init_weights()
        # LS gates read whole token sequences: their width is the token count L.
        self.skip_channels = [self.extras + num_patches] * (depth // 2)
        self.attach_skip_scaling(skip_scaling)

    def _init_weights(self) -> None:
        # U-ViT init: truncated normal (std 0.02) for Linear weights and the position embedding, zero biases.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def describe(self) -> dict[str, int | str]:
        return {"width": self.embed_dim, "depth": self.depth}

    def decoder_blocks(self) -> list[nn.Module]:
        """The skip-consuming out-blocks, outermost first (out_blocks[0] runs first, on the innermost skip)."""
        return list(reversed(self.out_blocks))

    def unpatchify(self, x: Tensor) -> Tensor:
        """(B, h*w, p*p*C) with per-patch (p1, p2, C) order -> (B, C, h*p, w*p)."""
        b, n, _ = x.shape
        p, c = self.patch_size, self.in_chans
        h = w = int(n**0.5)
        return x.view(b, h, w, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, h * p, w * p)

    def forward(self, x: Tensor, t: Tensor, labels: Tensor | None = None) -> Tensor:
        tokens = self.patch_embed(x)
        extra = [self.time_embed(timestep_embedding(t, self.embed_dim)).unsqueeze(1)]
        if self.label_emb is not None:
            if labels is None:
                raise ValueError("this U-ViT is class-conditional: pass labels (model.num_classes > 0)")
            extra.insert(0, embed_labels(self.label_emb, labels).unsqueeze(1))  # token order: [label, time, patches]
        h = torch.cat([*extra, tokens], dim=1) + self.pos_embed
        skips = []
        for blk in self.in_blocks:
            h = blk(h)
            skips.append(h)
        h = self.mid_block(h)
        for blk in self.out_blocks:
            i = len(skips) - 1
            s = skips.pop()
            if self.skip_scaling is not None:
                s = self.skip_scaling(i, s)
            h = blk(h, s)
        h = self.decoder_pred(self.norm(h))[:, self.extras:]
        return self.final_layer(self.unpatchify(h))
