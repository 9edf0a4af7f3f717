"""Diffusion formulations (the continuous VP-SDE of U-ViT/ScaleLong, EDM/EDM2, and flow matching), their
samplers, and `generate`: drawing samples from a trained model.

A formulation owns the loss, the noise levels, the preconditioning wrapper (`wrap`) and its samplers
(`samplers`: its SAMPLERS registry; `generate`); the trainer and the CLI reach samplers only through it.
Each sampler module also declares every sampler's cost, `EVALUATIONS[name](steps)`: the network evaluations
per sample at `steps` steps (the formulation's `evaluations`; `network_evaluations`, `steps_for_nfe`).
"""

from ..utils.errors import ConfigError
from ..utils.registry import Registry
from ..utils.rng import draw_normal, draw_uniform
from .edm import EDMFormulation, EDMPrecond, sample_euler, sample_heun
from .flow import FlowFormulation, FlowModel
from .generate import generate, generate_chunks, merge_chunks, sample_labels
from .guidance import Guided, check_guidance, guided, parse_guidance_interval, parse_guidance_weights
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

# diffusion.kind -> the formulation class (`from_config`, `kind`, `samplers`).
FORMULATIONS = Registry("formulation", key="diffusion.kind")
FORMULATIONS.add("vp", VPSDE)
FORMULATIONS.add("edm", EDMFormulation)
FORMULATIONS.add("flow", FlowFormulation)


def build_formulation(cfg):
    """The formulation object for `diffusion.kind`: it owns the loss, the noise levels, the preconditioning
    wrapper (`wrap`) and sampling (`generate`)."""
    return FORMULATIONS.choose(cfg.kind).from_config(cfg)


def check_sampler(kind: str, sampler: str, flag: str = "--sampler") -> None:
    """A ConfigError naming the valid choices when `sampler` is not one of formulation `kind`'s samplers
    (`flag`: the CLI flag or config key that set it)."""
    FORMULATIONS.choose(kind).samplers.choose(sampler, flag)


def network_evaluations(kind: str, sampler: str, steps: int) -> int:
    """The network evaluations (NFE) per sample of formulation `kind`'s `sampler` at `steps` steps, as the
    sampler module declares it (heun counts its corrector: 2 steps - 1)."""
    f = FORMULATIONS.choose(kind)
    f.samplers.choose(sampler)
    return int(f.evaluations[sampler](int(steps)))


def steps_for_nfe(kind: str, sampler: str, nfe: int, given: str = "train.eval_nfe") -> int:
    """The most steps at which formulation `kind`'s `sampler` makes at most `nfe` network evaluations per
    sample; a one-line ConfigError when even 1 step costs more (`given`: the key or flag that set `nfe`)."""
    best = None
    for steps in range(1, int(nfe) + 1):  # every sampler makes at least one evaluation per step
        if network_evaluations(kind, sampler, steps) <= nfe:
            best = steps
    if best is None:
        raise ConfigError(f"{given}: {kind} sampler {sampler} needs {network_evaluations(kind, sampler, 1)} network "
                          f"evaluations at 1 step, more than the budget {nfe}; raise the budget")
    return best


def sampler_names() -> tuple[str, ...]:
    """Every sampler of every formulation, in registry order (the CLI's --sampler choices)."""
    return tuple(dict.fromkeys(s for f in FORMULATIONS.values() for s in f.samplers))


def sampler_help() -> str:
    """`vp: em | ddim | dpmpp2m; edm: heun | euler; ...`: each formulation's samplers (the CLI's --sampler
    help)."""
    return "; ".join(f"{kind}: {' | '.join(f.samplers)}" for kind, f in FORMULATIONS.items())


__all__ = [
    "EDMFormulation",
    "EDMPrecond",
    "FORMULATIONS",
    "FlowFormulation",
    "FlowModel",
    "Guided",
    "SAMPLERS",
    "VPSDE",
    "EpsFn",
    "build_formulation",
    "check_guidance",
    "check_sampler",
    "clip_denoised",
    "draw_normal",
    "draw_uniform",
    "generate",
    "generate_chunks",
    "guided",
    "merge_chunks",
    "network_evaluations",
    "parse_guidance_interval",
    "parse_guidance_weights",
    "sample",
    "sample_ddim",
    "sample_dpmpp2m",
    "sample_em",
    "sample_euler",
    "sample_labels",
    "sample_heun",
    "sampler_help",
    "sampler_names",
    "steps_for_nfe",
    "time_grid",
]
