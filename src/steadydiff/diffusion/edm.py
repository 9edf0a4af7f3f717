"""The EDM formulation (Karras et al. 2022) with EDM2's learned loss weighting (Karras et al. 2024).

Preconditioning (EDM Eqs. 7-8, sigma_data = 0.5):
    D(x; sigma) = c_skip x + c_out F(c_in x; c_noise)
    c_skip = sd^2 / (sigma^2 + sd^2), c_out = sigma sd / sqrt(sigma^2 + sd^2),
    c_in = 1 / sqrt(sigma^2 + sd^2), c_noise = ln(sigma) / 4.
Training noise levels: ln sigma ~ N(P_mean, P_std^2). Loss (EDM2 Eq. 21):
    L = E[ lambda(sigma) / e^{u(sigma)} ||D(x0 + sigma n; sigma) - x0||^2 + u(sigma) ],
    lambda(sigma) = (sigma^2 + sd^2) / (sigma sd)^2,
so that lambda L(D; sigma) = 1 for every sigma at init (F = 0), and the learned log-variance u(sigma)
divides each noise level's gradient by its own current loss level (optimum e^u = lambda L).

Normalised noise level s in (0, 1): the quantile of sigma under the base log-normal,
sigma(s) = exp(P_mean + P_std Phi^{-1}(s)). Samplers, probes and timestep curricula work in s, so the VP
and EDM formulations share one interface (`loss(model, x0, labels, t=s, noise=...)`,
`perturb(x0, s, noise)`, `model_time(s)`; the EDM "model" is `EDMPrecond`, called with sigma).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..nn.mp import MPConv, MPFourier
from ..utils.registry import Registry
from ..utils.rng import draw_normal, draw_uniform

DenoiseFn = Callable[[Tensor, Tensor], Tensor]  # D(x, sigma) with sigma of shape (B,)

# A backbone's declared `time_input` convention -> the factor on c_noise = ln(sigma) / 4 (EDM Eq. 7 / Table 1)
# that it is fed. c_noise spans ~[-1.6, 1.1] over sigma in [0.002, 80]: as is for EDM2's MP-Fourier embedding;
# x 250 for sinusoidal embeddings designed for VP's model time 999 t, so that it spans a comparable range.
TIME_INPUT_SCALES = {"c_noise": 1.0, "vp_time": 250.0}


class LogVarianceHead(nn.Module):
    """u(sigma): MP-Fourier features of c_noise -> MP-Linear(128 -> 1) (EDM2 Sec. 2, "learned uncertainty")."""

    def __init__(self, channels: int = 128):
        super().__init__()
        self.fourier = MPFourier(channels)
        self.linear = MPConv(channels, 1, kernel=())

    def forward(self, c_noise: Tensor) -> Tensor:
        return self.linear(self.fourier(c_noise)).reshape(-1)


class EDMPrecond(nn.Module):
    """Wraps a backbone F into the denoiser D(x; sigma) and holds the learned u(sigma).

    The backbone is called as `net(c_in x, c_noise * noise_scale, labels)`, `noise_scale` set by the time
    input convention the backbone declares (`net.time_input`, a key of TIME_INPUT_SCALES).
    """

    backbone_attr = "net"  # the child holding the backbone (diagnostics group its blocks inside it)

    def __init__(self, net: nn.Module, sigma_data: float = 0.5, learn_uncertainty: bool = True):
        super().__init__()
        self.net = net
        self.sigma_data = sigma_data
        convention = getattr(net, "time_input", None)
        if convention not in TIME_INPUT_SCALES:
            raise TypeError(f"{type(net).__name__} must declare its noise-level input: time_input = one of "
                            f"{', '.join(TIME_INPUT_SCALES)} (nn/skip_scaling.py LongSkips)")
        self.noise_scale = TIME_INPUT_SCALES[convention]
        self.logvar = LogVarianceHead() if learn_uncertainty else None

    @property
    def skip_scaling(self):
        return getattr(self.net, "skip_scaling", None)

    def decoder_blocks(self) -> list[nn.Module]:
        return self.net.decoder_blocks()

    def coefficients(self, sigma: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        sd = self.sigma_data
        c_skip = sd**2 / (sigma**2 + sd**2)
        c_out = sigma * sd / (sigma**2 + sd**2).sqrt()
        c_in = 1 / (sd**2 + sigma**2).sqrt()
        c_noise = sigma.log() / 4
        return c_skip, c_out, c_in, c_noise

    def forward(self, x: Tensor, sigma: Tensor, labels: Tensor | None = None) -> Tensor:
        sigma = sigma.to(torch.float32).reshape(-1)
        shape = (-1,) + (1,) * (x.ndim - 1)
        c_skip, c_out, c_in, c_noise = (c.view(shape) for c in self.coefficients(sigma))
        f = self.net((c_in * x).to(x.dtype), c_noise.reshape(-1) * self.noise_scale, labels)
        return c_skip * x + c_out * f.to(torch.float32)

    def log_variance(self, sigma: Tensor) -> Tensor:
        if self.logvar is None:
            return torch.zeros_like(sigma, dtype=torch.float32)
        return self.logvar(sigma.to(torch.float32).log() / 4)


# EDM samplers: pure functions of one signature `(denoise, x, sigmas, generator=None)` over a denoiser D(x; sigma),
# from x at sigmas[0] down the decreasing grid `sigmas` (ending at 0); the generator feeds stochastic ones.


@torch.no_grad()
def sample_euler(denoise: DenoiseFn, x: Tensor, sigmas: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Euler on the probability-flow ODE dx/dsigma = (x - D(x; sigma)) / sigma (EDM Alg. 1 without the
    second-order correction). Deterministic: `generator` is not used."""
    for s_cur, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        d = (x - denoise(x, torch.full((x.shape[0],), s_cur, device=x.device))) / s_cur
        x = x + (s_next - s_cur) * d
    return x


