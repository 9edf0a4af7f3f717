"""The continuous variance-preserving SDE (Song et al. 2021, "Score-Based Generative Modeling through SDEs").

Forward SDE (Song et al. 2021, eq. 11), on t in [0, 1]:

    dx = -1/2 beta(t) x dt + sqrt(beta(t)) dw,        beta(t) = beta_min + t (beta_max - beta_min).

Its perturbation kernel is Gaussian, q(x_t | x_0) = N(alpha(t) x_0, sigma(t)^2 I), with (Song et al. 2021,
eq. 29)

    log alpha(t) = -1/2 int_0^t beta(s) ds = -t^2 (beta_max - beta_min) / 4 - t beta_min / 2,
    sigma(t)^2   = 1 - alpha(t)^2 = -expm1(2 log alpha(t))      (expm1: no cancellation at small t),
    lambda(t)    = log(alpha / sigma)                            (half log-SNR; Lu et al. 2022, DPM-Solver).

This is the parameterisation U-ViT and ScaleLong train with: t ~ U(t_eps, 1), the network predicts the noise
eps and sees the time as 999 t.

`prediction: v` (Salimans & Ho 2022, "Progressive Distillation", Sec. 4 and App. D) trains the network on
v = alpha eps - sigma x0 instead. With alpha^2 + sigma^2 = 1 the conversions at x_t = alpha x0 + sigma eps are

    eps = sigma x_t + alpha v,    x0 = alpha x_t - sigma v,    v = (eps - sigma x_t) / alpha;

`eps` converts the network output, so every sampler, the clipping and guidance (mixing with weights that sum
to one commutes with this affine map) work unchanged. The v-MSE is the eps-MSE divided by alpha^2, i.e. the
eps-MSE weighted by (SNR + 1) / SNR with SNR = alpha^2 / sigma^2.

`weighting: min_snr` (Hang et al. 2023, "Efficient Diffusion Training via Min-SNR Weighting Strategy", arXiv
2303.09556): the x0-space weight min(SNR, gamma) (gamma = `min_snr_gamma`, 5 in the paper), carried to the
target the network is trained on. x0_hat - x0 = -(sigma / alpha)(eps_hat - eps) = -sigma (v_hat - v), so the
x0-MSE is the eps-MSE / SNR and the v-MSE / (SNR + 1), and per sample the loss is

    eps: min(SNR, gamma) / SNR       x eps-MSE,
    v:   min(SNR, gamma) / (SNR + 1) x v-MSE,

both equal to min(SNR, gamma) x x0-MSE: the paper's eps weight, and for v the weight of the authors' code
(TiankaiHang/Min-SNR-Diffusion-Training, `compute_mse_loss_weight`, VELOCITY). The validation loss
(`base_loss`) stays the plain eps-MSE whatever the prediction and the weighting: the fixed yardstick.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..config import PREDICTIONS, DiffusionConfig
from ..utils.errors import ConfigError
from ..utils.rng import draw_normal, draw_uniform
from .samplers import EVALUATIONS, SAMPLERS, clip_denoised

__all__ = ["VPSDE", "draw_normal", "draw_uniform"]

Model = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]

# diffusion.weighting (vp): the per-sample loss weights (None: the plain MSE), from SNR = alpha^2 / sigma^2 in
# float64, gamma and the prediction (see the module docstring).
WEIGHTINGS = {
    "none": None,
    "min_snr": lambda snr, gamma, prediction: torch.clamp(snr, max=gamma) / (snr + 1 if prediction == "v" else snr),
}


def _wide(t: Tensor) -> tuple[Tensor, torch.dtype]:
    """`t` in float64 (float32 if the device lacks float64) for time arithmetic, and the dtype to return."""
    t = torch.as_tensor(t)
    out_dtype = t.dtype if t.is_floating_point() else torch.get_default_dtype()
    work = torch.float32 if t.device.type == "mps" else torch.float64
    return t.to(work), out_dtype


def _per_sample(v: Tensor, like: Tensor) -> Tensor:
    """A (B,) (or scalar) coefficient viewed as (B, 1, ..., 1) to broadcast against `like`, shape (B, ...)."""
    v = v.to(dtype=like.dtype, device=like.device)
    if v.dim() == 0:
        return v
    return v.reshape(v.shape[0], *([1] * (like.dim() - 1)))


class VPSDE:
    """The VP-SDE with linear beta(t). Time-arithmetic is done in float64 and returned in the input dtype."""

    T: float = 1.0
    time_scale: float = 999.0  # the network sees 999 t (U-ViT convention)
    kind = "vp"
    samplers = SAMPLERS
    evaluations = EVALUATIONS  # network evaluations per sample of each sampler at `steps` steps
    ode_sampler = "ddim"  # deterministic and first order: what consistency checks sample with

    def __init__(self, beta_min: float = 0.1, beta_max: float = 20.0, t_eps: float = 1e-5, prediction: str = "eps",
                 weighting: str = "none", min_snr_gamma: float = 5.0):
        if beta_min < 0 or beta_max < beta_min:
            raise ConfigError(f"diffusion: the VP-SDE needs 0 <= beta_min <= beta_max, got beta_min={beta_min}, "
                              f"beta_max={beta_max}")
        if beta_max <= 0:
            raise ConfigError(f"diffusion.beta_max: the VP-SDE needs beta_max > 0, got {beta_max}")
        if not 0 < t_eps < 1:
            raise ConfigError(f"diffusion.t_eps: must be in (0, 1), got {t_eps}")
        if prediction not in PREDICTIONS["vp"] or weighting not in WEIGHTINGS or not min_snr_gamma > 0:
            raise ConfigError(f"diffusion: the VP-SDE takes prediction {' | '.join(PREDICTIONS['vp'])}, weighting "
                              f"{' | '.join(WEIGHTINGS)} and min_snr_gamma > 0, got {prediction}, {weighting}, "
                              f"{min_snr_gamma}")
        self.beta_min = float(beta_min)
        self.beta_max = float(beta_max)
        self.t_eps = float(t_eps)
        self.prediction, self.weighting, self.min_snr_gamma = prediction, weighting, float(min_snr_gamma)

    @classmethod
    def from_config(cls, cfg: DiffusionConfig) -> VPSDE:
        if cfg.kind != "vp":
            raise ValueError(f"VPSDE.from_config needs diffusion.kind=vp, got {cfg.kind!r}")
        return cls(beta_min=cfg.beta_min, beta_max=cfg.beta_max, t_eps=cfg.t_eps,
                   prediction=cfg.prediction or PREDICTIONS["vp"][0], weighting=cfg.weighting,
                   min_snr_gamma=cfg.min_snr_gamma)

    def __repr__(self) -> str:
        extra = "" if self.prediction == "eps" else f", prediction={self.prediction}"
        extra += "" if self.weighting == "none" else f", weighting={self.weighting}, gamma={self.min_snr_gamma}"
        return f"VPSDE(beta_min={self.beta_min}, beta_max={self.beta_max}, t_eps={self.t_eps}{extra})"

    def level_range(self) -> tuple[float, float]:
        """The closed range of the normalised level s = t: [t_eps, 1]."""
        return self.t_eps, self.T

    # --- schedule -----------------------------------------------------------------------------------------

    def beta(self, t: Tensor) -> Tensor:
        """beta(t) = beta_min + t (beta_max - beta_min)."""
        tw, dt = _wide(t)
        return (self.beta_min + tw * (self.beta_max - self.beta_min)).to(dt)

    def _log_alpha(self, tw: Tensor) -> Tensor:
        # log alpha(t) = -1/2 int_0^t beta = -t^2 (beta_max - beta_min)/4 - t beta_min/2  (Song et al. 2021)
        return -0.25 * tw * tw * (self.beta_max - self.beta_min) - 0.5 * tw * self.beta_min

    def alpha_sigma(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """(alpha(t), sigma(t)) with sigma = sqrt(1 - alpha^2) = sqrt(-expm1(2 log alpha))."""
        tw, dt = _wide(t)
        log_a = self._log_alpha(tw)
        sigma = torch.sqrt(-torch.expm1(2.0 * log_a))
        return torch.exp(log_a).to(dt), sigma.to(dt)

    def log_snr(self, t: Tensor) -> Tensor:
        """lambda(t) = log(alpha / sigma) = log alpha - 1/2 log(-expm1(2 log alpha)); decreasing in t."""
        tw, dt = _wide(t)
        log_a = self._log_alpha(tw)
        return (log_a - 0.5 * torch.log(-torch.expm1(2.0 * log_a))).to(dt)

    def t_from_log_snr(self, lam: Tensor) -> Tensor:
        """Inverse of `log_snr`, closed form.

        alpha^2 = e^{2 lambda} / (1 + e^{2 lambda}), so c := -2 log alpha = log(1 + e^{-2 lambda}) (a
        softplus, evaluated stably). Then (beta_max - beta_min)/2 t^2 + beta_min t - c = 0, whose positive
        root is written t = 2c / (beta_min + sqrt(beta_min^2 + 2 (beta_max - beta_min) c)): no cancellation
        at small c, and valid for constant beta.
        """
        lw, dt = _wide(lam)
        x = -2.0 * lw
        c = torch.clamp(x, min=0.0) + torch.log1p(torch.exp(-torch.abs(x)))
        d = self.beta_max - self.beta_min
        t = 2.0 * c / (self.beta_min + torch.sqrt(self.beta_min**2 + 2.0 * d * c))
        return t.to(dt)

    def discrete_schedule(self) -> tuple[Tensor, Tensor]:
        """(betas, alphas_cumprod), float64, at the 1000 discrete times the network saw: DDPM timestep n = 0..999
        is model time n = 999 t, i.e. t = n / 999, and alphas_cumprod[n] = alpha(n / 999)^2 exactly.

        betas[n] = 1 - alphas_cumprod[n] / alphas_cumprod[n-1] (betas[0] = 1 - alphas_cumprod[0] = 0, as alpha(0)
        = 1), so a DDPM-style scheduler's cumprod(1 - betas) gives the same alphas_cumprod back. Computed from
        log alpha differences with expm1, so the small betas near n = 0 (~1e-4) keep their digits.
        """
        n = int(round(self.time_scale)) + 1
        log_a = self._log_alpha(torch.arange(n, dtype=torch.float64) / self.time_scale)
        prev = torch.cat([torch.zeros(1, dtype=torch.float64), log_a[:-1]])
        betas = -torch.expm1(2.0 * (log_a - prev))
        return betas, torch.exp(2.0 * log_a)

    # --- training -----------------------------------------------------------------------------------------

    def perturb(self, x0: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """x_t = alpha(t) x0 + sigma(t) noise, t of shape (B,) broadcast over the non-batch dims of x0."""
        alpha, sigma = self.alpha_sigma(t)
        return _per_sample(alpha, x0) * x0 + _per_sample(sigma, x0) * noise

    def sample_t(
        self, batch: int, generator: torch.Generator | None = None, device: torch.device | str | None = None
    ) -> Tensor:
        """t ~ U(t_eps, 1), shape (batch,), float32."""
        u = draw_uniform((batch,), generator, device)
        return self.t_eps + (self.T - self.t_eps) * u

    def model_time(self, t: Tensor) -> Tensor:
        """The time the network sees: 999 t."""
        return self.time_scale * t

    def sigma_of_input(self, model_time: Tensor) -> Tensor:
        """The noise-to-signal ratio sigma(t) / alpha(t) at the network's time input 999 t (the EDM sigma of
        x_t / alpha(t) = x0 + sigma / alpha eps): the level a guidance interval is given in."""
        alpha, sigma = self.alpha_sigma(torch.as_tensor(model_time) / self.time_scale)
        return sigma / alpha

    def wrap(self, net: nn.Module) -> nn.Module:
        """The trained module: the backbone itself (it predicts eps directly)."""
        return net

    def generate(self, model: Model, x_T: Tensor, sampler: str, steps: int, labels: Tensor | None = None,
                 generator: torch.Generator | None = None, clip: bool = False) -> Tensor:
        """Samples from x_T ~ N(0, I) with one of `samplers`; `clip` keeps x0_hat in [-1, 1] (images)."""
        run = self.samplers.choose(sampler)

        def eps_fn(x: Tensor, t: Tensor) -> Tensor:
            return self.eps(model, x, t, labels)

        return run(clip_denoised(eps_fn, self, 1.0) if clip else eps_fn, self, x_T, steps, generator)

    def eps(self, model: Model, x: Tensor, t: Tensor, labels: Tensor | None = None) -> Tensor:
        """The noise prediction eps_hat(x, t) from the network's output model(x, 999 t, labels): that output
        itself, or eps = sigma x + alpha v for `prediction: v`."""
        out = model(x, self.model_time(t), labels)
        if self.prediction == "eps":
            return out
        alpha, sigma = self.alpha_sigma(t)
        return _per_sample(sigma, x) * x + _per_sample(alpha, out) * out

    def _draws(self, x0: Tensor, t: Tensor | None, noise: Tensor | None,
               generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """t and noise, each drawn from `generator` when missing: t first, then noise, both on x0.device."""
        if t is None:
            t = self.sample_t(x0.shape[0], generator, x0.device)
            if x0.dtype == torch.float64:
                t = t.to(torch.float64)
        if noise is None:
            noise = draw_normal(x0.shape, generator, x0.device, dtype=x0.dtype)
        return t, noise

    def snr(self, t: Tensor) -> Tensor:
        """SNR(t) = alpha^2 / sigma^2 = exp(2 lambda(t)), in float64 (float32 on MPS)."""
        tw, _ = _wide(t)
        return torch.exp(2.0 * self.log_snr(tw))

    def loss(
        self,
        model: Model,
        x0: Tensor,
        labels: Tensor | None = None,
        *,
        t: Tensor | None = None,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Per-sample training loss, shape (B,): the MSE of the network's prediction over the non-batch dims,
        times the weighting's per-sample weight.

        eps-prediction, no weighting: mean of (eps_hat(alpha x0 + sigma noise, t) - noise)^2 (Ho et al. 2020,
        eq. 14; Song et al. 2021, eq. 7 with the sigma^2 weighting). v-prediction: mean of (v_hat - (alpha noise
        - sigma x0))^2 (Salimans & Ho 2022). min_snr: see the module docstring. Missing t and noise are drawn
        from `generator`, t first, then noise, both placed on x0.device.
        """
        t, noise = self._draws(x0, t, noise, generator)
        if self.prediction == "eps" and self.weighting == "none":
            return self._eps_mse(model, x0, labels, t, noise)
        xt = self.perturb(x0, t, noise)
        out = model(xt, self.model_time(t), labels)
        if self.prediction == "eps":
            target = noise
        else:
            alpha, sigma = self.alpha_sigma(t)
            target = _per_sample(alpha, x0) * noise - _per_sample(sigma, x0) * x0
        err = (out - target).to(torch.promote_types(out.dtype, torch.float32))
        mse = err.square().reshape(x0.shape[0], -1).mean(dim=1)
        weight = WEIGHTINGS[self.weighting]
        if weight is None:
            return mse
        return mse * weight(self.snr(t), self.min_snr_gamma, self.prediction).to(device=mse.device, dtype=mse.dtype)

    def _eps_mse(self, model: Model, x0: Tensor, labels: Tensor | None, t: Tensor, noise: Tensor) -> Tensor:
        xt = self.perturb(x0, t, noise)
        eps_hat = self.eps(model, xt, t, labels)
        err = (eps_hat - noise).to(torch.promote_types(eps_hat.dtype, torch.float32))
        return err.square().reshape(x0.shape[0], -1).mean(dim=1)

    def base_loss(self, model: Model, x0: Tensor, labels: Tensor | None, t: Tensor, noise: Tensor) -> Tensor:
        """Per-sample loss under the formulation's base weighting, shape (B,), at given t and noise.

        For VP this is the plain eps-MSE, mean over the non-batch dims of (eps_hat(alpha x0 + sigma noise, t) -
        noise)^2, with a v-prediction converted to eps_hat = sigma x_t + alpha v_hat first: `loss` itself for
        eps-prediction without a weighting. It is what a validation loss measures: neither the min-SNR weights
        nor a timestep sampler's weights (CLTS) enter it.
        """
        return self._eps_mse(model, x0, labels, t, noise)

    def prior(
        self,
        shape: tuple[int, ...] | torch.Size,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """x_T ~ N(0, I) (alpha(1) ~ 7e-3 for the default schedule, so this is the marginal to ~1e-4)."""
        return draw_normal(shape, generator, device)
