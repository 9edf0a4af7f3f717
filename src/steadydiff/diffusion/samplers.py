"""Reverse-time samplers for the VP-SDE, as pure functions over an eps-prediction function, all of one
signature `(eps_fn, sde, x_T, steps, generator=None)` (the generator feeds the stochastic ones: em) and listed
in SAMPLERS, through which `VPSDE.generate` dispatches, the config and CLI validate, and the CLI lists them.

`eps_fn(x, t)` takes the state x of shape (B, ...) and the continuous time t of shape (B,) in (0, 1] (the
same value for the whole batch, in x's dtype) and returns the noise prediction. Wrap a network with
`lambda x, t: sde.eps(model, x, t, labels)`.

Every sampler integrates from t = 1 down to t_end = sde.t_eps on a grid of `steps` + 1 times, then returns the
denoised estimate x0_hat = (x - sigma eps) / alpha at t_end (one extra network evaluation: steps + 1 in all).
The per-step coefficients are computed in float64 as Python scalars, so any state shape and dtype works; the
state itself stays in x_T's dtype.

Grids: EM and DDIM step uniformly in t. DPM-Solver++ steps uniformly in lambda = log(alpha/sigma): it is an
exponential integrator whose Taylor expansion is in lambda, so its local error is governed by the step
h = lambda_i - lambda_{i-1}; uniform h balances the per-step errors (Lu et al. 2022, DPM-Solver, Sec. 3.3).
With a uniform-t grid the last step from t = 1/N to 1e-5 would span several units of lambda (lambda(1e-5) is
about 6.9, while lambda(1) is about -5), and most of the error would sit there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..utils.registry import Registry
from ..utils.rng import draw_normal

if TYPE_CHECKING:  # annotations only: vp.py builds on this module
    from .vp import VPSDE

__all__ = ["EVALUATIONS", "EpsFn", "SAMPLERS", "ddim_on_grid", "sample", "sample_ddim", "sample_dpmpp2m", "sample_em",
           "time_grid"]

EpsFn = Callable[[Tensor, Tensor], Tensor]

_GRID_KINDS = ("uniform", "logsnr")


def time_grid(sde: VPSDE, steps: int, kind: str = "uniform", t_end: float | None = None) -> Tensor:
    """steps + 1 decreasing float64 times from 1 to t_end (default sde.t_eps), uniform in t or in log-SNR."""
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    steps = int(steps)
    t_end = sde.t_eps if t_end is None else float(t_end)
    if not 0 < t_end < 1:
        raise ValueError(f"t_end must be in (0, 1), got {t_end}")
    hi = torch.tensor(sde.T, dtype=torch.float64)
    lo = torch.tensor(t_end, dtype=torch.float64)
    if kind == "uniform":
        ts = torch.linspace(sde.T, t_end, steps + 1, dtype=torch.float64)
    elif kind == "logsnr":
        lams = torch.linspace(float(sde.log_snr(hi)), float(sde.log_snr(lo)), steps + 1, dtype=torch.float64)
        ts = sde.t_from_log_snr(lams)
    else:
        raise ValueError(f"time grid kind {kind!r} is not valid; choose one of {', '.join(_GRID_KINDS)}")
    ts[0], ts[-1] = sde.T, t_end  # exact end points (the log-SNR round trip is only accurate to ~1e-16)
    return ts


def _coeffs(sde: VPSDE, t: float) -> tuple[float, float]:
    alpha, sigma = sde.alpha_sigma(torch.tensor(t, dtype=torch.float64))
    return float(alpha), float(sigma)


def _time_batch(t: float, x: Tensor) -> Tensor:
    """t as a (B,) tensor in x's dtype, but never below float32 (bf16 cannot tell 0.999 from 1)."""
    dtype = torch.promote_types(x.dtype, torch.float32) if x.is_floating_point() else torch.float32
    return torch.full((x.shape[0],), t, dtype=dtype, device=x.device)