@torch.no_grad()
def sample_heun(denoise: DenoiseFn, x: Tensor, sigmas: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """EDM Alg. 1 (deterministic, S_churn = 0): Heun's 2nd-order method, Euler on the last step to 0.
    `generator` is not used."""
    b = x.shape[0]
    for s_cur, s_next in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        d = (x - denoise(x, torch.full((b,), s_cur, device=x.device))) / s_cur
        x_next = x + (s_next - s_cur) * d
        if s_next > 0:
            d2 = (x_next - denoise(x_next, torch.full((b,), s_next, device=x.device))) / s_next
            x_next = x + (s_next - s_cur) * 0.5 * (d + d2)
        x = x_next
    return x


EDMSampler = Callable[[DenoiseFn, Tensor, Tensor, "torch.Generator | None"], Tensor]

# The EDM samplers: train.sample_sampler and --sampler under diffusion.kind=edm.
SAMPLERS: Registry[EDMSampler] = Registry("sampler", key="train.sample_sampler", scope=("diffusion.kind", "edm"))
SAMPLERS.add("heun", sample_heun)
SAMPLERS.add("euler", sample_euler)

# Network evaluations per sample at `steps` steps, one entry per SAMPLERS entry (diffusion.network_evaluations):
# heun corrects every step but the last (to sigma = 0).
EVALUATIONS: dict[str, Callable[[int], int]] = {"heun": lambda n: 2 * n - 1, "euler": lambda n: n}


class EDMFormulation:
    """EDM training and sampling over a normalised noise level s (see module docstring)."""

    kind = "edm"
    samplers = SAMPLERS
    evaluations = EVALUATIONS  # network evaluations per sample of each sampler at `steps` steps
    ode_sampler = "euler"  # deterministic and first order: what consistency checks sample with

    def __init__(self, sigma_data: float = 0.5, p_mean: float = -0.8, p_std: float = 1.6,
                 sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0, learn_uncertainty: bool = True,
                 t_eps: float = 1e-5):
        self.sigma_data, self.p_mean, self.p_std = sigma_data, p_mean, p_std
        self.sigma_min, self.sigma_max, self.rho = sigma_min, sigma_max, rho
        self.learn_uncertainty = learn_uncertainty
        self.t_eps = t_eps  # s ~ U(t_eps, 1 - t_eps) keeps Phi^{-1}(s) finite

    @classmethod
    def from_config(cls, cfg) -> EDMFormulation:
        return cls(cfg.sigma_data, cfg.p_mean, cfg.p_std, cfg.sigma_min, cfg.sigma_max, cfg.rho,
                   cfg.learn_uncertainty, cfg.t_eps)

    def level_range(self) -> tuple[float, float]:
        """The closed range of the normalised level s: [t_eps, 1 - t_eps] (Phi^{-1}(s) must stay finite)."""
        return self.t_eps, 1 - self.t_eps

    def sigma_of_input(self, sigma: Tensor) -> Tensor:
        """The sampler calls the denoiser with sigma itself (the level a guidance interval is given in)."""
        return torch.as_tensor(sigma)

    def wrap(self, net: nn.Module) -> EDMPrecond:
        return EDMPrecond(net, self.sigma_data, self.learn_uncertainty)

    # -- normalised level s <-> sigma ----------------------------------------------------------------
    def sigma(self, s: Tensor) -> Tensor:
        """sigma(s) = exp(P_mean + P_std * Phi^{-1}(s)): the s-quantile of the training log-normal."""
        s = s.to(torch.float64).clamp(1e-12, 1 - 1e-12)
        return torch.exp(self.p_mean + self.p_std * math.sqrt(2) * torch.erfinv(2 * s - 1)).to(torch.float32)

    def level(self, sigma: Tensor) -> Tensor:
        """Inverse of `sigma`: s = Phi((ln sigma - P_mean) / P_std)."""
        z = (sigma.to(torch.float64).log() - self.p_mean) / self.p_std
        return (0.5 * (1 + torch.erf(z / math.sqrt(2)))).to(torch.float32)

    def sample_t(self, batch: int, generator=None, device=None) -> Tensor:
        """s ~ U(t_eps, 1 - t_eps), i.e. ln sigma ~ N(P_mean, P_std^2) (truncated at ~4.3 std)."""
        return self.t_eps + (1 - 2 * self.t_eps) * draw_uniform((batch,), generator, device)

    def model_time(self, s: Tensor) -> Tensor:
        return self.sigma(s)

    def perturb(self, x0: Tensor, s: Tensor, noise: Tensor) -> Tensor:
        sigma = self.sigma(s).to(x0.device).view((-1,) + (1,) * (x0.ndim - 1))
        return x0 + sigma.to(x0.dtype) * noise

    def loss_weight(self, sigma: Tensor) -> Tensor:
        return (sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2

    def _denoising_error(self, model: EDMPrecond, x0: Tensor, labels: Tensor | None, t: Tensor,
                         noise: Tensor) -> tuple[Tensor, Tensor]:
        """(sigma(t), mean over elements of (D(x0 + sigma noise; sigma) - x0)^2), both (B,) float32."""
        sigma = self.sigma(t).to(x0.device)
        shape = (-1,) + (1,) * (x0.ndim - 1)
        denoised = model(x0 + sigma.view(shape).to(x0.dtype) * noise, sigma, labels)
        return sigma, (denoised.float() - x0.float()).pow(2).flatten(1).mean(1)

    def loss(self, model: EDMPrecond, x0: Tensor, labels: Tensor | None = None, *, t: Tensor | None = None,
             noise: Tensor | None = None, generator=None) -> Tensor:
        """Per-sample loss (B,): mean over elements of lambda/e^u (D - x0)^2 + u (EDM2 Eq. 21)."""
        if t is None:
            t = self.sample_t(x0.shape[0], generator, x0.device)
        if noise is None:
            noise = draw_normal(x0.shape, generator, x0.device, x0.dtype)
        sigma, err = self._denoising_error(model, x0, labels, t, noise)
        u = model.log_variance(sigma)
        return self.loss_weight(sigma) / u.exp() * err + u

    def base_loss(self, model: EDMPrecond, x0: Tensor, labels: Tensor | None, t: Tensor, noise: Tensor) -> Tensor:
        """Per-sample loss under the base weighting (B,), at given s = t and noise: EDM2 Eq. 21 with u = 0,

            L_base(sigma) = lambda(sigma) mean((D(x0 + sigma n; sigma) - x0)^2),
            lambda(sigma) = (sigma^2 + sd^2) / (sigma sd)^2,

        i.e. EDM's own weighting (EDM Eq. 8 / Table 1), which is 1 at init for every sigma. The learned
        log-variance u(sigma) is ignored (it rescales each level by its own current loss, so it is no fixed
        yardstick), as are any timestep-sampler weights (CLTS). This is what a validation loss measures.
        """
        sigma, err = self._denoising_error(model, x0, labels, t, noise)
        return self.loss_weight(sigma) * err

    # -- sampling ------------------------------------------------------------------------------------
    def sigma_grid(self, steps: int, device=None) -> Tensor:
        """EDM Eq. 5: sigma_i = (s_max^(1/rho) + i/(N-1) (s_min^(1/rho) - s_max^(1/rho)))^rho, then 0."""
        i = torch.arange(steps, dtype=torch.float64)
        inv = 1 / self.rho
        lo, hi = self.sigma_min**inv, self.sigma_max**inv
        grid = (hi + i / max(steps - 1, 1) * (lo - hi)) ** self.rho
        return torch.cat([grid, torch.zeros(1, dtype=torch.float64)]).to(device)

    def generate(self, model: nn.Module, x_T: Tensor, sampler: str, steps: int, labels: Tensor | None = None,
                 generator=None, clip: bool = False) -> Tensor:
        """Samples from x_T ~ N(0, I), scaled to sigma_max, with one of `samplers` on the EDM Eq. 5 grid."""
        run = self.samplers.choose(sampler)

        def denoise(x, sigma):
            d = model(x, sigma, labels)
            return d.clamp(-1, 1) if clip else d

        return run(denoise, x_T * self.sigma_max, self.sigma_grid(steps, x_T.device), generator)
