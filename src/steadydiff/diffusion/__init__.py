"""The continuous VP-SDE (U-ViT / ScaleLong parameterisation) and its samplers."""

from steadydiff.diffusion.samplers import (
    SAMPLERS,
    EpsFn,
    clip_denoised,
    sample,
    sample_ddim,
    sample_dpmpp2m,
    sample_em,
    time_grid,
)
from steadydiff.diffusion.vp import VPSDE, draw_normal, draw_uniform

__all__ = [
    "SAMPLERS",
    "VPSDE",
    "EpsFn",
    "clip_denoised",
    "draw_normal",
    "draw_uniform",
    "sample",
    "sample_ddim",
    "sample_dpmpp2m",
    "sample_em",
    "time_grid",
]
