"""ADM/DDPM-style convolutional UNet with concatenated long skips and pluggable skip scaling.

Layout (Ho et al. 2020; Dhariwal & Nichol 2021): conv_in, then per resolution level `num_res_blocks`
residual blocks (+ self-attention at `attn_resolutions`) and a strided-conv downsample between levels;
a middle ResBlock-Attention-ResBlock; the decoder mirrors it with `num_res_blocks + 1` blocks per level,
each consuming one long skip by channel concatenation; GroupNorm, SiLU, zero-initialised conv_out.

Every encoder output (conv_in, each block, each downsample) is one long skip, so the UNet has
N = 1 + L * num_res_blocks + (L - 1) skips for L levels. Skip 0 (outermost) is the conv_in output, consumed
by the last decoder block. `skip_scaling(i, skip)` is applied to each skip just before concatenation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..utils.errors import ConfigError
from .layers import TimeEmbedding, group_norm, run_block, zero_module
from .skip_scaling import LongSkips, SkipScaling


class ResBlock(nn.Module):
    """GN-SiLU-conv, + time embedding, GN-SiLU-dropout-conv(zero init), residual (1x1 conv if widths differ)."""

    def __init__(self, cin: int, cout: int, emb_dim: int, dropout: float):
        super().__init__()
        self.norm1 = group_norm(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.emb = nn.Linear(emb_dim, cout)
        self.norm2 = group_norm(cout)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = zero_module(nn.Conv2d(cout, cout, 3, padding=1))
        self.shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb(F.silu(emb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.shortcut(x) + h


class Attention(nn.Module):
    """Multi-head self-attention over the H*W positions, pre-GroupNorm, zero-initialised output."""

    def __init__(self, channels: int, num_heads: int):
        super().__init__()
        if channels % num_heads:
            raise ConfigError(f"attention channels {channels} not divisible by num_heads {num_heads}; make "
                              "model.channels x model.channel_mult divisible by model.num_heads")
        self.num_heads = num_heads
        self.norm = group_norm(channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = zero_module(nn.Conv2d(channels, channels, 1))

    def forward(self, x: Tensor, emb: Tensor | None = None) -> Tensor:
        b, c, h, w = x.shape
        qkv = self.qkv(self.norm(x)).reshape(b, 3, self.num_heads, c // self.num_heads, h * w)
        q, k, v = (qkv[:, i].transpose(-1, -2) for i in range(3))  # (B, heads, HW, d)
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(out.transpose(-1, -2).reshape(b, c, h, w))


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: Tensor, emb: Tensor | None = None) -> Tensor:
        return self.conv(x)


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor, emb: Tensor | None = None) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Stage(nn.Sequential):
    """A sequence of layers that all take (x, emb)."""

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:  # type: ignore[override]
        for layer in self:
            x = layer(x, emb)
        return x


class UNet(LongSkips, nn.Module):
    time_input = "vp_time"  # a sinusoidal embedding designed for VP's model time 999 t

    def __init__(
        self,
        in_channels: int = 1,
        resolution: int = 28,
        channels: int = 64,
        channel_mult: tuple[int, ...] | list[int] = (1, 2, 2),
        num_res_blocks: int = 2,
        attn_resolutions: tuple[int, ...] | list[int] = (7,),
        num_heads: int = 4,
        dropout: float = 0.0,
        num_classes: int = 0,
        skip_scaling: SkipScaling | None = None,
        grad_checkpointing: bool = False,
        norm_groups: int | None = None,
    ):
        super().__init__()
        self.grad_checkpointing = grad_checkpointing  # recompute each stage in backward (memory for compute)
        levels = len(channel_mult)
        if resolution % (2 ** (levels - 1)):
            raise ConfigError(
                f"resolution {resolution} is not divisible by 2^{levels - 1}; use fewer levels in "
                f"model.channel_mult or a resolution divisible by {2 ** (levels - 1)}"
            )
        emb_dim = 4 * channels
        self.channels, self.levels, self.num_res_blocks = channels, levels, num_res_blocks
        self.in_channels = in_channels
        self.num_classes = num_classes
        self.embed = TimeEmbedding(channels, emb_dim, num_classes)
        self.conv_in = nn.Conv2d(in_channels, channels, 3, padding=1)

        skip_ch = [channels]
        self.down = nn.ModuleList()
        ch, res = channels, resolution
        for level, mult in enumerate(channel_mult):
            for _ in range(num_res_blocks):
                layers: list[nn.Module] = [ResBlock(ch, channels * mult, emb_dim, dropout)]
                ch = channels * mult
                if res in attn_resolutions:
                    layers.append(Attention(ch, num_heads))
                self.down.append(Stage(*layers))
                skip_ch.append(ch)
            if level != levels - 1:
                self.down.append(Stage(Downsample(ch)))
                skip_ch.append(ch)
                res //= 2

        self.mid = Stage(
            ResBlock(ch, ch, emb_dim, dropout), Attention(ch, num_heads), ResBlock(ch, ch, emb_dim, dropout)
        )

        self.up = nn.ModuleList()
        pending = list(skip_ch)
        for level, mult in reversed(list(enumerate(channel_mult))):
            for j in range(num_res_blocks + 1):
                layers = [ResBlock(ch + pending.pop(), channels * mult, emb_dim, dropout)]
                ch = channels * mult
                if res in attn_resolutions:
                    layers.append(Attention(ch, num_heads))
                if level != 0 and j == num_res_blocks:
                    layers.append(Upsample(ch))
                    res *= 2
                self.up.append(Stage(*layers))
        assert not pending

        self.out = nn.Sequential(group_norm(ch), nn.SiLU(), zero_module(nn.Conv2d(ch, in_channels, 3, padding=1)))
        if norm_groups is not None:
            self._set_norm_groups(norm_groups)
        self.skip_channels = skip_ch  # outermost first
        self.attach_skip_scaling(skip_scaling)

    def _set_norm_groups(self, groups: int) -> None:
        """One group count for every GroupNorm (`model.norm_groups`, as diffusers' `norm_num_groups`). A GroupNorm's
        parameters are per channel, so only `num_groups` changes: the layers are built by the per-layer rule first
        and then regrouped, which keeps one construction path for both settings."""
        norms = [m for m in self.modules() if isinstance(m, nn.GroupNorm)]
        widths = sorted({m.num_channels for m in norms})
        if any(w % groups for w in widths):
            common = math.gcd(*widths)
            valid = [g for g in range(1, common + 1) if common % g == 0]
            raise ConfigError(f"model.norm_groups={groups} does not divide every normalised channel count "
                              f"({', '.join(map(str, widths))}); choose one of {', '.join(map(str, valid))} or null")
        for m in norms:
            m.num_groups = groups

    def norm_group_counts(self) -> list[int]:
        """The group count of every GroupNorm, in module order."""
        return [m.num_groups for m in self.modules() if isinstance(m, nn.GroupNorm)]

    def describe(self) -> dict[str, int | str]:
        return {"width": self.channels, "depth": f"{self.levels} levels x {self.num_res_blocks}"}

    def decoder_blocks(self) -> list[nn.Module]:
        """The skip-consuming decoder blocks, outermost first: every up-stage consumes exactly one skip, and
        up[0] runs first (innermost skip), so a resolution level with several stages gives several blocks."""
        return list(reversed(self.up))

    def skip_groupnorm_isolation(self) -> list[float]:
        """Per long skip (outermost first): the fraction of its channels that sit in GroupNorm groups of the
        consuming block's first norm with no main-path channel. The block normalises cat([h, s]) group by
        group, so in such groups a skip coefficient kappa_i is divided out exactly (ScaleLong's CS then acts
        only through the mixed groups and the 1x1 shortcut conv)."""
        fractions = []
        for stage, n_skip in zip(self.decoder_blocks(), self.skip_channels):
            norm = stage[0].norm1
            cin = norm.num_channels
            size = cin // norm.num_groups
            main = cin - n_skip  # cat([h, s]): the main path's channels come first
            isolated = sum(size for g in range(norm.num_groups) if g * size >= main)
            fractions.append(isolated / n_skip)
        return fractions

    def forward(self, x: Tensor, t: Tensor, labels: Tensor | None = None) -> Tensor:
        emb = self.embed(t, labels)
        h = self.conv_in(x)
        skips = [h]
        ckpt = self.grad_checkpointing
        for stage in self.down:
            h = run_block(stage, h, emb, checkpoint=ckpt)
            skips.append(h)
        h = run_block(self.mid, h, emb, checkpoint=ckpt)
        for stage in self.up:
            i = len(skips) - 1  # the innermost remaining skip; index 0 is the outermost
            s = skips.pop()
            if self.skip_scaling is not None:
                s = self.skip_scaling(i, s)
            h = run_block(stage, torch.cat([h, s], dim=1), emb, checkpoint=ckpt)
        return self.out(h)