def _denoise(eps_fn: EpsFn, sde: VPSDE, x: Tensor, t: float) -> Tensor:
    """x0_hat = (x - sigma(t) eps(x, t)) / alpha(t)  (Tweedie's formula in eps form)."""
    alpha, sigma = _coeffs(sde, t)
    return (x - sigma * eps_fn(x, _time_batch(t, x))) / alpha


def sample_em(
    eps_fn: EpsFn, sde: VPSDE, x_T: Tensor, steps: int, generator: torch.Generator | None = None
) -> Tensor:
    """Euler–Maruyama on the reverse-time SDE (Song et al. 2021, eq. 6), uniform grid in t.

        dx = [f(x, t) - g(t)^2 score(x, t)] dt + g(t) dw_bar,
        f = -beta x / 2,  g^2 = beta,  score = -eps / sigma.

    Stepping from t_i down to t_{i+1} with dt = t_i - t_{i+1} > 0 and z ~ N(0, I):

        x <- x + beta(t_i) (x / 2 - eps / sigma(t_i)) dt + sqrt(beta(t_i) dt) z,

    with no noise on the final step. Returns x0_hat at t_end. First order in dt (weak order 1).
    """
    ts = time_grid(sde, steps, "uniform").tolist()
    with torch.no_grad():
        x = x_T.clone()
        for i in range(steps):
            t, t_next = ts[i], ts[i + 1]
            dt = t - t_next
            _, sigma = _coeffs(sde, t)
            beta = float(sde.beta(torch.tensor(t, dtype=torch.float64)))
            eps = eps_fn(x, _time_batch(t, x))
            x = x + (beta * dt) * (0.5 * x - eps / sigma)
            if i < steps - 1:
                z = draw_normal(x.shape, generator, x.device, dtype=x.dtype)
                x = x + math.sqrt(beta * dt) * z
        return _denoise(eps_fn, sde, x, ts[-1])


def sample_ddim(
    eps_fn: EpsFn, sde: VPSDE, x_T: Tensor, steps: int, generator: torch.Generator | None = None
) -> Tensor:
    """DDIM with eta = 0 (Song, Meng & Ermon 2021, eq. 12 with sigma_t = 0), uniform grid in t.

        x0_hat = (x_t - sigma_t eps_hat) / alpha_t,   x_s = alpha_s x0_hat + sigma_s eps_hat.

    This is the first-order exponential integrator of the probability-flow ODE (Lu et al. 2022, DPM-Solver-1).
    Returns x0_hat at t_end. Deterministic: `generator` is not used.
    """
    return ddim_on_grid(eps_fn, sde, x_T, time_grid(sde, steps, "uniform").tolist())


def ddim_on_grid(eps_fn: EpsFn, sde: VPSDE, x_T: Tensor, ts: list[float]) -> Tensor:
    """The DDIM (eta = 0) steps of `sample_ddim` along the given decreasing times `ts`, then x0_hat at ts[-1]:
    len(ts) network evaluations. `sample_ddim` runs it on its uniform grid; given the times of another
    implementation's grid (diffusers' DDIMScheduler, whose last step lands on alpha = 1, i.e. returns x0_hat at
    its last timestep) it reproduces that sampler step for step."""
    with torch.no_grad():
        x = x_T.clone()
        for i in range(len(ts) - 1):
            t, s = ts[i], ts[i + 1]
            alpha_t, sigma_t = _coeffs(sde, t)
            alpha_s, sigma_s = _coeffs(sde, s)
            eps = eps_fn(x, _time_batch(t, x))
            x0_hat = (x - sigma_t * eps) / alpha_t
            x = alpha_s * x0_hat + sigma_s * eps
        return _denoise(eps_fn, sde, x, ts[-1])


