"""Flow matching on the straight path (rectified flow): Lipman et al. 2023, "Flow Matching for Generative
Modeling"; Liu et al. 2023, "Flow Straight and Fast"; Esser et al. 2024, "Scaling Rectified Flow Transformers"
(SD3); Ma et al. 2024, "SiT".

Path (SD3 Sec. 3.1, rectified flow), t in [0, 1], t = 0 data, t = 1 noise:

    x_t = (1 - t) x0 + t eps,    eps ~ N(0, I),    velocity v = dx_t / dt = eps - x0.

The probability-flow ODE dx/dt = v*(x, t) = E[eps - x0 | x_t = x] carries N(0, I) at t = 1 to the data at
t = 0 (Lipman et al. 2023, Thm. 1 with the conditional path above). At a given (x, t) the three predictions
are affine in each other (from x = (1 - t) x0 + t eps and v = eps - x0):

    eps = x + (1 - t) v,            x0 = x - t v,
    v = (eps - x) / (1 - t),        v = (x - x0) / t,
    x0 = (x - t eps) / (1 - t),     eps = (x - (1 - t) x0) / t.

Score (Tweedie): grad log p_t(x) = -E[eps | x_t = x] / t = -(x + (1 - t) v) / t. EDM-equivalent noise level:
x_t / (1 - t) = x0 + sigma eps with sigma = t / (1 - t) (t = sigma / (1 + sigma)); in these terms the flow
ODE is EDM's ODE dy/dsigma = (y - D(y; sigma)) / sigma in y = x / (1 - t).

Other conventions:
- SD3 and diffusers' FlowMatchEulerDiscreteScheduler: the same path and target (z_t = (1 - t) x0 + t eps, the
  network predicts eps - x0); the scheduler's `sigmas` are this t, its `timesteps` 1000 t.
- SiT (its "Linear" path, `ICPlan`): x_t = t x1 + (1 - t) x0 with x0 the noise and x1 the data, so
  t_SiT = 1 - t and its velocity x1 - x0 = -v; its "noise" prediction is eps here, its score the same.

Training (`diffusion.prediction`): the network F is trained on the MSE of its own target, velocity (eps - x0,
the default), eps or x0. `base_loss` (the validation yardstick) is the velocity MSE under uniform weighting,
mean((v_hat - v)^2), whatever the prediction: v_hat - v equals (eps_hat - eps) / (1 - t) and -(x0_hat - x0) / t,
so an eps- or x0-network is measured by its implied velocity. For velocity prediction it is the training loss.

Times: the normalised level s in (t_eps, 1 - t_eps) (what CLTS, the validation bins and the probes draw) is the
quantile of t under the training draw (`diffusion.t_sampling`): uniform t = s, or logit-normal t =
sigmoid(t_mean + t_std Phi^{-1}(s)) (SD3 eq. 19, its default 0, 1), then SD3's resolution shift
t -> shift t / (1 + (shift - 1) t) (SD3 eq. 23, shift = sqrt(m / n)), monotone, so s stays the quantile and
the base draw s ~ U is the training distribution, as for EDM. The samplers step on the grid t_i = shift(1 - i / N),
i = 0..N (the same shift; 1: none).

Network time input: `wrap` puts the backbone in `FlowModel`, called as model(x, t, labels) with the flow time
t itself (so guidance and the diagnostics see t); it feeds the backbone its declared convention (`time_input`):
999 t for `vp_time` (VP's model time at the same t), and EDM's c_noise = ln(sigma) / 4 = logit(t) / 4 of the
EDM-equivalent sigma = t / (1 - t) for `c_noise`.

Guidance (`diffusion/guidance.py`) mixes the model's outputs with weights that sum to one; every prediction is
affine in the velocity with coefficients of (x, t) only, so that is guidance on the velocity whatever the
prediction. The guidance interval is given in sigma = t / (1 - t) (`sigma_of_input`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..config import PREDICTIONS, DiffusionConfig
from ..utils.errors import ConfigError
from ..utils.registry import Registry
from ..utils.rng import draw_normal, draw_uniform

VelocityFn = Callable[[Tensor, Tensor], Tensor]  # v(x, t) with t of shape (B,)

# The ends where the c_noise input logit(t) / 4 is cut (at t = 1 the sampler starts, where sigma is infinite).
C_NOISE_T_CLAMP = 1e-5

# A backbone's declared `time_input` convention -> what it is fed at flow time t (see the module docstring).
TIME_INPUTS: dict[str, Callable[[Tensor], Tensor]] = {
    "vp_time": lambda t: 999.0 * t,
    "c_noise": lambda t: torch.logit(t, eps=C_NOISE_T_CLAMP) / 4,
}


def _normal_quantile(s: Tensor) -> Tensor:
    return math.sqrt(2) * torch.erfinv(2 * s - 1)


# diffusion.t_sampling -> t_base(s, t_mean, t_std): the quantile function of the training time draw (before
# the shift), s in (0, 1), float64.
T_SAMPLINGS: dict[str, Callable[[Tensor, float, float], Tensor]] = {
    "uniform": lambda s, m, sd: s,
    "logit_normal": lambda s, m, sd: torch.sigmoid(m + sd * _normal_quantile(s)),  # SD3 eq. 19
}


def shift_time(t: Tensor | float, shift: float) -> Tensor | float:
    """SD3 eq. 23: t -> shift t / (1 + (shift - 1) t); 0 and 1 stay, shift > 1 moves times towards noise."""
    return t if shift == 1 else shift * t / (1 + (shift - 1) * t)


def _per_sample(v: Tensor, like: Tensor) -> Tensor:
    return v.to(dtype=like.dtype, device=like.device).reshape(-1, *([1] * (like.dim() - 1)))


def _time_batch(t: float, x: Tensor) -> Tensor:
    """t as a (B,) tensor in x's dtype, never below float32 (bf16 cannot tell 0.999 from 1)."""
    dtype = torch.promote_types(x.dtype, torch.float32) if x.is_floating_point() else torch.float32
    return torch.full((x.shape[0],), t, dtype=dtype, device=x.device)


