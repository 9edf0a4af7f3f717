"""Noise-level samplers: which normalised noise level s in (0, 1) each training example gets.

Every formulation works in s (see diffusion/edm.py, diffusion/flow.py): for VP s = t, for EDM s is the
quantile of sigma under the base log-normal, for flow the quantile of t under its training draw (uniform or
logit-normal, shifted). The formulation's own distribution is therefore uniform in s: `base` is uniform t for
VP, log-normal sigma for EDM and flow's `diffusion.t_sampling`.

CLTS (Xu et al., arXiv 2404.07946; reconstruction in shared/papers/clts-mdlrc-notes.md §1.3):
    p_k(s) = (1 - lambda_k) base(s) + lambda_k G(s; mu, sigma),   lambda_k = min(1, k / K_c),
with G a Gaussian on s normalised on a grid of `bins` cells. mu = 0.3 is the paper's best value; sigma is
NOT known from the paper (0.2 is our default; SpeeD's baseline implies 1.0) - sweep it. With
`importance=True` each example's loss is multiplied by base(s) / p_k(s), which keeps the expected loss
equal to the base one (off by default, as in the paper).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..utils.registry import Registry


class BaseTimesteps:
    """The formulation's own draw (`formulation.sample_t`): uniform t (VP), log-normal sigma (EDM), flow's
    uniform or logit-normal t."""

    name = "base"
    horizon = None  # the same draw at every step

    def __init__(self, formulation):
        self.formulation = formulation

    def sample(self, batch: int, step: int, generator: torch.Generator | None, device) -> Tensor:
        return self.formulation.sample_t(batch, generator, device)

    def weights(self, s: Tensor, step: int) -> Tensor | None:
        return None


class CLTSTimesteps:
    name = "clts"
    horizon_key = "train.clts_steps"  # see schedules.py for the horizon fields
    horizon_name = "CLTS curriculum length train.clts_steps"

    def __init__(self, mu: float = 0.3, sigma: float = 0.2, curriculum_steps: int = 1, bins: int = 1000,
                 importance: bool = False, eps: float = 1e-5):
        self.eps = eps  # keep s inside the formulation's open range
        self.mu, self.sigma, self.bins, self.importance = mu, sigma, bins, importance
        self.curriculum_steps = max(1, curriculum_steps)
        centres = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
        g = torch.exp(-((centres - mu) ** 2) / (2 * sigma**2))
        self.gaussian = g / g.sum()  # G normalised on the grid

    @property
    def horizon(self) -> int:
        """K_c, where lambda_k reaches 1 and the curriculum ends."""
        return self.curriculum_steps

    def lam(self, step: int) -> float:
        return min(1.0, step / self.curriculum_steps)

    def probs(self, step: int) -> Tensor:
        """p_k over the `bins` equal cells of [0, 1] (float64, sums to 1)."""
        lam = self.lam(step)
        return (1 - lam) / self.bins + lam * self.gaussian

    def sample(self, batch: int, step: int, generator: torch.Generator | None, device) -> Tensor:
        gdev = generator.device if generator is not None else None
        cell = torch.multinomial(self.probs(step).to(gdev), batch, replacement=True, generator=generator)
        within = torch.rand(batch, generator=generator, device=gdev, dtype=torch.float64)
        s = (cell.to(torch.float64) + within) / self.bins  # uniform inside the chosen cell
        return s.clamp(self.eps, 1 - self.eps).to(torch.float32).to(device)

    def weights(self, s: Tensor, step: int) -> Tensor | None:
        if not self.importance:
            return None
        cell = (s.double() * self.bins).long().clamp(0, self.bins - 1).cpu()
        return ((1.0 / self.bins) / self.probs(step)[cell]).to(s.device, torch.float32)


# train.timesteps -> the noise-level sampler, built from a TrainConfig and the formulation. CLTS's horizon
# K_c defaults to train.steps.
TIMESTEP_SAMPLERS = Registry("timestep sampler", key="train.timesteps")
TIMESTEP_SAMPLERS.add("base", lambda t, formulation: BaseTimesteps(formulation))
TIMESTEP_SAMPLERS.add("clts", lambda t, formulation: CLTSTimesteps(
    t.clts_mu, t.clts_sigma, t.clts_steps or t.steps, importance=t.clts_importance, eps=formulation.t_eps))


def build_timesteps(cfg, formulation) -> BaseTimesteps | CLTSTimesteps:
    """From a Config: the sampler train.timesteps names (TIMESTEP_SAMPLERS)."""
    return TIMESTEP_SAMPLERS.choose(cfg.train.timesteps)(cfg.train, formulation)


def level_histogram(levels: list[Tensor], bins: int = 10) -> list[int]:
    """Counts of sampled noise levels in `bins` equal cells of [0, 1] (for metrics.jsonl)."""
    if not levels:
        return [0] * bins
    s = torch.cat([x.detach().float().cpu() for x in levels])
    return torch.histc(s, bins=bins, min=0.0, max=1.0).long().tolist()


__all__ = ["BaseTimesteps", "CLTSTimesteps", "build_timesteps", "level_histogram"]
