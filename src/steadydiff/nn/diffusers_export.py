"""steadydiff's `unet` as diffusers' `UNet2DModel`: its config and its weights, built from the module itself.

The ADM-style UNet (`nn/unet.py`) and `UNet2DModel` with `resnet_time_scale_shift="default"` are the same network
block for block: conv_in; per level `DownBlock2D` / `AttnDownBlock2D` (ResBlocks, attention at the attention
resolutions, a strided-conv downsampler between levels); `UNetMidBlock2D` (ResBlock, attention, ResBlock); per
level `UpBlock2D` / `AttnUpBlock2D` with one more ResBlock, each concatenating one long skip; GroupNorm, SiLU,
conv_out. The time embedding is the same sinusoid ([cos | sin], max period 1e4, no frequency shift, so
`flip_sin_to_cos=True, freq_shift=0`) into Linear, SiLU, Linear, and a class-conditional model adds an
`nn.Embedding` row to it (`num_class_embeds`). Weight for weight, only three things differ in layout:

- attention: one 1x1 conv `qkv` (3C outputs: q, k, v, each heads x head_dim) here, three Linears `to_q`, `to_k`,
  `to_v` there; the 1x1 output conv `proj` is the Linear `to_out.0`;
- GroupNorm: diffusers has one `norm_num_groups` for every norm; steadydiff's default rule sets it per layer
  (gcd(32, C // 4)), so only a model whose norms all use one count (`model.norm_groups`) maps exactly;
- attention heads: diffusers fixes the head *width* (`attention_head_dim`) for the whole model, steadydiff the
  head *count* (`num_heads`), so they agree when every attention layer has the same width (or one head).

What cannot be carried over exactly is refused (`unet2d_refusal`), never approximated: per-layer group counts,
varying head widths, a first level wider than conv_in (diffusers' conv_in and time embedding are as wide as
`block_out_channels[0]`), and any skip coefficient other than 1. Why the last: every decoder block starts with
GroupNorm(cat([h, kappa_i s])) and the 1x1 shortcut conv. The shortcut is linear in the skip, so kappa_i could be
folded into its columns, but the norm is not: in a group mixing main-path and skip channels, kappa_i changes the
group's mean and variance for every channel in it; in a group of skip channels only it cancels except for the
norm's eps, (kappa s - kappa mu) / sqrt(kappa^2 var + eps) = (s - mu) / sqrt(var + eps / kappa^2), which no weight
reproduces. The skip itself is also the main path's input to the next encoder block, so it cannot be scaled where
it is made. Org (every kappa_i = 1) is the one exact case; LS gates compute kappa_i from the skip.

Nothing here imports diffusers: the config is a dict and the weights a state dict (tests check them against
diffusers itself).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ..utils.errors import ExportError
from .skip_scaling import ConstantScaling
from .unet import Attention, Downsample, ResBlock, UNet, Upsample

# The oldest diffusers whose UNet2DModel reads every key below (the `hf` extra's floor).
DIFFUSERS_VERSION = "0.27.0"


def _attention_head_dim(model: UNet) -> tuple[int | None, str | None]:
    """(diffusers' attention_head_dim, None) or (None, reason). None as the dim means one head per layer."""
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if all(a.num_heads == 1 for a in attns):
        return None, None  # diffusers then makes each layer one head as wide as the layer
    widths = {a.norm.num_channels // a.num_heads for a in attns}
    if len(widths) == 1:
        return widths.pop(), None
    layer_widths = sorted({a.norm.num_channels for a in attns})
    return None, (f"its attention layers are {', '.join(map(str, layer_widths))} channels wide with "
                  f"{attns[0].num_heads} heads each, so their head widths differ, while UNet2DModel fixes one head "
                  "width for all (attention_head_dim); train with model.num_heads=1 or attention only at widths "
                  "equal to the middle block's")


def _suggested_groups(model: UNet) -> int:
    """What model.norm_groups to suggest: the per-layer rule's choice for the narrowest layer, i.e. the largest count
    <= 32 (ADM's) that divides every normalised width and leaves groups of at least 4 channels in all of them."""
    common = math.gcd(*(m.num_channels for m in model.modules() if isinstance(m, nn.GroupNorm)))
    return max(g for g in range(1, max(1, min(32, common // 4)) + 1) if common % g == 0)


def unet2d_refusal(model: nn.Module) -> str | None:
    """Why `model` cannot be written as a UNet2DModel with the same outputs, or None when it can. Other backbones
    state their reason as the class attribute `unet2d_refusal`."""
    if not isinstance(model, UNet):
        return getattr(model, "unet2d_refusal", None) or f"{type(model).__name__} is not steadydiff's ADM-style unet"
    counts = sorted(set(model.norm_group_counts()))
    if len(counts) > 1:
        return (f"its GroupNorms use per-layer group counts ({', '.join(map(str, counts))}; model.norm_groups=null) "
                "while UNet2DModel has one count for all (norm_num_groups); train new runs with "
                f"model.norm_groups={_suggested_groups(model)}")
    if model.conv_in.out_channels != model.down[0][0].conv1.out_channels:
        return (f"its first level is wider ({model.down[0][0].conv1.out_channels}) than conv_in "
                f"({model.conv_in.out_channels}), while UNet2DModel makes conv_in and the time embedding as wide as "
                "the first level; train with model.channel_mult starting at 1")
    _, reason = _attention_head_dim(model)
    if reason:
        return reason
    scaling = model.skip_scaling
    if scaling is not None and not (isinstance(scaling, ConstantScaling) and all(c == 1.0 for c in scaling.coeffs)):
        if not isinstance(scaling, ConstantScaling):
            return ("its LS gates compute each skip's coefficient from the skip itself, a network UNet2DModel has no "
                    "place for")
        coeffs = ", ".join(f"{c:.3g}" for c in scaling.coeffs[:3])
        return (f"its skip coefficients ({coeffs}, ...) are not all 1, and each decoder block GroupNorms "
                "cat([h, kappa_i s]) before any weight sees the skip, so kappa_i cannot be folded into UNet2DModel's "
                "weights exactly (only skip_scaling=org exports)")
    return None


def _levels(model: UNet) -> list[dict[str, Any]]:
    """Per resolution level, outermost first: its width and whether its blocks have attention."""
    levels = []
    stages = iter(model.down)
    for level in range(model.levels):
        blocks = [next(stages) for _ in range(model.num_res_blocks)]
        levels.append({"width": blocks[0][0].conv1.out_channels, "attn": any(isinstance(m, Attention)
                                                                               for m in blocks[0])})
        if level != model.levels - 1:
            next(stages)  # the downsampler
    return levels


def unet2d_config(model: UNet, sample_size: int, *, null_class: bool = False) -> dict[str, Any]:
    """The `UNet2DModel` config (its `config.json`) of `model`, which must pass `unet2d_refusal`.

    `null_class`: add one class as steadydiff's null label (a zero embedding row, index num_classes), so a model
    trained with label dropout keeps its unconditional branch."""
    reason = unet2d_refusal(model)
    if reason:
        raise ExportError(f"cannot write this model as a UNet2DModel: {reason}")
    levels = _levels(model)
    head_dim, _ = _attention_head_dim(model)
    dropouts = {m.p for m in model.modules() if isinstance(m, nn.Dropout)}
    classes = model.num_classes + (1 if null_class and model.num_classes else 0)
    return {
        "_class_name": "UNet2DModel",
        "_diffusers_version": DIFFUSERS_VERSION,
        "sample_size": int(sample_size),
        "in_channels": model.in_channels,
        "out_channels": model.in_channels,
        "center_input_sample": False,
        "time_embedding_type": "positional",
        "flip_sin_to_cos": True,  # steadydiff's sinusoid is [cos | sin]
        "freq_shift": 0,  # frequencies 1e4^(-k / half), k = 0..half-1
        "down_block_types": ["AttnDownBlock2D" if lv["attn"] else "DownBlock2D" for lv in levels],
        "mid_block_type": "UNetMidBlock2D",
        "up_block_types": ["AttnUpBlock2D" if lv["attn"] else "UpBlock2D" for lv in reversed(levels)],
        "block_out_channels": [lv["width"] for lv in levels],
        "layers_per_block": model.num_res_blocks,
        "mid_block_scale_factor": 1,
        "downsample_padding": 1,
        "downsample_type": "conv",
        "upsample_type": "conv",
        "dropout": max(dropouts) if dropouts else 0.0,
        "act_fn": "silu",
        "attention_head_dim": head_dim,
        "norm_num_groups": model.norm_group_counts()[0],
        "attn_norm_num_groups": None,
        "norm_eps": next(m for m in model.modules() if isinstance(m, nn.GroupNorm)).eps,
        "resnet_time_scale_shift": "default",  # the embedding is added, not a scale-shift (ADM's use_scale_shift_norm)
        "add_attention": True,
        "class_embed_type": None,
        "num_class_embeds": classes or None,
    }


def _layer_names(model: UNet) -> list[tuple[nn.Module, str]]:
    """Every leaf block of `model` with its diffusers prefix, in an order that covers all of its weights."""
    out: list[tuple[nn.Module, str]] = [
        (model.conv_in, "conv_in"), (model.embed.mlp[0], "time_embedding.linear_1"),
        (model.embed.mlp[2], "time_embedding.linear_2"), (model.out[0], "conv_norm_out"), (model.out[2], "conv_out"),
    ]

    def stage(st: nn.Module, block: str, j: int) -> None:
        for layer in st:
            if isinstance(layer, ResBlock):
                out.append((layer, f"{block}.resnets.{j}"))
            elif isinstance(layer, Attention):
                out.append((layer, f"{block}.attentions.{j}"))
            elif isinstance(layer, Downsample):
                out.append((layer.conv, f"{block}.downsamplers.0.conv"))
            elif isinstance(layer, Upsample):
                out.append((layer.conv, f"{block}.upsamplers.0.conv"))
            else:  # pragma: no cover - a new layer kind in nn/unet.py needs its line here
                raise TypeError(f"no UNet2DModel name for {type(layer).__name__}")

    down = iter(model.down)
    for level in range(model.levels):
        for j in range(model.num_res_blocks):
            stage(next(down), f"down_blocks.{level}", j)
        if level != model.levels - 1:
            stage(next(down), f"down_blocks.{level}", 0)
    mid = model.mid
    out += [(mid[0], "mid_block.resnets.0"), (mid[1], "mid_block.attentions.0"), (mid[2], "mid_block.resnets.1")]
    up = iter(model.up)
    for i in range(model.levels):
        for j in range(model.num_res_blocks + 1):
            stage(next(up), f"up_blocks.{i}", j)
    return out


def _linear(conv: nn.Conv2d) -> tuple[Tensor, Tensor]:
    """A 1x1 conv's weight as a Linear's (out, in)."""
    return conv.weight[:, :, 0, 0], conv.bias


def unet2d_state_dict(model: UNet, *, null_class: bool = False) -> dict[str, Tensor]:
    """`model`'s weights under UNet2DModel's names (contiguous copies), for `unet2d_config(model, ...)`."""
    reason = unet2d_refusal(model)
    if reason:
        raise ExportError(f"cannot write this model as a UNet2DModel: {reason}")
    sd: dict[str, Tensor] = {}

    def put(prefix: str, weight: Tensor, bias: Tensor | None) -> None:
        sd[f"{prefix}.weight"] = weight
        if bias is not None:
            sd[f"{prefix}.bias"] = bias

    for layer, name in _layer_names(model):
        if isinstance(layer, ResBlock):
            for ours, theirs in (("norm1", "norm1"), ("conv1", "conv1"), ("emb", "time_emb_proj"),
                                 ("norm2", "norm2"), ("conv2", "conv2")):
                sub = getattr(layer, ours)
                put(f"{name}.{theirs}", sub.weight, sub.bias)
            if isinstance(layer.shortcut, nn.Conv2d):
                put(f"{name}.conv_shortcut", layer.shortcut.weight, layer.shortcut.bias)
        elif isinstance(layer, Attention):
            put(f"{name}.group_norm", layer.norm.weight, layer.norm.bias)
            w, b = _linear(layer.qkv)
            # qkv's outputs are [q | k | v], each ordered (head, channel within head): the order of to_q/k/v's rows
            for part, (wp, bp) in zip(("to_q", "to_k", "to_v"), zip(w.chunk(3), b.chunk(3))):
                put(f"{name}.{part}", wp, bp)
            put(f"{name}.to_out.0", *_linear(layer.proj))
        else:
            put(name, layer.weight, layer.bias)
    if model.embed.label is not None:
        table = model.embed.label.weight
        if null_class:  # steadydiff's null label embeds to zero (nn/layers.py): the extra last class
            table = torch.cat([table, torch.zeros_like(table[:1])])
        sd["class_embedding.weight"] = table
    n_ours = len(model.state_dict())  # constant skip scalings hold no tensors; LS gates were refused above
    if len(sd) != n_ours + 4 * sum(isinstance(m, Attention) for m in model.modules()):  # qkv: 2 -> 6 tensors
        raise AssertionError(f"UNet2DModel mapping covers {len(sd)} tensors for {n_ours} of steadydiff's")
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in sd.items()}


def ddpm_scheduler_config(betas: list[float], *, clip_sample: bool) -> dict[str, Any]:
    """The `DDPMScheduler` config (`scheduler/scheduler_config.json`) that carries a discrete schedule as its
    `trained_betas` for an eps-predicting network (steadydiff's VP). DDIMScheduler.from_config reads the same file:

    - `timestep_spacing="trailing"`: N steps visit 999, 999 - 1000/N, ..., 1000/N - 1 and each step goes to the
      next of them, the last to alpha = 1 (it returns x0_hat at its last timestep). "leading" would never visit 999
      (t = 1, where steadydiff's samplers start) and "linspace" steps to t - 1000 // N, off its own grid.
    - `steps_offset=0`: the grid starts at 999 itself.
    - `clip_sample`: x0_hat clipped to [-1, 1] (steadydiff's default for images); pass
      `use_clipped_model_output=True` to DDIM to also take the noise consistent with the clipped x0_hat, as
      steadydiff's clipped samplers do.
    - DDIM's `set_alpha_to_one` (not a DDPMScheduler key, so not written: its default is kept) does not matter:
      alphas_cumprod[0] = alpha(0)^2 = 1 already.
    """
    return {
        "_class_name": "DDPMScheduler",
        "_diffusers_version": DIFFUSERS_VERSION,
        "num_train_timesteps": len(betas),
        "trained_betas": [float(b) for b in betas],
        "beta_schedule": "linear",  # ignored: trained_betas wins; beta_start/end state the range
        "beta_start": float(betas[1]),
        "beta_end": float(betas[-1]),
        "prediction_type": "epsilon",
        "variance_type": "fixed_small",
        "clip_sample": bool(clip_sample),
        "clip_sample_range": 1.0,
        "thresholding": False,
        "timestep_spacing": "trailing",
        "steps_offset": 0,
        "rescale_betas_zero_snr": False,
    }


def ddpm_pipeline_index() -> dict[str, Any]:
    """`model_index.json` of a DDPMPipeline folder holding `unet/` and `scheduler/`."""
    return {"_class_name": "DDPMPipeline", "_diffusers_version": DIFFUSERS_VERSION,
            "scheduler": ["diffusers", "DDPMScheduler"], "unet": ["diffusers", "UNet2DModel"]}
