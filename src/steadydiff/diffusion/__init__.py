"""The continuous VP-SDE (U-ViT / ScaleLong parameterisation) and its samplers."""

from steadydiff.diffusion.edm import EDMFormulation, EDMPrecond, sample_euler, sample_heun
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

FORMULATIONS = {"vp": VPSDE, "edm": EDMFormulation}


def build_formulation(cfg):
    """The formulation object for `diffusion.kind` (vp | edm): it owns the loss, the noise levels,
    the preconditioning wrapper (`wrap`) and sampling (`generate`)."""
    if cfg.kind not in FORMULATIONS:
        raise ValueError(f"unknown diffusion.kind {cfg.kind!r}; choose one of {', '.join(FORMULATIONS)}")
    return FORMULATIONS[cfg.kind].from_config(cfg)


__all__ = [
    "EDMFormulation",
    "EDMPrecond",
    "FORMULATIONS",
    "build_formulation",
    "sample_euler",
    "sample_heun",
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