def sample_dpmpp2m(
    eps_fn: EpsFn, sde: VPSDE, x_T: Tensor, steps: int, generator: torch.Generator | None = None
) -> Tensor:
    """DPM-Solver++(2M): multistep second-order, data prediction (Lu et al. 2022, DPM-Solver++, Alg. 2).

    With lambda_i = log(alpha_i / sigma_i), h_i = lambda_i - lambda_{i-1} and the data prediction
    D_i = x0_hat(x_i, t_i), on a grid uniform in lambda:

        step 1 (first order):  x_1 = (sigma_1 / sigma_0) x_0 - alpha_1 (e^{-h_1} - 1) D_0
        step i >= 2:           r_i = h_{i-1} / h_i,
                               D = (1 + 1 / (2 r_i)) D_{i-1} - 1 / (2 r_i) D_{i-2},
                               x_i = (sigma_i / sigma_{i-1}) x_{i-1} - alpha_i (e^{-h_i} - 1) D.

    Returns x0_hat at the last time t_end. Second order in h. Deterministic: `generator` is not used.
    """
    ts = time_grid(sde, steps, "logsnr").tolist()
    lams = [float(sde.log_snr(torch.tensor(t, dtype=torch.float64))) for t in ts]
    with torch.no_grad():
        x = x_T.clone()
        d_prev: Tensor | None = None
        h_prev = 0.0
        for i in range(1, steps + 1):
            alpha_p, sigma_p = _coeffs(sde, ts[i - 1])
            alpha_i, sigma_i = _coeffs(sde, ts[i])
            d_cur = (x - sigma_p * eps_fn(x, _time_batch(ts[i - 1], x))) / alpha_p
            h = lams[i] - lams[i - 1]
            if d_prev is None:
                d = d_cur
            else:
                r = h_prev / h
                d = (1.0 + 0.5 / r) * d_cur - (0.5 / r) * d_prev
            # -(e^{-h} - 1) = -expm1(-h), accurate for small h
            x = (sigma_i / sigma_p) * x + (-alpha_i * math.expm1(-h)) * d
            d_prev, h_prev = d_cur, h
        return _denoise(eps_fn, sde, x, ts[-1])


VPSampler = Callable[[EpsFn, "VPSDE", Tensor, int, "torch.Generator | None"], Tensor]

# The VP samplers: train.sample_sampler and --sampler under diffusion.kind=vp.
SAMPLERS: Registry[VPSampler] = Registry("sampler", key="train.sample_sampler", scope=("diffusion.kind", "vp"))
SAMPLERS.add("em", sample_em)
SAMPLERS.add("ddim", sample_ddim)
SAMPLERS.add("dpmpp2m", sample_dpmpp2m)

# Network evaluations per sample at `steps` steps, one entry per SAMPLERS entry (diffusion.network_evaluations):
# one per step, plus the final denoise at t_end.
EVALUATIONS: dict[str, Callable[[int], int]] = {"em": lambda n: n + 1, "ddim": lambda n: n + 1,
                                                "dpmpp2m": lambda n: n + 1}


def sample(
    name: str, eps_fn: EpsFn, sde: VPSDE, x_T: Tensor, steps: int, generator: torch.Generator | None = None
) -> Tensor:
    """Run the sampler called `name` (one of SAMPLERS); `generator` feeds the stochastic ones (em)."""
    return SAMPLERS.choose(name)(eps_fn, sde, x_T, steps, generator)


def clip_denoised(eps_fn: EpsFn, sde: VPSDE, bound: float = 1.0) -> EpsFn:
    """Wrap `eps_fn` so that the implied clean estimate x0_hat = (x - sigma eps) / alpha stays in
    [-bound, bound] (static thresholding, as DDPM/ADM do for images in [-1, 1]).

    Near t = 1, alpha(1) ~ 6.6e-3, so x0_hat amplifies any eps error ~150x; an early or imperfect model
    then sends deterministic (ODE) trajectories far off the data range, where they never recover. The
    wrapper returns the eps consistent with the clipped x0_hat: eps' = (x - alpha x0_clipped) / sigma.
    """

    def wrapped(x: Tensor, t: Tensor) -> Tensor:
        eps = eps_fn(x, t)
        a, s = sde.alpha_sigma(t.double())
        shape = (-1,) + (1,) * (x.ndim - 1)
        a, s = a.to(x.dtype).view(shape), s.to(x.dtype).view(shape)
        x0 = ((x - s * eps) / a).clamp(-bound, bound)
        return (x - a * x0) / s

    return wrapped