class FlowModel(nn.Module):
    """Wraps a backbone for flow matching: called as model(x, t, labels) with the flow time t in [0, 1], it
    returns the backbone's raw prediction (velocity, eps or x0), feeding the backbone t in its declared
    convention (`net.time_input`, a key of TIME_INPUTS)."""

    backbone_attr = "net"  # the child holding the backbone (diagnostics group its blocks inside it)

    def __init__(self, net: nn.Module):
        super().__init__()
        convention = getattr(net, "time_input", None)
        if convention not in TIME_INPUTS:
            raise TypeError(f"{type(net).__name__} must declare its noise-level input: time_input = one of "
                            f"{', '.join(TIME_INPUTS)} (nn/skip_scaling.py LongSkips)")
        self.net = net
        self.convention = convention

    @property
    def skip_scaling(self):
        return getattr(self.net, "skip_scaling", None)

    def decoder_blocks(self) -> list[nn.Module]:
        return self.net.decoder_blocks()

    def time_feature(self, t: Tensor) -> Tensor:
        """What the backbone sees at flow time t (shape (B,)): 999 t, or logit(t) / 4."""
        return TIME_INPUTS[self.convention](t.to(torch.float32).reshape(-1))

    def forward(self, x: Tensor, t: Tensor, labels: Tensor | None = None) -> Tensor:
        t = torch.as_tensor(t, device=x.device)
        return self.net(x, self.time_feature(t.expand(x.shape[0]) if t.numel() == 1 else t), labels)


# Flow samplers: pure functions of one signature `(velocity, x, ts, generator=None)` over a velocity field
# v(x, t), from x at ts[0] down the decreasing float64 grid `ts`, which ends at t = 0. v is evaluated at t > 0
# only: the last step to 0 is an Euler step, x - t v = x0_hat (Tweedie's estimate in velocity form).


