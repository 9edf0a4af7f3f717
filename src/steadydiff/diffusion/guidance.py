"""Guidance for every sampler of both formulations: classifier-free guidance (Ho & Salimans 2022) and
autoguidance (Karras et al. 2024, "Guiding a Diffusion Model with a Bad Version of Itself").

Both mix two predictions of the model that a sampler calls (VP: the network's noise prediction eps; EDM: the
preconditioned denoiser D), at the same input:

    out_w(x; sigma, c) = out_guide + w (out_main - out_guide)        (Ho & Salimans eq. 6; Karras et al. eq. 1)

- classifier-free guidance: out_main = the model with label c, out_guide = the same model with the null
  label (`nn.NULL_LABEL`, trained by `model.label_dropout`);
- autoguidance: out_guide = a weaker model of the same task (smaller, or trained for less) with the same c.

eps, the denoised estimate and D are affine in the model output with coefficients that depend on (x, sigma)
only, so mixing outputs with weights that sum to one is mixing denoisers: one wrapper serves every sampler.
w = 1 returns out_main itself (the conditional sampler, bit for bit) and w = 0 out_guide itself.

Guidance interval (Kynkaenniemi et al. 2024): with `interval=(lo, hi)` guidance applies only where the noise
level sigma (EDM's sigma; for VP, sigma(t) / alpha(t), the same noise-to-signal ratio) is in [lo, hi], and the
sampler sees out_main elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..nn import NULL_LABEL
from ..utils.errors import ConfigError


class Guided(nn.Module):
    """`main` guided with weight `weight`, called like `main`: `(x, noise_input, labels)`.

    guide: None for classifier-free guidance (`main` with the null label), else the autoguidance model.
    interval: (lo, hi) in sigma, with `sigma_of` mapping the model's noise input to sigma (the formulation's
    `sigma_of_input`); None guides at every level.
    """

    def __init__(self, main: nn.Module, weight: float, guide: nn.Module | None = None,
                 interval: tuple[float, float] | None = None,
                 sigma_of: Callable[[Tensor], Tensor] | None = None):
        super().__init__()
        if interval is not None and (sigma_of is None or not 0 <= interval[0] <= interval[1]):
            raise ValueError(f"guidance interval must be 0 <= lo <= hi with a sigma_of map, got {interval}")
        self.main, self.guide, self.weight = main, guide, float(weight)
        self.interval, self.sigma_of = interval, sigma_of

    def _guide_out(self, x: Tensor, noise: Tensor, labels: Tensor | None) -> Tensor:
        if self.guide is not None:
            return self.guide(x, noise, labels)
        if labels is None:
            raise ValueError("classifier-free guidance needs labels (a class-conditional model)")
        return self.main(x, noise, torch.full_like(labels, NULL_LABEL))

    def forward(self, x: Tensor, noise: Tensor, labels: Tensor | None = None) -> Tensor:
        if self.weight == 1:
            return self.main(x, noise, labels)
        guided = self._guide_out(x, noise, labels)
        out = self.main(x, noise, labels) if (self.weight != 0 or self.interval is not None) else None
        if self.weight != 0:
            guided = guided + self.weight * (out - guided)
        if self.interval is None:
            return guided
        sigma = self.sigma_of(torch.as_tensor(noise, device=x.device)).reshape(-1)
        inside = (sigma >= self.interval[0]) & (sigma <= self.interval[1])
        inside = inside.expand(x.shape[0]) if inside.numel() == 1 else inside
        return torch.where(inside.view(-1, *([1] * (x.dim() - 1))), guided, out)


def guided(model: nn.Module, guide: nn.Module | None, formulation, weight: float,
           interval: tuple[float, float] | None) -> nn.Module:
    """`model` guided with `weight` (by `guide`, or classifier-free when None); `model` itself at w = 1 unguided."""
    if weight == 1 and guide is None:
        return model
    return Guided(model, weight, guide=guide, interval=interval, sigma_of=formulation.sigma_of_input)


def parse_guidance_weights(text: str) -> list[float]:
    """--guidance: one weight, or a comma-separated sweep; each >= 0 (1: no guidance, 0: the guide alone)."""
    try:
        ws = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--guidance {text}: give numbers, e.g. --guidance 2 or --guidance 1,1.5,2,3") from None
    if not ws or any(not w >= 0 for w in ws):
        raise ConfigError(f"--guidance {text}: weights must be >= 0 (1 = no guidance), e.g. --guidance 1,1.5,2,3")
    return ws


def parse_guidance_interval(text: str | None) -> tuple[float, float] | None:
    """--guidance-interval LO,HI: the sigma range guidance applies in (Kynkaenniemi et al. 2024); None: all."""
    if text is None:
        return None
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"--guidance-interval {text}: give two noise levels LO,HI, e.g. 0.28,2.9") from None
    if not 0 <= lo <= hi:
        raise ConfigError(f"--guidance-interval {text}: need 0 <= LO <= HI (sigma), e.g. 0.28,2.9")
    return lo, hi


def check_guidance(run: Any, weights: list[float], class_label: int | None, guide: Any = None,
                   guide_name: str = "") -> None:
    """That `run` (a loaded model: `.cfg`, `.sample_shape`) can draw class `class_label` with these guidance
    weights, and that `guide` (a loaded model, or None for classifier-free guidance), named `guide_name` on
    the command line, can guide it. One-line ConfigErrors naming the fix."""
    classes = run.cfg.model.num_classes
    if class_label is not None and not 0 <= class_label < max(classes, 1):
        raise ConfigError(f"--class {class_label}: " + (
            f"this model has classes 0..{classes - 1}" if classes else
            "this model is unconditional (model.num_classes=0); drop --class"))
    if guide is None:
        if any(w != 1 for w in weights) and not (classes and run.cfg.model.label_dropout > 0):
            raise ConfigError("--guidance needs a class-conditional model trained with label dropout "
                              "(model.num_classes > 0 and model.label_dropout > 0, e.g. 0.1); or guide with a weaker "
                              "model: --guide RUN")
        return
    # An unconditional guide (num_classes 0) is EDM2's classifier-free guidance; a conditional one, autoguidance.
    for what, a, b in (("diffusion settings", run.cfg.diffusion, guide.cfg.diffusion),
                       ("sample shape", run.sample_shape, guide.sample_shape),
                       ("model.num_classes", classes, guide.cfg.model.num_classes or classes)):
        if a != b:
            raise ConfigError(f"--guide {guide_name}: its {what} ({b}) differ from the run's ({a}); autoguidance "
                              "needs a weaker model of the same task (same data, formulation and classes)")
