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

import torch
from torch import Tensor, nn

from ..nn import NULL_LABEL


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