@torch.no_grad()
def sample_euler(velocity: VelocityFn, x: Tensor, ts: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Euler on the probability-flow ODE dx/dt = v(x, t): x <- x + (t_next - t) v(x, t); N evaluations.
    This is DDIM on the flow path (x_next = (1 - t_next) x0_hat + t_next eps_hat). Deterministic: `generator`
    is not used."""
    for t, t_next in zip(ts[:-1].tolist(), ts[1:].tolist()):
        x = x + (t_next - t) * velocity(x, _time_batch(t, x))
    return x


@torch.no_grad()
def sample_heun(velocity: VelocityFn, x: Tensor, ts: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Heun's 2nd-order method on dx/dt = v(x, t) (EDM Alg. 1 with S_churn = 0, in t): the trapezoidal
    correction on every step but the last to t = 0, an Euler step there; 2N - 1 evaluations. `generator` is
    not used."""
    for t, t_next in zip(ts[:-1].tolist(), ts[1:].tolist()):
        d = velocity(x, _time_batch(t, x))
        x_next = x + (t_next - t) * d
        if t_next > 0:
            d2 = velocity(x_next, _time_batch(t_next, x))
            x_next = x + (t_next - t) * 0.5 * (d + d2)
        x = x_next
    return x


@torch.no_grad()
def sample_em(velocity: VelocityFn, x: Tensor, ts: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Euler-Maruyama on a reverse-time SDE with the flow's marginals, diffusion coefficient g(t)^2 = 2 t.

    For any g, running time backwards, dx = [v - g^2 / 2 score] dt + g dw_bar has the marginals p_t of the ODE
    dx/dt = v: in the Fokker-Planck equation the drift -g^2 / 2 score and the diffusion g^2 / 2 Laplacian
    cancel (the derivation of the probability-flow ODE, Song et al. 2021, App. D.1, read backwards; SiT's SDE
    sampler uses this family with a free w_t = g^2 / 2). g^2 = 2 t is SiT's `diffusion_form="sigma"` (norm 1)
    in this time: bounded, fresh noise in proportion to the noise level, none at the data. The score comes from
    the velocity (module docstring): score = -(x + (1 - t) v) / t. A step from t down to t_next, h = t - t_next,
    z ~ N(0, I) from `generator`:

        x <- x - h v + h t score + sqrt(2 t h) z,

    and the last step, to t = 0, is the ODE's Euler step (x0_hat = x - t v, no noise). First order (weak).
    """
    grid = ts.tolist()
    last = len(grid) - 2
    for i, (t, t_next) in enumerate(zip(grid[:-1], grid[1:])):
        v = velocity(x, _time_batch(t, x))
        h = t - t_next
        if i == last:
            x = x - h * v
            continue
        score = -(x + (1 - t) * v) / t
        z = draw_normal(x.shape, generator, x.device, dtype=x.dtype)
        x = x - h * v + (h * t) * score + math.sqrt(2 * t * h) * z
    return x


FlowSampler = Callable[[VelocityFn, Tensor, Tensor, "torch.Generator | None"], Tensor]

# The flow samplers: train.sample_sampler and --sampler under diffusion.kind=flow.
SAMPLERS: Registry[FlowSampler] = Registry("sampler", key="train.sample_sampler", scope=("diffusion.kind", "flow"))
SAMPLERS.add("euler", sample_euler)
SAMPLERS.add("heun", sample_heun)
SAMPLERS.add("em", sample_em)

# Network evaluations per sample at `steps` steps, one entry per SAMPLERS entry (diffusion.network_evaluations):
# heun corrects every step but the last (to t = 0).
EVALUATIONS: dict[str, Callable[[int], int]] = {"euler": lambda n: n, "heun": lambda n: 2 * n - 1,
                                                "em": lambda n: n}


class FlowFormulation:
    """Flow matching over the normalised level s (see the module docstring)."""

    kind = "flow"
    samplers = SAMPLERS
    evaluations = EVALUATIONS  # network evaluations per sample of each sampler at `steps` steps
    ode_sampler = "euler"  # deterministic and first order: what consistency checks sample with
    predictions = PREDICTIONS["flow"]

    def __init__(self, prediction: str = "velocity", t_sampling: str = "uniform", t_mean: float = 0.0,
                 t_std: float = 1.0, shift: float = 1.0, t_eps: float = 1e-5):
        if prediction not in self.predictions or t_sampling not in T_SAMPLINGS:
            raise ConfigError(f"diffusion: flow takes prediction {' | '.join(self.predictions)} and t_sampling "
                              f"{' | '.join(T_SAMPLINGS)}, got {prediction}, {t_sampling}")
        if not (t_std > 0 and shift > 0 and 0 < t_eps < 0.5):
            raise ConfigError(f"diffusion: flow needs t_std > 0, shift > 0 and t_eps in (0, 0.5), got {t_std}, "
                              f"{shift}, {t_eps}")
        self.prediction, self.t_sampling = prediction, t_sampling
        self.t_mean, self.t_std, self.shift, self.t_eps = float(t_mean), float(t_std), float(shift), float(t_eps)

    @classmethod
    def from_config(cls, cfg: DiffusionConfig) -> FlowFormulation:
        return cls(cfg.prediction or cls.predictions[0], cfg.t_sampling, cfg.t_mean, cfg.t_std, cfg.shift,
                   cfg.t_eps)

    def __repr__(self) -> str:
        return (f"FlowFormulation(prediction={self.prediction}, t_sampling={self.t_sampling}, t_mean={self.t_mean}, "
                f"t_std={self.t_std}, shift={self.shift}, t_eps={self.t_eps})")

    # -- normalised level s <-> flow time t ---------------------------------------------------------
    def level_range(self) -> tuple[float, float]:
        """The closed range of the normalised level s: [t_eps, 1 - t_eps]."""
        return self.t_eps, 1 - self.t_eps

    def time(self, s: Tensor) -> Tensor:
        """t(s): the s-quantile of the training time draw, shifted; computed in float64 (float32 on MPS),
        returned in s's floating dtype (float32 for integer s)."""
        s = torch.as_tensor(s)
        out_dtype = s.dtype if s.is_floating_point() else torch.float32
        work = torch.float32 if s.device.type == "mps" else torch.float64
        t = T_SAMPLINGS[self.t_sampling](s.to(work), self.t_mean, self.t_std)
        return shift_time(t, self.shift).to(out_dtype)

    def sample_t(self, batch: int, generator=None, device=None) -> Tensor:
        """s ~ U(t_eps, 1 - t_eps), i.e. t from the training draw (uniform or logit-normal, shifted)."""
        return self.t_eps + (1 - 2 * self.t_eps) * draw_uniform((batch,), generator, device)

    def model_time(self, s: Tensor) -> Tensor:
        """What the trained module (`FlowModel`) is called with: the flow time t(s)."""
        return self.time(s)

    def sigma_of_input(self, t: Tensor) -> Tensor:
        """The EDM-equivalent noise level sigma = t / (1 - t) of the model's time input t (infinite at t = 1):
        the level a guidance interval is given in."""
        t = torch.as_tensor(t)
        return t / (1 - t)

    def wrap(self, net: nn.Module) -> FlowModel:
        return FlowModel(net)

    # -- training ----------------------------------------------------------------------------------
    def perturb(self, x0: Tensor, s: Tensor, noise: Tensor) -> Tensor:
        """x_t = (1 - t) x0 + t noise at t = t(s), t broadcast over the non-batch dims of x0."""
        t = _per_sample(self.time(s).to(x0.device), x0)
        return (1 - t) * x0 + t * noise

    def target(self, x0: Tensor, noise: Tensor) -> Tensor:
        """What the network is trained to output: eps - x0, eps or x0 (`prediction`)."""
        return {"velocity": noise - x0, "eps": noise, "x0": x0}[self.prediction]

    def _error(self, model: nn.Module, x0: Tensor, labels: Tensor | None, s: Tensor,
               noise: Tensor) -> tuple[Tensor, Tensor]:
        """(t, mean over the non-batch dims of (F - target)^2), both (B,), the MSE in >= float32."""
        t = self.time(s).to(x0.device)
        tb = _per_sample(t, x0)
        out = model((1 - tb) * x0 + tb * noise, t, labels)  # `perturb`, with t computed once
        err = (out - self.target(x0, noise)).to(torch.promote_types(out.dtype, torch.float32))
        return t, err.square().reshape(x0.shape[0], -1).mean(dim=1)

    def loss(self, model: nn.Module, x0: Tensor, labels: Tensor | None = None, *, t: Tensor | None = None,
             noise: Tensor | None = None, generator=None) -> Tensor:
        """Per-sample loss (B,): the MSE of the network's own target (velocity, eps or x0) at s = t, uniform
        weighting (the conditional flow matching loss of Lipman et al. 2023 on the straight path, for velocity).
        Missing s and noise are drawn from `generator`, s first, then noise."""
        if t is None:
            t = self.sample_t(x0.shape[0], generator, x0.device)
            if x0.dtype == torch.float64:
                t = t.to(torch.float64)
        if noise is None:
            noise = draw_normal(x0.shape, generator, x0.device, dtype=x0.dtype)
        return self._error(model, x0, labels, t, noise)[1]

    def base_loss(self, model: nn.Module, x0: Tensor, labels: Tensor | None, t: Tensor, noise: Tensor) -> Tensor:
        """Per-sample velocity MSE (B,) at s = t: mean((v_hat - (noise - x0))^2), with v_hat the network's
        implied velocity: the training loss for velocity prediction, the eps-MSE / (1 - t)^2 and the
        x0-MSE / t^2 for the others (module docstring). The validation loss measures it; no timestep-sampler
        weights (CLTS) enter it."""
        time, mse = self._error(model, x0, labels, t, noise)
        time = time.to(mse)
        if self.prediction == "eps":
            return mse / (1 - time) ** 2
        if self.prediction == "x0":
            return mse / time**2
        return mse

    # -- sampling ----------------------------------------------------------------------------------
    def velocity(self, model: nn.Module, x: Tensor, t: Tensor, labels: Tensor | None = None,
                 clip: bool = False) -> Tensor:
        """The velocity implied by the network's output at (x, t), t of shape (B,) in (0, 1]. `clip` keeps the
        implied x0_hat = x - t v in [-1, 1] (images), returning the velocity (x - x0_clipped) / t."""
        out = model(x, t, labels)
        tb = _per_sample(t, x)
        if self.prediction == "eps":
            v = (out - x) / (1 - tb)
        elif self.prediction == "x0":
            v = (x - out) / tb
        else:
            v = out
        if clip:
            v = (x - (x - tb * v).clamp(-1, 1)) / tb
        return v

    def time_grid(self, steps: int, t_max: float | None = None) -> Tensor:
        """steps + 1 decreasing float64 times: shift(t_max (1 - i / steps)), i = 0..steps, ending at 0.
        t_max: 1, or 1 - t_eps for eps-prediction, whose velocity (eps - x) / (1 - t) has no value at t = 1."""
        if int(steps) != steps or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        if t_max is None:
            t_max = 1 - self.t_eps if self.prediction == "eps" else 1.0
        ts = torch.linspace(t_max, 0.0, int(steps) + 1, dtype=torch.float64)
        ts = shift_time(ts, self.shift)
        ts[-1] = 0.0
        return ts

    def generate(self, model: nn.Module, x_T: Tensor, sampler: str, steps: int, labels: Tensor | None = None,
                 generator=None, clip: bool = False) -> Tensor:
        """Samples from x_T ~ N(0, I), the state at the grid's first time, with one of `samplers`."""
        run = self.samplers.choose(sampler)

        def velocity(x: Tensor, t: Tensor) -> Tensor:
            return self.velocity(model, x, t, labels, clip)

        return run(velocity, x_T, self.time_grid(steps), generator)


__all__ = ["EVALUATIONS", "FlowFormulation", "FlowModel", "SAMPLERS", "TIME_INPUTS", "T_SAMPLINGS", "sample_em",
           "sample_euler", "sample_heun", "shift_time"]
