"""Backbones and building blocks (pure torch.nn)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..config import ModelConfig
from ..utils.errors import ConfigError
from ..utils.registry import Registry
from .edm2_unet import EDM2UNet
from .layers import NULL_LABEL
from .mlp_unet import MLPUNet
from .skip_scaling import (
    SKIP_SCALING_METHODS,
    ChannelGate,
    ConstantScaling,
    LearnedScaling,
    SkipScaling,
    TokenGate,
    cs_coefficients,
    make_skip_scaling,
)
from .unet import UNet
from .uvit import UViT

# model.backbone -> a builder (model config, sample shape) -> backbone. A new backbone is its module (a
# `LongSkips` class: see skip_scaling.py for what it declares) and its builder here.
BACKBONES: Registry[Callable[[ModelConfig, tuple[int, ...]], nn.Module]] = Registry("backbone", key="model.backbone")


@BACKBONES.register("unet")
def _unet(cfg: ModelConfig, sample_shape: tuple[int, ...]) -> nn.Module:
    if len(sample_shape) != 3:
        raise ConfigError(f"model.backbone=unet needs image data (C, H, W), got samples of shape {sample_shape}")
    c, h, w = sample_shape
    if h != w:
        raise ConfigError(f"model.backbone=unet needs square images, got {h}x{w}")
    return UNet(
        in_channels=c, resolution=h, channels=cfg.channels, channel_mult=cfg.channel_mult,
        num_res_blocks=cfg.num_res_blocks, attn_resolutions=cfg.attn_resolutions, num_heads=cfg.num_heads,
        dropout=cfg.dropout, num_classes=cfg.num_classes, grad_checkpointing=cfg.grad_checkpointing,
        norm_groups=cfg.norm_groups,
    )


@BACKBONES.register("uvit")
def _uvit(cfg: ModelConfig, sample_shape: tuple[int, ...]) -> nn.Module:
    if len(sample_shape) != 3 or sample_shape[1] != sample_shape[2]:
        raise ConfigError(f"model.backbone=uvit needs square images (C, H, W), got samples of shape {sample_shape}")
    if sample_shape[1] % cfg.patch_size:
        raise ConfigError(f"image size {sample_shape[1]} is not divisible by model.patch_size={cfg.patch_size}")
    return UViT(
        img_size=sample_shape[1], patch_size=cfg.patch_size, in_chans=sample_shape[0], embed_dim=cfg.embed_dim,
        depth=cfg.depth, num_heads=cfg.num_heads, mlp_ratio=cfg.mlp_ratio, qkv_bias=cfg.qkv_bias,
        mlp_time_embed=cfg.mlp_time_embed, num_classes=cfg.num_classes, conv=cfg.final_conv,
        use_checkpoint=cfg.grad_checkpointing,
    )


@BACKBONES.register("edm2")
def _edm2_unet(cfg: ModelConfig, sample_shape: tuple[int, ...]) -> nn.Module:
    if len(sample_shape) != 3 or sample_shape[1] != sample_shape[2]:
        raise ConfigError(f"model.backbone=edm2 needs square images (C, H, W), got samples of shape {sample_shape}")
    return EDM2UNet(
        img_resolution=sample_shape[1], img_channels=sample_shape[0], label_dim=cfg.num_classes,
        model_channels=cfg.channels, channel_mult=cfg.channel_mult, num_blocks=cfg.num_res_blocks,
        attn_resolutions=cfg.attn_resolutions, channels_per_head=cfg.channels_per_head, dropout=cfg.dropout,
        grad_checkpointing=cfg.grad_checkpointing,
    )


@BACKBONES.register("mlp_unet")
def _mlp_unet(cfg: ModelConfig, sample_shape: tuple[int, ...]) -> nn.Module:
    if len(sample_shape) != 1:
        raise ConfigError(f"model.backbone=mlp_unet needs vector data (D,), got samples of shape {sample_shape}")
    return MLPUNet(dim=sample_shape[0], hidden=cfg.hidden, depth=cfg.depth, dropout=cfg.dropout,
                   num_classes=cfg.num_classes, grad_checkpointing=cfg.grad_checkpointing)



def build_model(cfg: ModelConfig, sample_shape: tuple[int, ...]) -> nn.Module:
    """Backbone from config, with its skip-scaling object attached.

    The scaling object is built after the backbone (so LS gates keep PyTorch's default init, as in the
    official ScaleLong code where `se` is created after the model's init pass).
    """
    model = BACKBONES.choose(cfg.backbone)(cfg, tuple(sample_shape))
    if cfg.norm_groups is not None and not any(isinstance(m, nn.GroupNorm) for m in model.modules()):
        raise ConfigError(f"model.norm_groups sets the GroupNorm groups of the unet backbone; model.backbone="
                          f"{cfg.backbone} has no GroupNorm: remove model.norm_groups")
    gate = getattr(model, "skip_gate", ChannelGate)
    scaling = make_skip_scaling(cfg.skip_scaling, model.skip_channels, cfg.kappa, cfg.ls_reduction, gate)
    model.attach_skip_scaling(scaling)
    return model


__all__ = [
    "NULL_LABEL",
    "BACKBONES", "EDM2UNet", "SKIP_SCALING_METHODS", "ChannelGate", "ConstantScaling", "LearnedScaling", "MLPUNet",
    "SkipScaling", "TokenGate", "UNet", "UViT", "build_model", "cs_coefficients", "make_skip_scaling",
]
