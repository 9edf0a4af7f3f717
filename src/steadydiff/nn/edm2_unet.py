"""The EDM2 U-Net (Karras et al., CVPR 2024, config G), built from the MP primitives in `mp.py`.

Layout (notes Sec. 1.5): ones-channel + 3x3 conv at full resolution; per level [down block] + `num_blocks`
encoder blocks; the decoder has two blocks at the lowest resolution (the first with attention), then per
level [up block] + `num_blocks + 1` blocks, each preceded by MP-Cat with its long skip; output 3x3 conv
with a zero-initialised learned gain. No biases, no group norm, every learned layer is an MPConv.

Long skips: every encoder output (input conv, each block, each down block) is one skip, so there are
N = 1 + L * num_blocks + (L - 1) of them for L levels. Skip i = 0 (outermost) is the input-conv output,
consumed by the last decoder block. `skip_scaling(i, skip)` (ScaleLong, off by default) is applied to each
skip right before its MP-Cat.

`forward(x, c_noise, labels)` returns the raw network output F; EDM preconditioning (c_in, c_skip, c_out,
c_noise = ln(sigma) / 4) and the learned uncertainty u(sigma) live in `diffusion.edm.EDMPrecond`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..utils.errors import ConfigError
from .layers import run_block
from .mp import MPAttention, MPConv, MPFourier, mp_cat, mp_silu, mp_sum, pixel_norm
from .skip_scaling import LongSkips, SkipScaling

__all__ = ["EDM2Block", "EDM2UNet"]


class EDM2Block(nn.Module):
    """Encoder ("enc") or decoder ("dec") block (notes Sec. 1.5, config G).

    main path:  resample (2x box filter [1, 1]) -> enc: [1x1 conv if widths differ] -> pixel norm (Eq. 30)
    residual:   MP-SiLU -> 3x3 conv -> x (1 + emb_gain MPLinear(emb)) per channel -> MP-SiLU -> dropout
                -> 3x3 conv
    merge:      dec: [1x1 conv of the main path if widths differ]; MP-Sum(t = res_balance = 0.3, Eq. 88)
    attention:  optional cosine attention, MP-Sum(t = attn_balance = 0.3); finally clip to +-clip_act.
    `consumes_skip` marks decoder blocks fed by MP-Cat(x, skip) (set by the U-Net).
    """

    def __init__(self, in_channels: int, out_channels: int, emb_channels: int, flavor: str = "enc",
                 resample: str | None = None, attention: bool = False, channels_per_head: int = 64,
                 dropout: float = 0.0, res_balance: float = 0.3, attn_balance: float = 0.3,
                 clip_act: float | None = 256.0):
        super().__init__()
        if flavor not in ("enc", "dec"):
            raise ValueError(f"flavor must be 'enc' or 'dec', got {flavor!r}")
        if resample not in (None, "down", "up"):
            raise ValueError(f"resample must be None, 'down' or 'up', got {resample!r}")
        self.flavor, self.resample = flavor, resample
        self.in_channels, self.out_channels = in_channels, out_channels
        self.dropout, self.res_balance, self.attn_balance, self.clip_act = dropout, res_balance, attn_balance, clip_act
        self.consumes_skip = False
        self.conv_skip = MPConv(in_channels, out_channels, (1, 1)) if in_channels != out_channels else None
        self.conv_res0 = MPConv(out_channels if flavor == "enc" else in_channels, out_channels, (3, 3))
        self.emb_linear = MPConv(emb_channels, out_channels, ())
        self.emb_gain = nn.Parameter(torch.zeros([]))  # learned gain (Eq. 104), 0 => conditioning off at init
        self.conv_res1 = MPConv(out_channels, out_channels, (3, 3))
        self.attn = MPAttention(out_channels, channels_per_head) if attention else None

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        if self.resample == "down":
            x = F.avg_pool2d(x, 2)  # box filter [1, 1] / 2 per axis, stride 2
        elif self.resample == "up":
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")  # transposed box filter [1, 1]: repeat 2x2
        if self.flavor == "enc":
            if self.conv_skip is not None:
                x = self.conv_skip(x)
            x = pixel_norm(x)  # Eq. 30, start of every encoder block
        y = self.conv_res0(mp_silu(x))
        c = self.emb_linear(emb, gain=self.emb_gain) + 1  # (B, C_out): 1 + g MPLinear(emb), Eq. 104 gain
        y = mp_silu(y * c[:, :, None, None].to(y.dtype))
        if self.dropout:
            y = F.dropout(y, p=self.dropout, training=self.training)
        y = self.conv_res1(y)
        if self.flavor == "dec" and self.conv_skip is not None:
            x = self.conv_skip(x)
        x = mp_sum(x, y, self.res_balance)  # Eq. 88, t = 0.3
        if self.attn is not None:
            x = mp_sum(x, self.attn(x), self.attn_balance)  # Eq. 88, t = 0.3
        if self.clip_act is not None:
            x = x.clamp(-self.clip_act, self.clip_act)  # App. D.2: +-256 for fp16 safety
        return x

    def extra_repr(self) -> str:
        return f"{self.flavor}, {self.in_channels} -> {self.out_channels}, resample={self.resample}"


class EDM2UNet(LongSkips, nn.Module):
    """EDM2 config-G U-Net; `forward(x, c_noise, labels=None)` -> F (same shape as x).

    c_noise: (B,) (or one value for the whole batch), EDM's ln(sigma) / 4. labels: int64 class indices (B,)
    (one-hot encoded here) or a float (B, label_dim) one-hot / soft matrix; ignored when label_dim = 0.
    """

    time_input = "c_noise"  # EDM's c_noise = ln(sigma) / 4 as is (its MP-Fourier embedding has bandwidth 1)
    # why `steadydiff export --format diffusers` refuses it (nn/diffusers_export.py)
    unet2d_refusal = ("the EDM2 UNet's magnitude-preserving layers (weight-normalised convolutions, MP-SiLU, MP-sum, "
                      "MP-cat, MP-Fourier time embedding, no GroupNorm) have no counterpart in diffusers' UNet2DModel")

    def __init__(
        self,
        img_resolution: int,
        img_channels: int,
        label_dim: int = 0,
        model_channels: int = 192,
        channel_mult: Sequence[int] = (1, 2, 3, 4),
        channel_mult_noise: int | None = None,
        channel_mult_emb: int | None = None,
        num_blocks: int = 3,
        attn_resolutions: Sequence[int] = (16, 8),
        channels_per_head: int = 64,
        label_balance: float = 0.5,
        concat_balance: float = 0.5,
        dropout: float = 0.0,
        skip_scaling: SkipScaling | None = None,
        grad_checkpointing: bool = False,
    ):
        super().__init__()
        self.grad_checkpointing = grad_checkpointing  # recompute each block in backward (memory for compute)
        levels = len(channel_mult)
        if levels < 1 or img_resolution % (2 ** (levels - 1)):
            raise ConfigError(f"img_resolution {img_resolution} is not divisible by 2^{levels - 1}; use fewer "
                              "levels in model.channel_mult or another data.resolution")
        self.img_resolution, self.img_channels, self.label_dim = img_resolution, img_channels, label_dim
        self.label_balance, self.concat_balance = label_balance, concat_balance
        self.model_channels, self.levels, self.num_blocks = model_channels, levels, num_blocks
        cblock = [model_channels * m for m in channel_mult]
        cnoise = model_channels * channel_mult_noise if channel_mult_noise is not None else model_channels
        cemb = model_channels * channel_mult_emb if channel_mult_emb is not None else max(cblock)
        block = dict(emb_channels=cemb, channels_per_head=channels_per_head, dropout=dropout)

        # Embedding: MP-Fourier(c_noise) -> MPLinear [-> MP-Sum with MPLinear(one-hot sqrt(N)), t = 0.5] -> MP-SiLU
        self.emb_fourier = MPFourier(cnoise)
        self.emb_noise = MPConv(cnoise, cemb, ())
        self.emb_label = MPConv(label_dim, cemb, ()) if label_dim else None

        # Encoder. The ones channel replaces the removed biases.
        self.conv_in = MPConv(img_channels + 1, cblock[0], (3, 3))
        self.enc = nn.ModuleList()
        skip_ch = [cblock[0]]
        cout = cblock[0]
        for level, channels in enumerate(cblock):
            res = img_resolution >> level
            if level:
                self.enc.append(EDM2Block(cout, cout, flavor="enc", resample="down", **block))
                skip_ch.append(cout)
            for _ in range(num_blocks):
                self.enc.append(EDM2Block(cout, channels, flavor="enc", attention=res in attn_resolutions, **block))
                cout = channels
                skip_ch.append(cout)

        # Decoder, in execution order.
        self.dec = nn.ModuleList()
        pending = list(skip_ch)
        for level, channels in reversed(list(enumerate(cblock))):
            res = img_resolution >> level
            if level == levels - 1:
                self.dec.append(EDM2Block(cout, cout, flavor="dec", attention=True, **block))
                self.dec.append(EDM2Block(cout, cout, flavor="dec", **block))
            else:
                self.dec.append(EDM2Block(cout, cout, flavor="dec", resample="up", **block))
            for _ in range(num_blocks + 1):
                blk = EDM2Block(cout + pending.pop(), channels, flavor="dec", attention=res in attn_resolutions,
                                **block)
                blk.consumes_skip = True
                self.dec.append(blk)
                cout = channels
        assert not pending

        self.conv_out = MPConv(cout, img_channels, (3, 3))
        self.out_gain = nn.Parameter(torch.zeros([]))  # learned gain (Eq. 104), 0 => F = 0 at init

        self.skip_channels = skip_ch  # outermost first
        self.attach_skip_scaling(skip_scaling)

    def describe(self) -> dict[str, int | str]:
        return {"width": self.model_channels, "depth": f"{self.levels} levels x {self.num_blocks}"}

    def decoder_blocks(self) -> list[nn.Module]:
        """The skip-consuming decoder blocks, outermost first (block i consumes skip i)."""
        return list(reversed([b for b in self.dec if b.consumes_skip]))

    def embed(self, c_noise: Tensor, labels: Tensor | None, batch: int) -> Tensor:
        c_noise = c_noise.reshape(-1)
        if c_noise.numel() == 1:
            c_noise = c_noise.expand(batch)
        emb = self.emb_noise(self.emb_fourier(c_noise))
        if self.emb_label is not None:
            if labels is None:
                raise ValueError("this model is class-conditional (label_dim > 0): pass labels")
            if labels.is_floating_point():
                onehot = labels.reshape(labels.shape[0], -1).to(emb.dtype)
            else:
                labels = labels.reshape(-1).long()  # NULL_LABEL (-1): the zero vector, EDM2's label dropout
                onehot = F.one_hot(labels.clamp(min=0), self.label_dim).to(emb.dtype) * (labels >= 0)[:, None]
            label_emb = self.emb_label(onehot * math.sqrt(self.label_dim))  # one-hot x sqrt(N): unit RMS
            emb = mp_sum(emb, label_emb, self.label_balance)  # Eq. 88, t = 0.5
        return mp_silu(emb)

    def forward(self, x: Tensor, c_noise: Tensor, labels: Tensor | None = None) -> Tensor:
        emb = self.embed(c_noise, labels, x.shape[0])
        h = self.conv_in(torch.cat([x, torch.ones_like(x[:, :1])], dim=1))
        skips = [h]
        ckpt = self.grad_checkpointing
        for blk in self.enc:
            h = run_block(blk, h, emb, checkpoint=ckpt)
            skips.append(h)
        for blk in self.dec:
            if blk.consumes_skip:
                i = len(skips) - 1  # the innermost remaining skip; index 0 is the outermost
                s = skips.pop()
                if self.skip_scaling is not None:
                    s = self.skip_scaling(i, s)
                h = mp_cat(h, s, t=self.concat_balance)  # Eq. 103, t = 0.5
            h = run_block(blk, h, emb, checkpoint=ckpt)
        return self.conv_out(h, gain=self.out_gain)
