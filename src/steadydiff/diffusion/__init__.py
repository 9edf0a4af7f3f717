"""Diffusion formulations (the continuous VP-SDE of U-ViT/ScaleLong, and EDM/EDM2), their samplers, and
`generate`: drawing samples from a trained model.

A formulation owns the loss, the noise levels, the preconditioning wrapper (`wrap`) and its samplers
(`samplers`, `generate`); the trainer and the CLI reach samplers only through it.
"""

from ..utils.errors import ConfigError
from ..utils.rng import draw_normal, draw_uniform
from .edm import EDMFormulation, EDMPrecond, sample_euler, sample_heun
from .generate import generate, generate_chunks, merge_chunks, sample_labels
from .guidance import Guided
from .samplers import (
    SAMPLERS,
    EpsFn,
    clip_denoised,
    sample,
    sample_ddim,
    sample_dpmpp2m,
    sample_em,
    time_grid,
)
from .vp import VPSDE

FORMULATIONS = {"vp": VPSDE, "edm": EDMFormulation}
# Every sampler name of every formulation, in a stable order (the CLI's --sampler choices).
SAMPLER_NAMES = tuple(s for f in FORMULATIONS.values() for s in f.samplers)


def build_formulation(cfg):
    """The formulation object for `diffusion.kind` (vp | edm): it owns the loss, the noise levels,
    the preconditioning wrapper (`wrap`) and sampling (`generate`)."""
    if cfg.kind not in FORMULATIONS:
        raise ConfigError(f"unknown diffusion.kind {cfg.kind!r}; choose one of {', '.join(FORMULATIONS)}")
    return FORMULATIONS[cfg.kind].from_config(cfg)


def check_sampler(kind: str, sampler: str, flag: str = "--sampler") -> None:
    """A ConfigError naming the valid choices when `sampler` is not one of formulation `kind`'s samplers
    (`flag`: the CLI flag or config key that set it)."""
    valid = FORMULATIONS[kind].samplers
    if sampler not in valid:
        given = f"{flag} {sampler}" if flag.startswith("-") else f"{flag}={sampler}"
        raise ConfigError(f"{given} does not apply to diffusion.kind={kind}; choose one of {', '.join(valid)}")


__all__ = [
    "EDMFormulation",
    "EDMPrecond",
    "FORMULATIONS",
    "Guided",
    "SAMPLERS",
    "SAMPLER_NAMES",
    "VPSDE",
    "EpsFn",
    "build_formulation",
    "check_sampler",
    "clip_denoised",
    "draw_normal",
    "draw_uniform",
    "generate",
    "generate_chunks",
    "merge_chunks",
    "sample",
    "sample_ddim",
    "sample_dpmpp2m",
    "sample_em",
    "sample_euler",
    "sample_labels",
    "sample_heun",
    "time_grid",
]
